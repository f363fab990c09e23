"""Suffix decoding: the trie's counts against brute force, drafting rules, the global trie's life cycle."""

from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from tandem.config import SamplingParams, SpecConfig
from tandem.drafters import DraftInput, DraftOutcome, TargetInfo, create_drafter
from tandem.drafters.suffix import SuffixDrafter
from tandem.drafters.suffix_trie import SuffixTrie

TARGET = TargetInfo(vocab_size=1000, eos_token_ids=(2,))


def make(k: int = 4, **kwargs) -> SuffixDrafter:
    return SuffixDrafter(SpecConfig(algorithm="suffix", num_draft_tokens=k), TARGET, **kwargs)


def ask(drafter: SuffixDrafter, ids: list[int], rid: str = "r", num_prompt: int = 0, budget: int = 16):
    inp = DraftInput(rid, list(ids), num_prompt, budget, SamplingParams(), torch.Generator())
    (draft,) = drafter.propose([inp])
    assert draft.probs is None and draft.parents is None
    return draft.token_ids


def serve(drafter: SuffixDrafter, rid: str, prompt: list[int], output: list[int]) -> None:
    """Run a request through the drafter as the engine would, then finish it."""
    ask(drafter, prompt + output[:1], rid, len(prompt))
    for i in range(1, len(output), 3):
        drafter.observe([DraftOutcome(rid, 0, 0, output[i : i + 3])])
    drafter.release(rid)


def materialised_nodes(trie: SuffixTrie) -> int:
    seen, stack = 0, [trie.root]
    while stack:
        node = stack.pop()
        seen += 1
        stack.extend((node.children or {}).values())
    return seen


def test_registry_builds_the_suffix_drafter():
    assert isinstance(create_drafter(SpecConfig(algorithm="suffix"), TARGET), SuffixDrafter)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_match_len=0), "max_match_len"),
        (dict(spec_factor=-1.0), "spec_factor"),
        (dict(min_token_prob=1.5), "min_token_prob"),
        (dict(max_global_tokens=-1), "max_global_tokens"),
        (dict(max_global_nodes=0), "max_global_nodes"),
    ],
)
def test_construction_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(**kwargs)


def test_construction_rejects_a_spec_without_draft_tokens():
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SuffixDrafter(SimpleNamespace(num_draft_tokens=0), TARGET)


def test_trie_counts_match_brute_force_through_appends_inserts_and_removals():
    rng = random.Random(7)
    for trial in range(120):
        depth = rng.randint(1, 7)
        trie = SuffixTrie(depth)
        open_streams = [trie.open() for _ in range(rng.randint(1, 3))]
        closed = []
        for _ in range(12):
            roll = rng.random()
            if roll < 0.5:
                # Open streams grow in interleaved chunks (several requests' tries share this code).
                trie.extend(rng.choice(open_streams), [rng.randrange(3) for _ in range(rng.randint(1, 4))])
            elif roll < 0.8:
                closed.append(trie.add([rng.randrange(3) for _ in range(rng.randint(0, 25))]))
            elif closed:
                trie.remove(closed.pop(rng.randrange(len(closed))))
            streams = [s.tokens for s in open_streams + closed]
            # Every substring up to one token past the depth (those must count 0).
            substrings = Counter(
                tuple(s[i:j])
                for s in streams
                for i in range(len(s))
                for j in range(i + 1, min(len(s), i + depth + 1) + 1)
            )
            for w, n in substrings.items():
                assert trie.count(list(w)) == (n if len(w) <= depth else 0), (trial, depth, w)
            assert trie.count([3]) == 0
            assert trie.num_nodes == materialised_nodes(trie)
            assert trie.num_tokens == sum(map(len, streams))


def test_removing_every_stream_leaves_an_empty_trie():
    rng = random.Random(3)
    trie = SuffixTrie(6)
    streams = [trie.add([rng.randrange(4) for _ in range(rng.randint(1, 40))]) for _ in range(20)]
    assert trie.num_nodes > 1
    for s in rng.sample(streams, len(streams)):
        trie.remove(s)
    assert (trie.num_nodes, trie.num_tokens, trie.root.count, trie.root.children) == (1, 0, 0, None)


def test_unrepeated_text_costs_about_one_node_per_token():
    # Singleton suffixes stay implicit; a plain trie would need ~tokens * depth nodes here.
    rng = random.Random(0)
    trie = SuffixTrie(32)
    trie.add([rng.randrange(50_000) for _ in range(2000)])
    assert trie.num_nodes < 2 * 2000


def reference_draft(ctx, max_match, depth, k, factor, offset, floor):
    """Suffix decoding on one sequence by brute-force counting (ties: the earliest-seen continuation)."""
    size = len(ctx)

    def continuations(w):
        found = {}
        for i in range(size - len(w)):
            if ctx[i : i + len(w)] == w and len(w) < depth:
                tok = ctx[i + len(w)]
                count, first = found.get(tok, (0, i + len(w)))
                found[tok] = (count + 1, first)
        return found

    m = next((m for m in range(min(max_match, size, depth - 1), 0, -1) if continuations(ctx[size - m :])), 0)
    if m == 0:
        return []
    out, prob, w = [], 1.0, ctx[size - m :]
    while len(out) < min(k, int(m * factor + offset)):
        found = continuations(w)
        if not found:
            break
        tok = min(found, key=lambda t: (-found[t][0], found[t][1]))
        prob *= found[tok][0] / sum(c for c, _ in found.values())
        if prob < floor:
            break
        out.append(tok)
        w = w + [tok]
    return out


@pytest.mark.parametrize("factor, offset, floor", [(1.0, 0.0, 0.1), (2.0, 1.0, 0.3), (0.5, 2.0, 0.0)])
def test_per_request_drafts_match_brute_force(factor, offset, floor):
    rng = random.Random(11)
    settings = dict(max_match_len=5, spec_factor=factor, spec_offset=offset, min_token_prob=floor)
    for trial in range(25):
        k = rng.randint(1, 5)
        # Observed every round / never observed / rebuilt from scratch each call: same drafts.
        observed, unobserved = make(k, **settings), make(k, **settings)
        ctx = [rng.randrange(3) for _ in range(rng.randint(1, 6))]
        for _ in range(25):
            budget = rng.randint(1, k + 1)
            want = reference_draft(ctx, 5, observed.depth, min(k, budget), factor, offset, floor)
            assert ask(observed, ctx, budget=budget) == want, (trial, ctx)
            assert ask(unobserved, ctx, budget=budget) == want
            assert ask(make(k, **settings), ctx, budget=budget) == want
            committed = [rng.randrange(3) for _ in range(rng.randint(1, k + 1))]
            observed.observe([DraftOutcome("r", budget, 0, committed)])
            ctx = ctx + committed


def test_repetitive_context_drafts_the_next_period():
    pattern = [10, 11, 12, 13, 14, 15]
    assert ask(make(k=4), pattern * 3 + pattern[:2]) == [12, 13, 14, 15]


def test_draft_length_adapts_to_the_match_length():
    # Only the 1-token tail (5) was seen before, so m = 1 and at most floor(factor + offset) tokens.
    ctx = [5, 6, 7, 8, 9, 1, 5]
    assert ask(make(k=4), ctx) == [6]
    assert ask(make(k=4, spec_offset=2), ctx) == [6, 7, 8]
    assert ask(make(k=4, spec_factor=3.0), ctx) == [6, 7, 8]
    assert ask(make(k=2, spec_factor=10.0), ctx) == [6, 7]
    assert ask(make(k=4, spec_factor=0.5), ctx) == []


# After "1 2": 3 three times, 4 once (p = 0.75); after "1 2 3": 7 twice, 9 once (p = 0.75 * 2/3 = 0.5);
# after "1 2 3 7": 101 or 102 (p = 0.25, the earlier-seen 101 wins the tie), then 1 (p stays 0.25).
# The context's own trailing "1 2" must not count as a continuation (with it: p = 0.6, then 0.4).
FLOOR_CTX = [100, 1, 2, 3, 7, 101, 1, 2, 3, 7, 102, 1, 2, 3, 9, 103, 1, 2, 4, 104, 1, 2]


@pytest.mark.parametrize(
    "floor, want",
    [(0.8, []), (0.7, [3]), (0.45, [3, 7]), (0.2, [3, 7, 101, 1])],
)
def test_probability_floor_cuts_unlikely_continuations(floor, want):
    assert ask(make(k=4, spec_factor=2.0, min_token_prob=floor), FLOOR_CTX) == want


def test_global_trie_learns_released_outputs():
    prompt, output = [1, 2, 3, 4, 5], [50, 51, 52, 53, 54, 55, 56, 57]
    # A new request with the same prompt that has produced the same first 4 tokens so far.
    ctx = prompt + output[:4]
    drafter = make(k=4)
    assert ask(drafter, ctx, rid="before", num_prompt=len(prompt)) == []  # nothing released yet
    serve(drafter, "a", prompt, output)
    assert drafter.global_trie.count(output[:3]) == 1
    assert drafter.global_trie.count(prompt[:2]) == 0  # prompts are not learned
    assert ask(drafter, ctx, rid="b", num_prompt=len(prompt)) == [54, 55, 56, 57]


def test_the_better_scoring_of_request_and_global_drafts_wins():
    drafter = make(k=4)
    ctx = [7, 30, 7, 31, 7]  # within the request 7 was followed by 30 and 31: p = 0.5
    assert ask(drafter, ctx, rid="solo") == [30]
    for i in range(3):
        serve(drafter, f"g{i}", [200 + i], [7, 8, 9, 10, 11])
    assert ask(drafter, ctx, rid="with-global") == [8]  # 7 -> 8 every time globally: p = 1


def test_the_request_draft_wins_over_an_equal_or_weaker_global_one():
    ctx = [7, 30, 5, 7]  # within the request 7 -> 30 (p = 1)
    weaker, equal = make(k=4), make(k=4)
    serve(weaker, "g0", [200], [7, 40])
    serve(weaker, "g1", [201], [7, 41])  # globally 7 -> 40 or 41: p = 0.5
    serve(equal, "g0", [200], [7, 8])  # globally 7 -> 8: p = 1
    assert ask(equal, [1, 7], rid="probe") == [8]
    assert ask(weaker, ctx) == [30]
    assert ask(equal, ctx) == [30]


def test_eviction_keeps_the_global_trie_within_its_token_budget():
    drafter = make(k=4, max_global_tokens=25)
    outputs = [[100 + 10 * r + i for i in range(10)] for r in range(5)]
    for r, out in enumerate(outputs):
        serve(drafter, f"r{r}", [1, 2], out)
        assert drafter.global_trie.num_tokens <= 25
    assert [drafter.global_trie.count(out[:2]) for out in outputs] == [0, 0, 0, 1, 1]
    assert drafter.global_trie.num_nodes == materialised_nodes(drafter.global_trie)


def test_eviction_keeps_the_global_trie_within_its_node_budget():
    drafter = make(k=4, max_global_nodes=30)
    rng = random.Random(5)
    for r in range(10):
        serve(drafter, f"r{r}", [1], [rng.randrange(8) for _ in range(12)])
        assert drafter.global_trie.num_nodes <= 30
    assert drafter.global_trie.num_tokens > 0


def test_an_output_longer_than_the_budget_is_cut_to_its_start():
    drafter = make(k=4, max_global_tokens=25)
    out = list(range(100, 140))
    serve(drafter, "long", [1], out)
    assert drafter.global_trie.num_tokens == 25
    assert drafter.global_trie.count(out[:3]) == 1 and drafter.global_trie.count(out[-3:]) == 0


def test_release_frees_per_request_state():
    drafter = make()
    ask(drafter, [1, 2, 3, 1, 2], rid="x", num_prompt=5)
    assert "x" in drafter._requests
    drafter.release("x")
    assert "x" not in drafter._requests
    assert drafter.global_trie.num_tokens == 0  # nothing was generated, nothing to learn
    drafter.release("never-seen")
    drafter.observe([DraftOutcome("never-seen", 0, 0, [1])])
    assert "never-seen" not in drafter._requests


def test_a_context_that_changes_under_the_same_id_rebuilds_the_trie():
    drafter = make(k=3)
    assert ask(drafter, [1, 2, 3, 4, 1, 2]) == [3, 4]
    assert ask(drafter, [1, 8, 9, 1]) == [8]
    assert ask(drafter, [1, 8, 9, 1]) == ask(make(k=3), [1, 8, 9, 1])


def test_the_match_bound_from_the_last_draft_changes_no_draft():
    """Each trie's match is searched only up to its match at the request's last draft plus the
    tokens appended since (while no stream was added to or removed from that trie): the drafts and
    their evidence equal those of a full search, through releases that grow and evict the global
    trie."""
    rng = random.Random(5)
    bounded, full = make(4, max_global_tokens=60), make(4, max_global_tokens=60)
    full._match_bound = lambda *args: None
    used = []
    real_bound = SuffixDrafter._match_bound

    def spying(req, which, trie, inp):
        bound = real_bound(req, which, trie, inp)
        used.append(bound is not None and bound < min(bounded.max_match_len, len(inp.token_ids), trie.max_depth - 1))
        return bound

    bounded._match_bound = spying
    contexts = {f"r{i}": [rng.randrange(4) for _ in range(rng.randint(2, 8))] for i in range(3)}
    for step in range(300):
        rid = rng.choice(sorted(contexts))
        budget = rng.randint(1, 5)
        assert ask(bounded, contexts[rid], rid, budget=budget) == ask(full, contexts[rid], rid, budget=budget), step
        assert bounded.evidence.get(rid) == full.evidence.get(rid)
        committed = [rng.randrange(4) for _ in range(rng.randint(1, 4))]
        for d in (bounded, full):
            d.observe([DraftOutcome(rid, budget, 0, committed)])
        contexts[rid] = contexts[rid] + committed
        if rng.random() < 0.05:  # a request ends: its output joins the global trie (and may evict)
            for d in (bounded, full):
                d.release(rid)
            contexts[rid] = [rng.randrange(4) for _ in range(rng.randint(2, 8))]
    assert sum(used) > 100  # the bound did cut searches short


def test_a_stream_added_to_the_global_trie_lifts_the_match_bound():
    drafter = make(4)
    context = [50, 51, 7, 8, 9]
    assert ask(drafter, context, "a") == []  # nothing anywhere matches yet
    serve(drafter, "b", [1], [5, 6, 7, 8, 9, 10, 11, 12])  # b's answer joins the global trie
    # a's tail 7 8 9 now matches there, 3 tokens more than its last match + 0 tokens appended
    assert ask(drafter, context, "a") == [10, 11, 12]


def test_a_remembered_most_frequent_continuation_is_forgotten_when_the_trie_changes():
    trie = SuffixTrie(8)
    first = trie.add([1, 2, 3, 9])
    cursor, m = trie.longest_match([7, 1, 2], 4)
    assert m == 2 and trie.draft(cursor, 1, 0.0)[0] == [3]  # remembered: 3 follows 1 2
    trie.add([1, 2, 4, 9])
    trie.add([1, 2, 4, 8])
    cursor, _ = trie.longest_match([7, 1, 2], 4)
    assert trie.draft(cursor, 1, 0.0)[0] == [4]
    trie.remove(first)
    cursor, _ = trie.longest_match([7, 1, 2], 4)
    assert trie.draft(cursor, 1, 0.0)[0] == [4]
    own = trie.open()
    trie.extend(own, [1, 2, 3, 1, 2, 3, 1, 2, 3, 0])  # 1 2 3 three times against 1 2 4 twice
    cursor, _ = trie.longest_match([7, 1, 2], 4)
    assert trie.draft(cursor, 1, 0.0)[0] == [3]


# ---- confidences for the confidence scheduler ----------------------------------------------------


def test_under_the_confidence_scheduler_drafts_carry_learnt_pass_rates():
    """Every draft carries confidences (empty drafts an empty list): how often earlier drafts on
    the same evidence passed, starting at 1 and learnt from the grades; other policies get none."""
    spec = SpecConfig(algorithm="suffix", num_draft_tokens=4, policy="confidence")
    d = SuffixDrafter(spec, TARGET)
    ids = [5, 6, 7, 8] * 4
    inp = DraftInput("r", ids, 0, 4, SamplingParams(), torch.Generator())
    (draft,) = d.propose([inp])
    assert draft.token_ids == [5, 6, 7, 8] and draft.confidence == [1.0] * 4
    d.observe([DraftOutcome("r", 4, 1, [5, 9])])  # the first passed, the second did not
    (again,) = d.propose([DraftInput("r", ids + [5, 9], 0, 4, SamplingParams(), torch.Generator())])
    assert again.token_ids == [] and again.confidence == []  # nothing matches the new tail
    assert set(d.confidence.grades.values()) == {(1, 1), (1, 0)}
    d.release("r")
    assert not d.confidence.drafted and d.confidence.calibration.offset == {}
    assert make().propose([inp])[0].confidence is None


def test_greedy_output_under_the_confidence_scheduler_equals_plain_decoding():
    from conftest import tiny_loaded

    from tandem.config import EngineConfig
    from tandem.llm import LLM
    from tandem.scheduler.cost_model import CostCurve

    _, loaded = tiny_loaded()
    prompts = [[5, 9, 14, 3, 7, 5, 9, 14, 3, 7], [11, 4, 4, 8, 11, 4, 4, 8, 11]]
    params = SamplingParams(temperature=0, max_tokens=40)
    plain = [o.token_ids for o in LLM.from_loaded(loaded, EngineConfig(max_model_len=128)).generate(prompts, params)]
    # rows nearly free at first, then dear: drafts are cut where their survivals stop paying
    spec = SpecConfig(algorithm="suffix", num_draft_tokens=4, policy="confidence")
    llm = LLM.from_loaded(loaded, EngineConfig(max_model_len=128, spec=spec),
                          cost_curve=CostCurve((1, 3, 12), (1.0, 1.05, 3.0)))
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.spec.num_accepted_tokens for o in outs) > 0  # drafts were admitted, and passed
