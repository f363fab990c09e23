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
from heads_fixtures import make_batch, parts, sharp_target, train
from tandem.audit import Auditor, audit_rounds
from tandem.config import EngineConfig, SamplingParams, SpecConfig
from tandem.drafters.heads.base import TargetParts
from tandem.drafters.heads.io import build_head, load_head, save_head
from tandem.llm import LLM
from tandem.model.kv_cache import KVCache
from tandem.model.runner import ModelRunner, SeqInput

pytestmark = pytest.mark.usefixtures("one_thread")

# method -> (build options, training steps, learning rate)
METHODS = {
    "medusa": (dict(num_heads=3), 30, 1e-2),
}
PROMPTS = [[5, 17, 33, 8, 91, 4], [60, 61, 62], [7] * 11 + [12, 13]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@functools.lru_cache(maxsize=None)
def trained(method: str):
    options, steps, lr = METHODS[method]
    p, batch = parts(), make_batch()
    head = build_head(method, p, **options)
    train(head, batch, p, steps=steps, lr=lr)
    return head


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """method -> directory of the trained, saved head."""
    out = {}

    def get(method: str):
        if method not in out:
            out[method] = save_head(trained(method), tmp_path_factory.mktemp(method), "sharp-qwen2-0", {"steps": 1})
        return out[method]

    return get


def make_llm(method: str | None, path=None, k: int = 3, max_num_seqs: int = 4) -> LLM:
    spec = SpecConfig(algorithm=method, num_draft_tokens=k, draft_model_path=str(path) if path else None) if method else SpecConfig()
    return LLM.from_loaded(sharp_target(), EngineConfig(max_model_len=128, max_num_seqs=max_num_seqs, spec=spec))


@functools.lru_cache(maxsize=None)
def plain(params: SamplingParams = GREEDY) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(o.token_ids) for o in make_llm(None).generate(PROMPTS, params))


@pytest.mark.parametrize("method", list(METHODS))
def test_saved_head_drafts_like_the_trained_one(method, saved):
    p, batch = parts(), make_batch()
    loaded = load_head(saved(method), p)
    assert type(loaded) is type(trained(method)) and loaded.config_dict() == trained(method).config_dict()
    torch.testing.assert_close(loaded.draft_accuracy(batch, p, 3), trained(method).draft_accuracy(batch, p, 3))
    for name, value in trained(method).state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, msg=name)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_identity_through_the_engine(method, k, saved):
    llm = make_llm(method, saved(method), k)
    out = llm.generate(PROMPTS, GREEDY)
    assert tuple(tuple(o.token_ids) for o in out) == plain()
    stats = llm.engine.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method", list(METHODS))
def test_seeded_sampling_is_reproducible_and_batch_invariant(method, saved):
    params = SamplingParams(temperature=0.8, max_tokens=15, seed=3, ignore_eos=True)
    llm = make_llm(method, saved(method))
    batched = [o.token_ids for o in llm.generate(PROMPTS, params)]
    single = [make_llm(method, saved(method)).generate(p, params)[0].token_ids for p in PROMPTS]
    assert batched == single


@pytest.mark.parametrize("method", list(METHODS))
def test_wrong_target_is_refused(method, saved):
    other_shape = TargetParts.from_loaded(tiny_loaded("llama")[1])  # 2 layers instead of 4
    with pytest.raises(ValueError, match="trained for target 'sharp-qwen2-0'.*num_layers 4 vs 2"):
        load_head(saved(method), other_shape)
    same_shape = TargetParts.from_loaded(sharp_target("qwen2", seed=1))  # other weights
    with pytest.raises(ValueError, match="same shapes but different weights"):
        load_head(saved(method), same_shape)
    with pytest.raises(ValueError, match="trained for target"):
        LLM.from_loaded(tiny_loaded("llama")[1], EngineConfig(spec=SpecConfig(method, 3, str(saved(method)))))


def test_construction_errors(saved):
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        make_llm("medusa", None)
    with pytest.raises(FileNotFoundError, match="no trained draft head"):
        make_llm("medusa", "/nonexistent/head")
    others = [m for m in METHODS if m != "medusa"]
    if others:
        with pytest.raises(ValueError, match=f"holds a {others[0]} head"):
            make_llm("medusa", saved(others[0]))


def prefill_hidden(llm: LLM, ctx: list[int]) -> dict[int, torch.Tensor]:
    """The hidden states the engine would hand the drafter after prefilling ctx[:-1]."""
    loaded = llm.loaded
    runner = ModelRunner(loaded.model, KVCache(loaded.config, 1, len(ctx) + 1, loaded.dtype))
    out = runner.forward([SeqInput(runner.cache.allocate(), ctx[:-1])], llm.engine.drafter.needs.hidden_layers)
    return {layer: h[0] for layer, h in out.hidden.items()}


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=20)],
                         ids=["t1", "t0.7-top20"])
@pytest.mark.parametrize("method", list(METHODS))
def test_sampling_follows_the_target_distribution(method, params, saved):
    llm = make_llm(method, saved(method), k=2)
    ctx = PROMPTS[0]
    hidden = prefill_hidden(llm, ctx)
    drafter = llm.engine.drafter
    propose = drafter.propose
    # The audit drafts from the context alone; head drafters also read the prefill's hidden states.
    drafter.propose = lambda batch: propose([dataclasses.replace(inp, hidden=hidden) for inp in batch])
    auditor = Auditor(llm.engine, ctx, params, batch=64)
    rounds = auditor.run(1536, seed=1)
    assert sum(len(r.draft) for r in rounds) == 2 * len(rounds)  # every round drafted in full
    checks = audit_rounds(auditor, rounds, alpha=1e-3)
    ran = [c for c in checks if c.passed is not None]
    assert len(ran) >= 3, checks
    assert all(c.passed for c in ran), checks
