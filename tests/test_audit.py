"""`tandem audit` passes a correct pipeline and fails deliberately broken ones (it has power)."""

import pytest
import torch

from conftest import tiny_loaded
from tandem.audit import run_audit
from tandem.config import EngineConfig, SamplingParams, SpecConfig
from tandem.drafters import Drafter, register
from tandem.engine import engine as engine_module
from tandem.engine.engine import Engine
from tandem.sampling import processed_probs
from tandem.types import Draft
from tandem.verify import chain

PARAMS = SamplingParams(temperature=0.4, top_k=3, max_tokens=8)
PROMPT = [5, 17, 33, 8, 91, 4, 17, 33]


def _target_q(inp, ctx, mix=0.75):
    """q close to the target's own processed distribution (high acceptance, many bonus rounds)."""
    _, loaded = tiny_loaded("llama")
    from tandem.model.kv_cache import KVCache
    from tandem.model.runner import ModelRunner, SeqInput

    r = ModelRunner(loaded.model, KVCache(loaded.config, 1, 64, torch.float32))
    logits = r.forward([SeqInput(r.cache.allocate(), ctx)]).logits
    p = processed_probs(logits, inp.params)[0]
    flat = processed_probs(torch.zeros_like(logits), inp.params)[0]
    return mix * p + (1 - mix) * flat


@register("test_audit_sampled")
class NearTargetDrafter(Drafter):
    """Samples each draft token from a q near the target's p, and reports q honestly."""

    soft_q_for_argmax = False

    def propose(self, batch):
        out = []
        for inp in batch:
            ctx, toks, qs = list(inp.token_ids), [], []
            for _ in range(min(self.spec.num_draft_tokens, inp.max_draft_tokens)):
                q = _target_q(inp, ctx)
                t = int(q.argmax()) if self.soft_q_for_argmax else int(torch.multinomial(q, 1, generator=inp.generator))
                toks.append(t)
                qs.append(q)
                ctx.append(t)
            out.append(Draft(toks, probs=torch.stack(qs)))
        return out


@register("test_audit_soft_argmax")
class SoftQForArgmaxDrafter(NearTargetDrafter):
    """Broken on purpose: argmax drafts reported with the soft q they were picked from."""

    soft_q_for_argmax = True


def engine(algorithm, k=2):
    _, loaded = tiny_loaded("llama")
    return Engine(loaded, EngineConfig(max_model_len=64, max_num_seqs=2, spec=SpecConfig(algorithm=algorithm, num_draft_tokens=k)))


@pytest.fixture(autouse=True)
def _cache_target_q(monkeypatch):
    # The drafter's q only depends on the context: memoise the tiny forwards.
    memo = {}
    real = _target_q

    def cached(inp, ctx, mix=0.75):
        key = (tuple(ctx), inp.params)
        if key not in memo:
            memo[key] = real(inp, ctx, mix)
        return memo[key]

    monkeypatch.setitem(globals(), "_target_q", cached)


def test_audit_passes_sampled_drafter():
    report = run_audit(engine("test_audit_sampled"), PROMPT, PARAMS, rounds=3000, batch=100)
    ran = [c for c in report.checks if c.passed is not None]
    assert {c.name for c in ran} >= {"position 1 token", "position 2 token", "recovered token (position 1)", "bonus token"}
    assert report.passed, report.render()


def test_audit_passes_ngram_drafter():
    report = run_audit(engine("ngram", k=3), PROMPT, PARAMS, rounds=2000, batch=100)
    assert report.passed, report.render()


def test_audit_fails_soft_q_for_argmax_drafts():
    report = run_audit(engine("test_audit_soft_argmax"), PROMPT, PARAMS, rounds=3000, batch=100)
    assert not report.passed, report.render()


def test_audit_fails_unclamped_residual(monkeypatch):
    monkeypatch.setattr(chain, "_residual_", lambda p, q: p.sub_(q).abs_())
    report = run_audit(engine("test_audit_sampled"), PROMPT, PARAMS, rounds=3000, batch=100)
    assert not report.passed, report.render()


def test_audit_fails_bonus_from_wrong_row(monkeypatch):
    real = chain.verify_chain

    def bonus_from_p_k(target_probs, draft_tokens, draft_probs, num_drafts, generators, greedy):
        shifted = target_probs.clone()
        for b, k in enumerate(torch.as_tensor(num_drafts).tolist()):
            if k:
                shifted[b, k] = target_probs[b, k - 1]
        return real(shifted, draft_tokens, draft_probs, num_drafts, generators, greedy)

    monkeypatch.setattr(engine_module, "verify_chain", bonus_from_p_k)
    report = run_audit(engine("test_audit_sampled"), PROMPT, PARAMS, rounds=3000, batch=100)
    assert not report.passed, report.render()


def test_greedy_audit_is_token_identity():
    report = run_audit(engine("ngram", k=3), PROMPT, SamplingParams(temperature=0, max_tokens=12))
    assert report.passed and report.checks[0].name == "greedy token identity"
