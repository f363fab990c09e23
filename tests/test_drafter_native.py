"""NativeBlock (heads/native.py): a served draft layer's steps on the block kernels compute what
DraftBlock.step computes on the same 8-bit linears, for causal chains, MTP gaps, tree masks and
scratch rows (keep=False), and leave the caches as DraftBlock.step does."""

from __future__ import annotations

import copy

import pytest
import torch
from heads_fixtures import parts

from tandem.drafters.heads.block import DraftBlock
from tandem.drafters.heads.native import NativeBlock
from tandem.drafters.heads.serving import serving_kernels
from tandem.model.kernels import block_kernels

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(block_kernels() is None, reason="needs tandem's CPU block kernels")]


def served_block(seed: int = 0) -> DraftBlock:
    torch.manual_seed(seed)
    block = DraftBlock(parts().config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return serving_kernels(block).eval()


def filled_caches(block: DraftBlock, n: int, origin: int = 0):
    """Two equal caches with n keys at positions origin .. origin + n - 1."""
    cache = block.new_cache(torch.device("cpu"), origin=origin)
    H = parts().config.hidden_size
    x = torch.randn(1, n, H)
    block.step(x, x, torch.arange(origin, origin + n).unsqueeze(0), [cache])
    return cache, copy.deepcopy(cache)


@pytest.mark.parametrize("gap", [1, 2])
def test_chain_steps_match(gap):
    block = served_block()
    native = NativeBlock.of(block)
    assert native is not None
    ref_cache, nat_cache = filled_caches(block, 7, origin=3)
    H = parts().config.hidden_size
    x = torch.randn(1, 3, H)
    positions = torch.arange(10, 13).unsqueeze(0)
    with torch.no_grad():
        expected = block.step(x, x, positions, [ref_cache], gap=gap)
        got = native.step(x, x, positions, [nat_cache], gap=gap)
    torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3)
    assert nat_cache.length == ref_cache.length == 10
    assert nat_cache.positions[:10].tolist() == ref_cache.positions[:10].tolist()
    torch.testing.assert_close(nat_cache.k[:, :10], ref_cache.k[:, :10], rtol=2e-3, atol=2e-3)


def test_masked_rows_match_and_scratch_rows_are_not_kept():
    block = served_block(1)
    native = NativeBlock.of(block)
    ref_cache, nat_cache = filled_caches(block, 5)
    H = parts().config.hidden_size
    x = torch.randn(2, 3, H)
    positions = torch.full((2, 3), 5)
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[:, :5] = True
    mask[0, 5], mask[1, [5, 6]], mask[2, [5, 7]] = True, True, True  # a small tree: 5 <- 6, 5 <- 7
    ref2, nat2 = copy.deepcopy(ref_cache), copy.deepcopy(nat_cache)
    with torch.no_grad():
        expected = torch.cat([block.step(x[r : r + 1], x[r : r + 1], positions[r : r + 1], [c], masks=[mask])
                              for r, c in enumerate((ref_cache, ref2))])
        got = native.step(x, x, positions, [nat_cache, nat2], masks=[mask, mask], keep=False)
    torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3)
    assert nat_cache.length == nat2.length == 5  # scratch: the rows' keys were written, not kept


def test_only_served_blocks_take_the_native_path():
    torch.manual_seed(0)
    assert NativeBlock.of(DraftBlock(parts().config)) is None  # fp32 nn.Linear: the PyTorch path
