"""N-gram drafter: matching rules, budgets, and the incremental index against a brute-force scan."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from tandem.config import SamplingParams, SpecConfig
from tandem.drafters import DraftInput, TargetInfo, create_drafter
from tandem.drafters.ngram import NgramDrafter

TARGET = TargetInfo(vocab_size=1000, eos_token_ids=(2,))


def make(k: int = 4, ngram_min: int = 1, ngram_max: int = 3) -> NgramDrafter:
    spec = SpecConfig(algorithm="ngram", num_draft_tokens=k, ngram_min=ngram_min, ngram_max=ngram_max)
    return create_drafter(spec, TARGET)


def ask(drafter: NgramDrafter, ids: list[int], rid: str = "r", budget: int = 16) -> list[int]:
    inp = DraftInput(rid, list(ids), num_prompt_tokens=0, max_draft_tokens=budget, params=SamplingParams(),
                     generator=torch.Generator())
    (draft,) = drafter.propose([inp])
    assert draft.probs is None and draft.parents is None
    return draft.token_ids


def brute_force(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Scan backwards for the latest earlier occurrence of the longest matching tail n-gram."""
    size = len(tokens)
    for n in range(n_max, n_min - 1, -1):
        key = tokens[size - n :]
        for e in range(size - 1, n - 1, -1):
            if tokens[e - n : e] == key:
                return tokens[e : e + k]
    return []


def test_registry_builds_the_ngram_drafter():
    assert isinstance(make(), NgramDrafter)


@pytest.mark.parametrize(
    "spec, match",
    [
        (SimpleNamespace(num_draft_tokens=0, ngram_min=1, ngram_max=3), "num_draft_tokens"),
        (SimpleNamespace(num_draft_tokens=4, ngram_min=3, ngram_max=2), "ngram_min <= ngram_max"),
        (SimpleNamespace(num_draft_tokens=4, ngram_min=0, ngram_max=2), "ngram_min <= ngram_max"),
    ],
)
def test_construction_rejects_bad_config(spec, match):
    with pytest.raises(ValueError, match=match):
        NgramDrafter(spec, TARGET)


def test_proposes_what_followed_the_most_recent_occurrence():
    ctx = [1, 2, 3, 10, 11, 12, 13, 1, 2, 3, 20, 21, 22, 23, 9, 1, 2, 3]
    assert ask(make(k=4), ctx) == [20, 21, 22, 23]


def test_respects_k_and_the_round_budget():
    ctx = [1, 2, 3, 20, 21, 22, 23, 9, 1, 2, 3]
    assert ask(make(k=2), ctx) == [20, 21]
    assert ask(make(k=4), ctx, budget=1) == [20]
    assert ask(make(k=4), ctx, budget=0) == []


def test_prefers_the_longer_ngram_over_a_more_recent_shorter_one():
    # (5, 6) last occurred at 0..1 (-> 7, 8, ...); the 1-gram (6,) occurred more recently (-> 9).
    ctx = [5, 6, 7, 8, 6, 9, 5, 6]
    assert ask(make(k=4, ngram_max=2), ctx) == [7, 8, 6, 9]
    assert ask(make(k=4, ngram_min=1, ngram_max=1), ctx) == [9, 5, 6]


def test_short_continuation_returns_what_there_is():
    assert ask(make(k=4), [1, 2, 3, 1, 2]) == [3, 1, 2]


def test_no_match_gives_an_empty_draft():
    assert ask(make(), [1, 2, 3, 4, 5]) == []
    assert ask(make(), [7]) == []
    assert ask(make(), []) == []
    # The tail matches only a 1-gram, which ngram_min = 2 excludes.
    assert ask(make(ngram_min=2, ngram_max=3), [4, 5, 6, 7, 5]) == []


def test_incremental_index_matches_brute_force():
    rng = random.Random(1234)
    for trial in range(60):
        n_min = rng.randint(1, 3)
        n_max = rng.randint(n_min, 4)
        k = rng.randint(1, 6)
        vocab = rng.randint(2, 6)
        drafter = make(k=k, ngram_min=n_min, ngram_max=n_max)
        # Two requests interleaved, contexts growing by committed chunks, as the engine calls it.
        contexts = {"a": [], "b": []}
        for _ in range(40):
            rid = rng.choice("ab")
            contexts[rid] += [rng.randrange(vocab) for _ in range(rng.randint(1, k + 1))]
            budget = rng.randint(1, k + 2)
            want = brute_force(contexts[rid], n_min, n_max, min(k, budget))
            assert ask(drafter, contexts[rid], rid, budget) == want, (trial, contexts[rid])


def test_context_that_changes_under_the_same_id_is_reindexed():
    drafter = make(k=3)
    assert ask(drafter, [1, 2, 3, 4, 1, 2]) == [3, 4, 1]
    # Shorter and different: stale positions must not leak into the answer.
    assert ask(drafter, [1, 2, 8, 1]) == [2, 8, 1]
    # Longer, but the token at the old end differs: a different history, not a continuation.
    assert ask(drafter, [5, 9, 6, 5, 9, 6]) == [5, 9, 6]


def test_release_frees_the_request_state():
    drafter = make()
    ask(drafter, [1, 2, 3, 1, 2], rid="x")
    assert "x" in drafter._requests
    drafter.release("x")
    assert "x" not in drafter._requests
    drafter.release("never-seen")
    # A reused id starts from its new context only.
    assert ask(drafter, [1, 2], rid="x") == []
