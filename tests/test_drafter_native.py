"""NativeBlock (heads/native.py): a served draft layer's steps on the block kernels compute what
DraftBlock.step computes on the same 8-bit linears, for causal chains, MTP gaps, tree masks and
scratch rows (keep=False), and leave the caches as DraftBlock.step does."""

from __future__ import annotations

import copy

import pytest
import torch
from heads_fixtures import parts

from tandem.drafters.heads.block import DraftBlock
from tandem.drafters.heads.native import NativeBlock, path_keys, path_mask
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
        got, logits = native.step(x, x, positions, [nat_cache], gap=gap)
    assert logits is None
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
        got, _ = native.step(x, x, positions, [nat_cache, nat2], masks=[mask, mask], keep=False)
    torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3)
    assert nat_cache.length == nat2.length == 5  # scratch: the rows' keys were written, not kept


def test_only_served_blocks_take_the_native_path():
    torch.manual_seed(0)
    assert NativeBlock.of(DraftBlock(parts().config)) is None  # fp32 nn.Linear: the PyTorch path


def served_norm(H: int, seed: int) -> torch.nn.RMSNorm:
    torch.manual_seed(seed)
    norm = torch.nn.RMSNorm(H, eps=parts().config.rms_norm_eps)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    return norm


def served_vocab(H: int, V: int = 96, seed: int = 5):
    """(norm, 8-bit block projection) of a head's own vocabulary."""
    torch.manual_seed(seed)
    head = serving_kernels(torch.nn.Sequential(torch.nn.Linear(H, V, bias=False)))
    return served_norm(H, seed + 1), head[0]


def eagle3_block(seed: int = 2) -> DraftBlock:
    """A served block whose attention input is [embedding | feature] (2H wide), as EAGLE-3's."""
    torch.manual_seed(seed)
    cfg = parts().config
    block = DraftBlock(cfg, attn_in_features=2 * cfg.hidden_size)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return serving_kernels(block).eval()


@pytest.mark.parametrize("pieces", [1, 2])
def test_input_norms_are_fused_into_the_step(pieces):
    """The attention input's norms (one, or one per half: EAGLE-3's [embedding | feature]) run
    inside the native call: the same layer output as norming first and stepping after."""
    block = eagle3_block() if pieces == 2 else served_block(3)
    H = parts().config.hidden_size
    norms = tuple(served_norm(H, 10 + i) for i in range(pieces))
    native = NativeBlock.of(block, norms)
    ref_cache, nat_cache = filled_caches_wide(block, 6, pieces)
    x, raw = torch.randn(1, 2, H), torch.randn(1, 2, pieces * H)
    normed = torch.cat([n(p) for n, p in zip(norms, raw.chunk(pieces, -1))], -1)
    positions = torch.arange(6, 8).unsqueeze(0)
    with torch.no_grad():
        expected = block.step(x, normed, positions, [ref_cache])
        got, _ = native.step(x, raw, positions, [nat_cache])
    torch.testing.assert_close(got, expected, rtol=3e-3, atol=3e-3)


def filled_caches_wide(block: DraftBlock, n: int, pieces: int):
    cache = block.new_cache(torch.device("cpu"))
    H = parts().config.hidden_size
    block.step(torch.randn(1, n, H), torch.randn(1, n, pieces * H), torch.arange(n).unsqueeze(0), [cache])
    return cache, copy.deepcopy(cache)


def test_vocab_logits_come_from_the_same_call():
    """With a vocabulary head, the step also returns projection(norm(out)) of each request's
    last row ("last") or of every row ("all"), as the projection computes them itself."""
    block = served_block(4)
    H = parts().config.hidden_size
    norm, projection = served_vocab(H)
    native = NativeBlock.of(block, vocab=(norm, projection))
    assert native.has_vocab
    caches = [filled_caches(block, 5)[0], filled_caches(block, 9)[0]]
    x = torch.randn(2, 3, H)
    positions = torch.tensor([[5, 6, 7], [9, 10, 11]])
    with torch.no_grad():
        for mode in ("last", "all"):
            trial = [copy.deepcopy(c) for c in caches]
            out, logits = native.step(x, x, positions, trial, logits=mode)
            rows = out[:, -1] if mode == "last" else out.reshape(-1, H)
            torch.testing.assert_close(logits, projection(norm(rows)), rtol=2e-3, atol=2e-3)


def test_requests_in_one_call_do_not_touch_each_other():
    """Several requests, caches of different lengths and capacities, in one native call: each
    request's output, logits and cache are bit for bit those of the call over it alone."""
    block = served_block(6)
    H = parts().config.hidden_size
    native = NativeBlock.of(block, vocab=served_vocab(H))
    short, _ = filled_caches(block, 3)
    long, _ = filled_caches(block, 70)  # grown past the first capacity (64)
    assert short.k.shape[1] != long.k.shape[1]
    x = torch.randn(2, 2, H)
    positions = torch.tensor([[3, 4], [70, 71]])
    together = [copy.deepcopy(short), copy.deepcopy(long)]
    alone = [copy.deepcopy(short), copy.deepcopy(long)]
    with torch.no_grad():
        out, logits = native.step(x, x, positions, together, logits="all")
        for r in range(2):
            out_r, logits_r = native.step(x[r : r + 1], x[r : r + 1], positions[r : r + 1], [alone[r]], logits="all")
            assert torch.equal(out[r], out_r[0])
            assert torch.equal(logits[2 * r : 2 * r + 2], logits_r)
            n = alone[r].length
            assert together[r].length == n and torch.equal(together[r].k[:, :n], alone[r].k[:, :n])


@pytest.mark.parametrize("whole", [False, True])
def test_the_keys_rules_equal_their_masks(whole):
    """A chain's rule (each row its cache up to its own slot) and a block's (`whole`: every slot)
    give bit for bit what the same visibility given as a mask gives."""
    block = served_block(7)
    H = parts().config.hidden_size
    native = NativeBlock.of(block)
    by_rule, by_mask = filled_caches(block, 5)
    x = torch.randn(1, 3, H)
    positions = torch.arange(5, 8).unsqueeze(0)
    mask = torch.ones(3, 8, dtype=torch.bool) if whole else torch.ones(3, 8, dtype=torch.bool).tril(5)
    with torch.no_grad():
        ruled, _ = native.step(x, x, positions, [by_rule], whole=whole, keep=not whole)
        masked, _ = native.step(x, x, positions, [by_mask], masks=[mask], keep=not whole)
    assert torch.equal(ruled, masked)


def eagle3_chain_parts(seed: int = 8):
    block = eagle3_block(seed)
    H = parts().config.hidden_size
    norms = (served_norm(H, seed + 1), served_norm(H, seed + 2))
    vocab = served_vocab(H, V=96, seed=seed + 3)
    torch.manual_seed(seed)
    embed = torch.randn(parts().config.vocab_size, H)
    vocab_ids = torch.randperm(parts().config.vocab_size)[:96].sort().values
    return NativeBlock.of(block, norms, vocab), embed, vocab_ids


def stepped_chain(native, feat, logits, caches, positions, budgets, vocab_ids, embed, scale):
    """What NativeBlock.chain does, one native step per draft token from Python."""
    drafts = []
    for r, cache in enumerate(caches):
        tokens, f, lg, length = [], feat[r : r + 1], logits[r], cache.length
        for s in range(budgets[r]):
            if not torch.isfinite(lg).all():
                break
            tokens.append(int(vocab_ids[int(lg.argmax())]))
            if len(tokens) == budgets[r]:
                break
            raw = torch.cat([embed[tokens[-1]] * scale, f[0]]).view(1, 1, -1)
            out, lgs = native.step(f.view(1, 1, -1), raw, torch.tensor([[positions[r] + s]]), [cache], logits="last")
            f, lg = out[:, 0], lgs[0]
        cache.truncate(length)
        drafts.append(tokens)
    return drafts


def test_a_native_chain_drafts_what_native_steps_draft():
    """NativeBlock.chain (the greedy EAGLE-3 chain in one call) gives the tokens of the same
    steps run one by one, per request, with different budgets, and leaves cache lengths alone;
    a request whose logits hold a NaN drafts nothing."""
    native, embed, vocab_ids = eagle3_chain_parts()
    H = parts().config.hidden_size
    block = native.block
    caches = [filled_caches_wide(block, n, 2)[0] for n in (4, 9, 6)]
    feat = torch.randn(3, H)
    logits = torch.randn(3, 96) * 3
    logits[2, 5] = float("nan")
    positions, budgets = [4, 9, 6], [4, 2, 3]
    stepped = [copy.deepcopy(c) for c in caches]
    with torch.no_grad():
        expected = stepped_chain(native, feat, logits, stepped, positions, budgets, vocab_ids, embed, 1.5)
        got = native.chain(feat, logits, caches, positions, budgets, vocab_ids, embed, 1.5)
    assert got == expected
    assert [len(d) for d in got] == [4, 2, 0]
    assert [c.length for c in caches] == [4, 9, 6]
    # The draft steps' keys (scratch slots after `length`: their rope position, the token's
    # embedding and the feature fed) are the same bits too.
    for cache, ref, draft in zip(caches, stepped, got):
        fed = slice(cache.length, cache.length + max(len(draft) - 1, 0))
        assert torch.equal(cache.k[:, fed], ref.k[:, fed]) and torch.equal(cache.v[:, fed], ref.v[:, fed])


def stepped_tree(native, feat, logits, cache, position, topk, depth, vocab_ids, embed, scale):
    """What NativeBlock.trees does for one request, one native step per level from Python
    (EagleDrafter._grow_tree's loop on the native path): (tokens, parents, scores)."""
    tokens, parents, scores, slot_of = [], [], [], {}
    prefix, length = cache.length, cache.length
    frontier, frontier_scores, feats = [-1], torch.zeros(1), feat.view(1, -1)
    for d in range(1, depth + 1):
        if not torch.isfinite(logits).all():
            break
        k = min(topk, logits.shape[-1])
        logp, ids = torch.log_softmax(logits, -1).topk(k, dim=-1)
        child_scores = (frontier_scores[:, None] + logp).flatten()
        first = len(tokens)
        for n, (i, score) in enumerate(zip(ids.flatten().tolist(), child_scores.tolist())):
            tokens.append(int(vocab_ids[i]))
            parents.append(frontier[n // k])
            scores.append(score)
        if d == depth:
            break
        best = child_scores.topk(min(topk, len(child_scores))).indices
        expand = [first + int(i) for i in best]
        for j, n in enumerate(expand):
            slot_of[n] = cache.length + j
        paths = []
        for n in expand:
            path, node = [], n
            while node >= 0:
                path.append(slot_of[node])
                node = parents[node]
            paths.append(path[::-1])
        fed = feats[torch.div(best, k, rounding_mode="floor")]
        raw = torch.cat([embed[[tokens[n] for n in expand]] * scale, fed], dim=-1).unsqueeze(0)
        positions = torch.full((1, len(expand)), position + d - 1)
        out, logits = native.step(fed.unsqueeze(0), raw, positions, [cache],
                                  masks=[path_keys(prefix, paths, positions[0])], logits="all")
        feats, frontier, frontier_scores = out[0], expand, child_scores[best]
    cache.truncate(length)
    return tokens, parents, scores


@pytest.mark.parametrize("topk", [2, 3])
def test_native_trees_grow_what_native_steps_grow(topk):
    """NativeBlock.trees (the EAGLE-2 trees of several requests in one call) gives each request
    the nodes, parents and (within rounding of the log-softmax) scores of its own levels stepped
    from Python, with caches of different lengths and trees of different depths, writes the same
    scratch keys and leaves the caches' lengths alone; a request whose root logits hold a NaN
    grows nothing and the others are untouched by it."""
    native, embed, vocab_ids = eagle3_chain_parts(11)
    H = parts().config.hidden_size
    lengths, depths = [7, 12, 5, 9], [4, 3, 1, 2]
    caches = [filled_caches_wide(native.block, n, 2)[0] for n in lengths]
    stepped = [copy.deepcopy(c) for c in caches]
    torch.manual_seed(topk)
    feat, logits = torch.randn(4, H), torch.randn(4, 96) * 3
    logits[3, 5] = float("nan")
    with torch.no_grad():
        expected = [stepped_tree(native, feat[r], logits[r : r + 1], stepped[r], lengths[r], topk, depths[r], vocab_ids,
                                 embed, 1.5) for r in range(4)]
        got = native.trees(feat, logits, caches, lengths, topk, depths, vocab_ids, embed, 1.5)
    for r, ((tokens, parents, scores), ref) in enumerate(zip(got, expected)):
        assert (tokens, parents) == ref[:2]
        torch.testing.assert_close(torch.tensor(scores), torch.tensor(ref[2]), rtol=1e-5, atol=1e-5)
        assert len(tokens) == (0 if r == 3 else topk + (depths[r] - 1) * topk * topk)
        assert caches[r].length == lengths[r]
        fed = slice(lengths[r], lengths[r] + (depths[r] - 1) * topk)
        assert torch.equal(caches[r].k[:, fed], stepped[r].k[:, fed]) and torch.equal(caches[r].v[:, fed], stepped[r].v[:, fed])


def test_a_trees_paths_as_keys_equal_them_as_a_mask():
    """A frontier's visibility given as path_keys (the prefix, then each node's path) computes
    what the same visibility as path_mask does, bit for bit."""
    block = served_block(9)
    H = parts().config.hidden_size
    native = NativeBlock.of(block)
    by_keys, by_mask = filled_caches(block, 5)
    depth1 = torch.randn(1, 2, H)
    for cache in (by_keys, by_mask):  # two tree nodes at slots 5 and 6 (depth 1)
        native.step(depth1, depth1, torch.full((1, 2), 5), [cache], masks=[path_keys(5, [[5], [6]], torch.full((2,), 5))])
    torch.manual_seed(1)
    x = torch.randn(1, 3, H)
    positions = torch.full((1, 3), 6)
    paths = [[5, 7], [5, 8], [6, 9]]  # depth 2: children of both
    with torch.no_grad():
        keyed, _ = native.step(x, x, positions, [by_keys], masks=[path_keys(5, paths, positions[0])])
        masked, _ = native.step(x, x, positions, [by_mask], masks=[path_mask(5, paths, 10)])
    assert torch.equal(keyed, masked)


def test_ragged_rows_of_several_requests_equal_each_request_alone():
    """NativeBlock.rows: requests with different numbers of new rows (a batch's catch-ups) in
    one call give each request's output, last-row logits and keys bit for bit as alone."""
    block = served_block(11)
    H = parts().config.hidden_size
    native = NativeBlock.of(block, vocab=served_vocab(H))
    first, _ = filled_caches(block, 4)
    second, _ = filled_caches(block, 66, origin=2)  # its own capacity, positions starting at 2
    counts = [3, 1]
    x = torch.randn(sum(counts), H)
    positions = torch.tensor([4, 5, 6, 68])
    together = [copy.deepcopy(first), copy.deepcopy(second)]
    with torch.no_grad():
        out, logits = native.rows(x, x, positions, counts, together, logits="last")
        start = 0
        for r, (cache, n) in enumerate(zip((first, second), counts)):
            rows = slice(start, start + n)
            alone, alone_logits = native.rows(x[rows], x[rows], positions[rows], [n], [cache], logits="last")
            assert torch.equal(out[rows], alone) and torch.equal(logits[r], alone_logits[0])
            assert together[r].length == cache.length
            assert torch.equal(together[r].k[:, : cache.length], cache.k[:, : cache.length])
            start += n


def test_context_keys_of_several_requests_in_one_call_equal_each_alone():
    """write_keys over several requests' rows (one projection, one attention call) writes
    each cache's keys, values and positions as a call per request does, norm fused or not."""
    block = served_block(12)
    H = parts().config.hidden_size
    native = NativeBlock.of(block)
    norm = served_norm(H, 13)
    counts = [2, 5]
    x = torch.randn(sum(counts), H)
    positions = torch.tensor([7, 8, 3, 4, 5, 6, 7])
    for fused in (None, norm):
        base = [filled_caches(block, 7)[0], filled_caches(block, 3)[0]]
        together, alone = copy.deepcopy(base), copy.deepcopy(base)
        with torch.no_grad():
            native.write_keys(x, positions, counts, together, norm=fused)
            start = 0
            for cache, n in zip(alone, counts):
                native.write_keys(x[start : start + n], positions[start : start + n], [n], [cache], norm=fused)
                start += n
        for a, b in zip(together, alone):
            n = b.length
            assert a.length == n and torch.equal(a.k[:, :n], b.k[:, :n]) and torch.equal(a.v[:, :n], b.v[:, :n])
            assert a.positions[:n].tolist() == b.positions[:n].tolist()
