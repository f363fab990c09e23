"""Trained-head drafters end to end: build -> train a little -> save -> load -> draft through the
engine with greedy output identical to plain decoding; the saved module drafts like the trained
one; loading against another target is refused; under sampling the committed tokens follow the
target's distribution (tandem.audit's checks, fed the hidden states the heads read)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from conftest import tiny_loaded
from heads_fixtures import hf_tokenizer, make_batch, parts, sharp_target, train

from tandem.audit import Auditor, audit_rounds
from tandem.config import EngineConfig, SamplingParams, SpecConfig
from tandem.drafters import DraftInput
from tandem.drafters.heads.base import TargetParts
from tandem.drafters.heads.io import build_head, load_head, save_head
from tandem.llm import LLM
from tandem.model.kv_cache import KVCache
from tandem.model.runner import ModelRunner, SeqInput

pytestmark = pytest.mark.usefixtures("one_thread")

# variant -> (method, build options, training steps, learning rate). eagle3-small drafts over
# a third of the vocabulary: the target's tokens outside it must never break verification.
METHODS = {
    "medusa": ("medusa", dict(num_heads=3), 30, 1e-2),
    "eagle": ("eagle", dict(), 30, 3e-3),
    "eagle3": ("eagle3", dict(unroll_steps=3), 30, 3e-3),
    "eagle3-small": ("eagle3", dict(unroll_steps=3, draft_vocab=list(range(0, 97, 3))), 30, 3e-3),
    "mtp": ("mtp", dict(depth=3), 30, 3e-3),
    "draft_model": ("draft_model", dict(num_layers=1), 30, 3e-3),
    "dflash": ("dflash", dict(block_size=6, anchors_per_sequence=12), 60, 5e-3),
    "dspark": ("dspark", dict(block_size=5, anchors_per_sequence=12, rank=32), 60, 5e-3),
}
PROMPTS = [[5, 17, 33, 8, 91, 4], [60, 61, 62], [7] * 11 + [12, 13]]
# The second prompt's first answer, then the prompt again: the target's answer cycles through tokens
# its context holds, so the suffix lookup drafts several of them.
COPYING_PROMPTS = [[60, 61, 62, 60] + [71] * 13 + [80, 68, 68, 68, 68, 68, 60, 61, 62], PROMPTS[0]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@functools.lru_cache(maxsize=None)
def trained(variant: str):
    method, options, steps, lr = METHODS[variant]
    p, batch = parts(), make_batch()
    torch.manual_seed(0)  # the head's initialisation does not depend on which test ran first
    head = build_head(method, p, **options)
    train(head, batch, p, steps=steps, lr=lr)
    return head


@pytest.fixture(scope="module", name="saved")
def saved_fixture(tmp_path_factory):
    """variant -> directory of the trained, saved head."""
    out = {}

    def get(variant: str):
        if variant not in out:
            out[variant] = save_head(trained(variant), tmp_path_factory.mktemp(variant), "sharp-qwen2-0", {"steps": 1},
                                    tokenizer=hf_tokenizer())
        return out[variant]

    return get


def make_llm(variant: str | None, path=None, k: int = 3, max_num_seqs: int = 4, **spec_options) -> LLM:
    method = METHODS[variant][0] if variant in METHODS else variant
    spec = SpecConfig(algorithm=method, num_draft_tokens=k, draft_model_path=str(path) if path else None,
                      **spec_options) if method else SpecConfig()
    return LLM.from_loaded(sharp_target(), EngineConfig(max_model_len=128, max_num_seqs=max_num_seqs, spec=spec))


@functools.lru_cache(maxsize=None)
def plain(params: SamplingParams = GREEDY, prompts: tuple[tuple[int, ...], ...] | None = None) -> tuple[tuple[int, ...], ...]:
    prompts = PROMPTS if prompts is None else [list(p) for p in prompts]
    return tuple(tuple(o.token_ids) for o in make_llm(None).generate(prompts, params))


@pytest.mark.parametrize("variant", list(METHODS))
def test_saved_head_drafts_like_the_trained_one(variant, saved):
    p, batch = parts(), make_batch()
    loaded = load_head(saved(variant), p)
    assert type(loaded) is type(trained(variant)) and loaded.config_dict() == trained(variant).config_dict()
    torch.testing.assert_close(loaded.draft_accuracy(batch, p, 3), trained(variant).draft_accuracy(batch, p, 3))
    for name, value in trained(variant).state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, msg=name)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("variant", list(METHODS))
def test_greedy_identity_through_the_engine(variant, k, saved):
    llm = make_llm(variant, saved(variant), k)
    out = llm.generate(PROMPTS, GREEDY)
    assert tuple(tuple(o.token_ids) for o in out) == plain()
    stats = llm.engine.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0


TREE_VARIANTS = ["eagle", "eagle3", "eagle3-small"]


@pytest.mark.parametrize("topk, nodes, steps", [(2, 6, 3), (3, 12, 4), (4, 24, 6)])
@pytest.mark.parametrize("variant", TREE_VARIANTS)
def test_tree_greedy_identity_through_the_engine(variant, topk, nodes, steps, saved):
    llm = make_llm(variant, saved(variant), nodes, eagle_topk=topk, num_steps=steps)
    out = llm.generate(PROMPTS, GREEDY)
    assert tuple(tuple(o.token_ids) for o in out) == plain()
    stats = llm.engine.stats
    assert stats.num_draft_tokens > stats.num_drafts  # trees: several nodes per round
    assert stats.num_accepted_tokens > 0
    assert len(stats.accepted_per_position) <= steps


@pytest.mark.parametrize("variant", ["eagle3", "eagle3-small"])
def test_a_batchs_trees_are_each_requests_own(variant, saved):
    """On the kernels every tree of a batch grows in one native call: each request's first tree
    is the one it grows alone."""
    def first_trees(prompts):
        llm = make_llm(variant, saved(variant), 10, eagle_topk=3, num_steps=4)
        drafter = llm.engine.drafter
        assert drafter._drafts_natively()
        propose, rounds = drafter.propose, []
        drafter.propose = lambda batch: rounds.append(propose(batch)) or rounds[-1]
        llm.generate(prompts, GREEDY)
        return rounds[0]

    together = first_trees(PROMPTS)
    assert len(together) == len(PROMPTS)
    for prompt, tree in zip(PROMPTS, together):
        alone = first_trees([prompt])[0]
        assert (tree.token_ids, tree.parents) == (alone.token_ids, alone.parents) and len(tree) > 1


@pytest.mark.parametrize("variant", TREE_VARIANTS)
def test_tree_drafts_are_well_formed_best_first_trees(variant, saved):
    """Each round's tree: at most num_draft_tokens nodes, at most num_steps deep, parents before
    children, distinct siblings, and a tree at least as likely to hold the chain's draft."""
    llm = make_llm(variant, saved(variant), 10, eagle_topk=3, num_steps=4)
    drafter = llm.engine.drafter
    seen = []
    propose = drafter.propose
    drafter.propose = lambda batch: seen.extend(propose(batch)) or seen[-len(batch):]
    llm.generate(PROMPTS, GREEDY)
    assert seen
    for draft in seen:
        assert draft.is_tree and 0 < len(draft) <= 10 and draft.depth <= 4
        assert all(-1 <= p < i for i, p in enumerate(draft.parents))
        siblings = {}
        for token, parent in zip(draft.token_ids, draft.parents):
            assert token not in siblings.setdefault(parent, set())
            siblings[parent].add(token)
    # The greedy chain's first draft token is the root's top-1 child: the tree's first node.
    chain = make_llm(variant, saved(variant), 4)
    chain_seen = []
    chain_propose = chain.engine.drafter.propose
    chain.engine.drafter.propose = lambda batch: chain_seen.extend(chain_propose(batch)) or chain_seen[-len(batch):]
    chain.generate(PROMPTS[:1], GREEDY)
    tree = make_llm(variant, saved(variant), 10, eagle_topk=3, num_steps=4)
    tree_seen = []
    tree_propose = tree.engine.drafter.propose
    tree.engine.drafter.propose = lambda batch: tree_seen.extend(tree_propose(batch)) or tree_seen[-len(batch):]
    tree.generate(PROMPTS[:1], GREEDY)
    assert chain_seen[0].token_ids[0] == tree_seen[0].token_ids[0]


def test_chain_drafters_refuse_trees():
    with pytest.raises(ValueError, match="drafts chains only.*eagle, eagle3"):
        make_llm("ngram", None, 4, eagle_topk=2)


@pytest.mark.parametrize("variant", list(METHODS))
def test_seeded_sampling_is_reproducible_and_batch_invariant(variant, saved):
    params = SamplingParams(temperature=0.8, max_tokens=15, seed=3, ignore_eos=True)
    llm = make_llm(variant, saved(variant))
    batched = [o.token_ids for o in llm.generate(PROMPTS, params)]
    single = [make_llm(variant, saved(variant)).generate(p, params)[0].token_ids for p in PROMPTS]
    assert batched == single


@pytest.mark.parametrize("variant", list(METHODS))
def test_a_sampled_drafts_q_is_the_processed_law_it_was_drawn_from(variant, saved):
    """Under temperature 0.7 and top_k 3, each draft token's reported q_j is its position's
    processed distribution: at most 3 tokens carry mass, it sums to 1, and x_j is one of them. A q
    taken before the processors (or from another position) grades the draft against another law,
    and the sampled audit's near one-hot target cannot see it."""
    llm = make_llm(variant, saved(variant), k=3, lookup=False)
    drafter = llm.engine.drafter
    ctx = PROMPTS[0]
    hidden = prefill_hidden(llm, ctx)
    params = SamplingParams(temperature=0.7, top_k=3)
    drafts = drafter.propose([DraftInput(f"r{i}", ctx, len(ctx), 3, params, torch.Generator().manual_seed(i), hidden)
                              for i in range(32)])
    checked = 0
    for d in drafts:
        for j, token in enumerate(d.token_ids):
            q = d.probs[j].float()
            assert int((q > 0).sum()) <= 3 and abs(float(q.sum()) - 1) < 1e-4 and float(q[token]) > 0, (j, token)
            checked += 1
    assert checked >= 32


@pytest.mark.parametrize("variant", list(METHODS))
def test_wrong_target_is_refused(variant, saved):
    other_shape = TargetParts.from_loaded(tiny_loaded("llama")[1])  # 2 layers instead of 4
    with pytest.raises(ValueError, match="trained for target 'sharp-qwen2-0'.*num_layers 4 vs 2"):
        load_head(saved(variant), other_shape)
    same_shape = TargetParts.from_loaded(sharp_target("qwen2", seed=1))  # other weights
    with pytest.raises(ValueError, match="same shapes but different weights"):
        load_head(saved(variant), same_shape)
    if METHODS[variant][0] == "draft_model":
        return  # served as a model: the draft_model drafter checks the vocabulary, not the head record
    with pytest.raises(ValueError, match="trained for target"):
        LLM.from_loaded(tiny_loaded("llama")[1], EngineConfig(spec=SpecConfig(METHODS[variant][0], 3, str(saved(variant)))))


@pytest.mark.parametrize("variant", [v for v in METHODS if METHODS[v][0] != "draft_model"])
def test_served_heads_run_their_linears_on_the_block_kernels(variant, saved):
    """Drafting reads the head's weights one row at a time: on a CPU with the block kernels they
    are served as 8-bit blocks (the trained fp32 module is what `load_head` returns)."""
    from tandem.model.block_linear import BlockQ8Linear
    from tandem.model.kernels import block_kernels

    if block_kernels() is None:
        pytest.skip("needs an AVX2 CPU and g++")
    head = make_llm(variant, saved(variant)).engine.drafter.head
    linears = [m for m in head.modules() if isinstance(m, (torch.nn.Linear, BlockQ8Linear))]
    assert linears and all(isinstance(m, BlockQ8Linear) for m in linears)
    assert any(isinstance(m, torch.nn.Linear) for m in load_head(saved(variant), parts()).modules())


def test_construction_errors(saved):
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        make_llm("medusa", None)
    with pytest.raises(FileNotFoundError, match="no trained draft head"):
        make_llm("medusa", "/nonexistent/head")
    with pytest.raises(ValueError, match="holds an eagle3 head"):
        make_llm("medusa", saved("eagle3"))


def prefill_hidden(llm: LLM, ctx: list[int]) -> dict[int, torch.Tensor]:
    """The hidden states the engine would hand the drafter after prefilling ctx[:-1]."""
    loaded = llm.loaded
    runner = ModelRunner(loaded.model, KVCache(loaded.config, 1, len(ctx) + 1, loaded.dtype))
    out = runner.forward([SeqInput(runner.cache.allocate(), ctx[:-1])], llm.engine.drafter.needs.hidden_layers)
    return {layer: h[0] for layer, h in out.hidden.items()}


def committed_batch(llm: LLM, head, ids: list[int]):
    """One TrainBatch row holding ids, with the hidden rows of head.serving_layers the engine
    hands a drafter after prefilling ids[:-1] (the last row zeros: no drafter may read it)."""
    from tandem.drafters.heads.base import TrainBatch

    hidden = prefill_hidden(llm, ids)
    T = len(ids)
    h = {layer: torch.zeros(1, T, hidden[layer].shape[-1]) for layer in head.serving_layers}
    for layer in h:
        h[layer][0, : T - 1] = hidden[layer].float()
    return TrainBatch(torch.tensor([ids]), torch.tensor([T]), torch.zeros(1, T, dtype=torch.bool), h)


def audit(llm: LLM, params: SamplingParams, seed: int):
    """The auditor's rounds from PROMPTS[0]; head drafters also get the prefill's hidden states
    (the audit drafts from the context alone)."""
    ctx = PROMPTS[0]
    hidden = prefill_hidden(llm, ctx)
    drafter = llm.engine.drafter
    propose = drafter.propose
    drafter.propose = lambda batch: propose([dataclasses.replace(inp, hidden=hidden) for inp in batch])
    auditor = Auditor(llm.engine, ctx, params, batch=64)
    rounds = auditor.run(1536, seed=seed)
    return rounds, audit_rounds(auditor, rounds, alpha=1e-3)


SAMPLING = pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=20)],
                                   ids=["t1", "t0.7-top20"])


@SAMPLING
@pytest.mark.parametrize("variant", list(METHODS))
def test_sampling_follows_the_target_distribution(variant, params, saved):
    rounds, checks = audit(make_llm(variant, saved(variant), k=2), params, seed=1)
    assert sum(len(r.draft) for r in rounds) == 2 * len(rounds)  # every round drafted in full
    ran = [c for c in checks if c.passed is not None]
    assert len(ran) >= 3, checks
    assert all(c.passed for c in ran), checks


@SAMPLING
@pytest.mark.parametrize("variant", TREE_VARIANTS)
def test_tree_sampling_follows_the_target_distribution(variant, params, saved):
    llm = make_llm(variant, saved(variant), k=16, eagle_topk=2, num_steps=3)  # every candidate kept
    rounds, checks = audit(llm, params, seed=2)
    assert any(len(r.first_tried) >= 2 for r in rounds)  # trees: several candidates at position 1
    ran = [c for c in checks if c.passed is not None]
    # Positions 1 and 2 always gather enough rounds; the recovered and bonus groups may not (a
    # tree rarely rejects every candidate on this sharp target).
    assert {"position 1 token", "position 2 token"} <= {c.name for c in ran}, checks
    assert all(c.passed for c in ran), checks


@pytest.mark.parametrize("variant", ["eagle", "eagle3", "eagle3-small", "mtp"])
def test_engine_drafts_match_a_cache_free_recomputation(variant, saved):
    """Across rounds with rejections, every draft must be the head's chain recomputed from
    scratch on the committed context: the cache held exactly the true features' keys, and the
    draft steps' keys were dropped."""
    llm = make_llm(variant, saved(variant), k=3, lookup=False)
    drafter = llm.engine.drafter

    def settled(inp, draft):  # the caches hold exactly the settled positions again
        assert settled_lengths(drafter, inp) == expected_lengths(drafter, inp)

    head, p = drafter.head, parts()
    for ids, draft in recorded_drafts(llm, settled):
        assert draft.token_ids == cache_free_chain(head, p, llm, ids, len(draft))


@pytest.mark.parametrize("variant", ["eagle", "eagle3", "eagle3-small"])
def test_a_chain_takes_long_lookup_drafts_and_the_head_catches_up_after(variant, saved):
    """With the lookup on, a chain's draft is the suffix lookup's when that has LOOKUP_MIN_TOKENS
    tokens or more, else the head's. Rounds the head sat out (one or several in a row) leave their
    rows waiting, not lost: every head draft is still its chain recomputed from scratch on the
    committed context."""
    from tandem.drafters.lookup import LOOKUP_MIN_TOKENS

    llm = make_llm(variant, saved(variant), k=3)
    drafter = llm.engine.drafter
    looked, sources, last_source = recorded_lookups(drafter), [], {}

    def check(inp, draft):
        lookup = looked[inp.request_id, len(inp.token_ids)]
        cache = drafter.caches[inp.request_id]
        if len(lookup) >= LOOKUP_MIN_TOKENS:
            assert draft.token_ids == lookup
            pieces = drafter.lookup.pending[inp.request_id][0]
            waiting = sum(len(next(iter(piece.values()))) for piece in pieces)
            assert drafter.lookup.waiting_rows(inp.request_id) == waiting  # what the policy prices
            sources.append("lookup" if len(pieces) == 1 else "lookup after lookup")
        else:
            waiting = 0
            sources.append("head after lookup" if last_source.get(inp.request_id, "").startswith("lookup") else "head")
        last_source[inp.request_id] = sources[-1]
        assert cache.length + waiting == expected_lengths(drafter, inp)[0]

    seen = recorded_drafts(llm, check, COPYING_PROMPTS)
    assert {"lookup", "lookup after lookup", "head after lookup"} <= set(sources)
    head, p = drafter.head, parts()
    for (ids, draft), source in zip(seen, sources):
        if source.startswith("head"):
            assert draft.token_ids == cache_free_chain(head, p, llm, ids, len(draft))


def recorded_lookups(drafter) -> dict[tuple[str, int], list[int]]:
    """Records, from now on, every draft the drafter's suffix lookup proposes: (request id,
    context length) -> its tokens."""
    looked = {}
    lookup = drafter.lookup.suffix.lookup

    def recording(inputs):
        drafts = lookup(inputs)
        for inp, d in zip(inputs, drafts):
            looked[inp.request_id, len(inp.token_ids)] = d.token_ids
        return drafts

    drafter.lookup.suffix.lookup = recording
    return looked


def recorded_drafts(llm: LLM, check=None, prompts=PROMPTS) -> list[tuple[list[int], object]]:
    """Every (context, draft) the engine's drafter proposed while generating `prompts` greedily,
    with check(input, draft) run on each as it is proposed; the output must equal plain
    decoding's and some (not all) drafts must pass."""
    drafter, seen = llm.engine.drafter, []
    propose = drafter.propose

    def recording(batch):
        drafts = propose(batch)
        for inp, d in zip(batch, drafts):
            seen.append((list(inp.token_ids), d))
            if check is not None:
                check(inp, d)
        return drafts

    drafter.propose = recording
    out = llm.generate(prompts, GREEDY)
    assert tuple(tuple(o.token_ids) for o in out) == plain(GREEDY, tuple(map(tuple, prompts)))
    assert 0 < llm.engine.stats.acceptance_rate < 1
    return seen


def settled_lengths(drafter, inp) -> list[int]:
    if hasattr(drafter, "states"):  # mtp: one cache per module
        return [c.length for c in drafter.states[inp.request_id].caches]
    return [drafter.caches[inp.request_id].length]


def expected_lengths(drafter, inp) -> list[int]:
    """EAGLE: every position before the next token; MTP module k: positions <= m - k (both
    counted from the position the cache started at)."""
    m = len(inp.token_ids) - 1
    if hasattr(drafter, "states"):
        origin = drafter.states[inp.request_id].origin
        return [max(0, m - k + 1 - origin) for k in range(1, drafter.head.depth + 1)]
    return [m - drafter.caches[inp.request_id].origin]


def cache_free_chain(head, p, llm, ids: list[int], k: int) -> list[int]:
    """Greedy chain from the context's last true feature, by the training forward (EAGLE's
    unroll, MTP's run_all) on one sequence whose tokens after the context are the chain's own
    drafts (hidden rows past the context are zeros: no chain may read them)."""
    from tandem.drafters.heads.base import TrainBatch

    hidden = prefill_hidden(llm, ids)  # rows for ids[:-1]
    drafts: list[int] = []
    j = len(ids) - 2
    for _ in range(k):
        seq = ids + drafts
        T = len(seq)
        h = {layer: torch.zeros(1, T, hidden[layer].shape[-1]) for layer in head.serving_layers}
        for layer in h:
            h[layer][0, : j + 1] = hidden[layer].float()
        batch = TrainBatch(torch.tensor([seq]), torch.tensor([T]), torch.zeros(1, T, dtype=torch.bool), h)
        if head.method == "mtp":
            token = head.logits(head.run_all(batch, p, len(drafts) + 1)[-1][0, j], p).argmax(-1, keepdim=True)
        else:
            logits = head.head_logits(head.unroll(batch, p, len(drafts) + 1)[-1][0, j], p)
            token = head.to_target_ids(logits.argmax(-1, keepdim=True))
        drafts.append(int(token[0]))
    return drafts


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["medusa", "eagle3-small"])
def test_real_target_greedy_identity(variant, tmp_path):
    """The real bundled model (native 4-bit, bf16 serving parts): a head built from its
    dequantised parts, saved and served, keeps greedy output identical (acceptance is whatever
    an untrained head gets)."""
    from tandem.model.loader import load_model

    loaded = load_model("smollm2-135m-instruct")
    p = TargetParts.from_loaded(loaded)
    method, options, _, _ = METHODS[variant]
    if "draft_vocab" in options:
        options = {**options, "draft_vocab": list(range(0, loaded.config.vocab_size, 7))}
    save_head(build_head(method, p, **options), tmp_path, loaded.name)
    params = SamplingParams(temperature=0, max_tokens=24)
    prompt = "Write a short poem about the sea."
    config = EngineConfig(max_model_len=256, max_num_seqs=2)
    base = LLM.from_loaded(loaded, config).generate(prompt, params, chat=True)[0]
    spec = dataclasses.replace(config, spec=SpecConfig(method, 3, str(tmp_path)))
    out = LLM.from_loaded(loaded, spec).generate(prompt, params, chat=True)[0]
    assert out.token_ids == base.token_ids
    assert out.spec.num_draft_tokens > 0


@pytest.mark.parametrize("variant", ["eagle3", "mtp"])
def test_a_round_the_drafter_missed_restarts_its_cache(variant, saved):
    """If the engine skipped the drafter for a round (a zero draft budget), that round's hidden
    rows never reach it: the next call restarts from the rows it gets instead of misplacing them."""
    llm = make_llm(variant, saved(variant), k=3)
    drafter = llm.engine.drafter
    ctx = PROMPTS[0] + [11, 12, 13, 14, 15, 16]
    hidden = prefill_hidden(llm, ctx)  # rows for ctx[:-1]
    params = SamplingParams(temperature=0)

    def call(n_ctx: int, rows: slice):
        inp = DraftInput("r", ctx[:n_ctx], 6, 3, params, torch.Generator(), {k: v[rows] for k, v in hidden.items()})
        return drafter.propose([inp])[0], inp

    first, _ = call(6, slice(0, 5))  # prefill of the prompt
    assert len(first) == 3
    draft, inp = call(10, slice(7, 9))  # rows 5 and 6 (committed in a skipped round) never arrive
    assert len(draft) == 3
    assert settled_lengths(drafter, inp) == expected_lengths(drafter, inp)
    assert settled_lengths(drafter, inp)[0] == 2  # positions 7 and 8
    draft, inp = call(11, slice(9, 10))  # the next round connects to the restarted cache
    assert len(draft) == 3
    assert settled_lengths(drafter, inp) == expected_lengths(drafter, inp)
    assert settled_lengths(drafter, inp)[0] == 3  # positions 7, 8, 9: kept, not restarted again


def test_a_head_drafter_without_a_head_is_refused_before_anything_slow():
    """The library and the server check this before measuring the cost profile (seconds): a
    trained-head drafter for a model tandem ships no head for, and no path given."""
    from tandem.drafters.heads.serving import check_head_available

    for method in ("eagle3", "dspark", "medusa"):
        with pytest.raises(ValueError, match="ships none for tiny"):
            check_head_available(SpecConfig(algorithm=method), "tiny")
        check_head_available(SpecConfig(algorithm=method, draft_model_path="/some/head"), "tiny")  # given: later
    check_head_available(SpecConfig(algorithm="suffix"), "tiny")
    check_head_available(SpecConfig(), "tiny")
