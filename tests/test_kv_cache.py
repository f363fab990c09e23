"""KVCache.keep: a chain's accepted prefix is a truncation, a tree's accepted path a gather."""

import pytest
import torch

from conftest import tiny_loaded
from tandem.engine.request import HiddenRows
from tandem.model.kv_cache import KEY_BLOCK, KVCache


def filled_cache():
    cfg = tiny_loaded("llama")[1].config
    cache = KVCache(cfg, 1, 32, torch.float32)
    seq = cache.allocate()
    cache.reserve(seq, 10)  # the committed prefix
    start = cache.reserve(seq, 5)  # a forward's 5 new tokens at slots 10..14
    cache.k[:, seq, :, start : start + 5] = torch.arange(5.0).view(1, 1, 5, 1)
    return cache, seq, start


def test_keep_a_chain_prefix_truncates():
    cache, seq, start = filled_cache()
    cache.keep(seq, [0, 1, 2])
    assert cache.lengths[seq] == start + 3
    assert cache.k[0, seq, 0, start : start + 3, 0].tolist() == [0.0, 1.0, 2.0]


def test_keep_a_tree_path_gathers_its_rows():
    cache, seq, start = filled_cache()
    cache.keep(seq, [0, 2, 4])
    assert cache.lengths[seq] == start + 3
    assert cache.k[0, seq, 0, start : start + 3, 0].tolist() == [0.0, 2.0, 4.0]
    assert cache.slot_positions[seq, start : start + 3].tolist() == [start, start + 1, start + 2]


def blocked_cache(max_len=40):
    """A cache whose keys are stored in blocks of 16 slots, with key (layer l, head h, slot s)
    filled with the value 1000 l + 100 h + s in every dim; values as in filled_cache."""
    cfg = tiny_loaded("llama")[1].config
    cache = KVCache(cfg, 2, max_len, torch.float32)
    cache.block_keys()
    slots = -(-max_len // 16) * 16  # whole blocks
    assert cache.keys_blocked and cache.slots_per_row == slots and cache.k.shape[3:] == (slots // 16, cfg.head_dim, 16)
    return cache


def logical_key(cache, layer, seq, head, slot):
    return cache.k[layer, seq, head, slot // KEY_BLOCK, :, slot % KEY_BLOCK]


def write_keys(cache, seq, start, n):
    for slot in range(start, start + n):
        for layer in range(cache.k.shape[0]):
            for head in range(cache.k.shape[2]):
                logical_key(cache, layer, seq, head, slot).fill_(1000 * layer + 100 * head + slot)
        cache.v[:, seq, :, slot] = float(slot)


def test_a_blocked_tree_path_gathers_its_keys():
    """commit_path on keys stored in blocks moves each key's dims to its new slot, across a
    block boundary too; values move as before."""
    cache = blocked_cache()
    seq = cache.allocate()
    cache.reserve(seq, 12)
    start = cache.reserve(seq, 8)  # nodes at slots 12..19: the block boundary at 16 inside
    write_keys(cache, seq, 0, 20)
    cache.keep(seq, [0, 5, 7])  # slots 12, 17, 19 -> 12, 13, 14
    assert cache.lengths[seq] == start + 3
    for layer, head in ((0, 0), (1, 1)):
        got = [logical_key(cache, layer, seq, head, start + i)[0].item() for i in range(3)]
        assert got == [1000 * layer + 100 * head + slot for slot in (12, 17, 19)]
        assert logical_key(cache, layer, seq, head, 11).eq(1000 * layer + 100 * head + 11).all()  # the prefix stays
    assert cache.v[0, seq, 0, start : start + 3, 0].tolist() == [12.0, 17.0, 19.0]


def test_a_blocked_prefix_is_copied_whole():
    cache = blocked_cache()
    src = cache.allocate()
    cache.reserve(src, 20)
    write_keys(cache, src, 0, 20)
    dst = cache.allocate()
    cache.copy_prefix(src, dst, 18)
    assert cache.lengths[dst] == 18
    for slot in (0, 15, 16, 17):
        assert torch.equal(logical_key(cache, 1, dst, 1, slot), logical_key(cache, 1, src, 1, slot))
    assert torch.equal(cache.v[:, dst, :, :18], cache.v[:, src, :, :18])


def test_keys_change_layout_only_before_anything_is_written():
    cfg = tiny_loaded("llama")[1].config
    cache = KVCache(cfg, 1, 32, torch.float32)
    cache.reserve(cache.allocate(), 3)
    with pytest.raises(ValueError, match="before anything is written"):
        cache.block_keys()


def test_a_released_blocked_row_reads_zeros_again():
    cache = blocked_cache(max_len=4096)
    seq = cache.allocate()
    cache.reserve(seq, 20)
    write_keys(cache, seq, 0, 20)
    cache.release(seq)
    assert cache.k[:, seq].abs().sum() == 0 and cache.v[:, seq].abs().sum() == 0


def test_hidden_rows_accumulate_until_taken():
    rows = HiddenRows()
    rows.add({2: torch.ones(1, 4)})
    rows.add({2: torch.zeros(2, 4)})
    taken = rows.take()
    assert taken[2].shape == (3, 4) and taken[2][0].sum() == 4
    assert rows.take() == {}


def test_hidden_rows_take_a_forwards_rows_by_slice_or_index_and_grow_without_moving_taken_rows():
    rows = HiddenRows()
    stacked = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)  # layers (1, 5), 6 rows
    rows.add_stacked((1, 5), stacked, slice(1, 3))
    rows.add_stacked((1, 5), stacked, [5, 0])
    assert len(rows) == 4
    first = rows.take()
    assert torch.equal(first[1], stacked[0, [1, 2, 5, 0]]) and torch.equal(first[5], stacked[1, [1, 2, 5, 0]])
    kept = first[5].clone()
    for _ in range(40):  # past the buffer's capacity: it grows into a new one
        rows.add_stacked((1, 5), stacked, slice(0, 6))
    assert len(rows) == 240 and torch.equal(first[5], kept)  # what take returned is untouched
    later = rows.take()
    assert torch.equal(later[1][-6:], stacked[0]) and len(rows) == 0
    with pytest.raises(ValueError, match="layers"):
        rows.add_stacked((1, 7), stacked, slice(0, 1))
    with pytest.raises(ValueError, match="keep_all"):
        rows.first(2)


def test_hidden_rows_keep_all_keeps_taken_rows_for_the_prefix_cache():
    rows = HiddenRows(keep_all=True)
    rows.add({3: torch.ones(2, 4)})
    rows.take()
    for i in range(30):
        rows.add({3: torch.full((1, 4), float(i))})
    assert len(rows) == 30
    everything = rows.first(100)[3]
    assert everything.shape == (32, 4) and everything[:2].eq(1).all() and everything[-1].eq(29).all()
    assert rows.first(2)[3].eq(1).all()
