"""KVCache.keep: a chain's accepted prefix is a truncation, a tree's accepted path a gather."""

import torch

from conftest import tiny_loaded
from tandem.engine.request import HiddenRows
from tandem.model.kv_cache import KVCache


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


def test_hidden_rows_accumulate_until_taken():
    rows = HiddenRows()
    rows.add({2: torch.ones(1, 4)})
    rows.add({2: torch.zeros(2, 4)})
    taken = rows.take()
    assert taken[2].shape == (3, 4) and taken[2][0].sum() == 4
    assert rows.take() == {}
