"""`tandem audit` passes a correct pipeline and fails deliberately broken ones (it has power).

Every negative control names the check that must catch its bug. The audit and the engine grade
through the same `grading.grade_round`, so a bug planted in the grading is one the engine has.
"""

import pytest
import torch

from conftest import tiny_loaded
from tandem.audit import Auditor, binned_check, detectable_tv, make_bins, run_audit, samples_to_detect
from tandem.config import EngineConfig, SamplingParams, SpecConfig
from tandem.drafters import Drafter, register
from tandem.engine.engine import Engine
from tandem.model.kernels import BlockKernels, block_kernels
from tandem import sampling
from tandem.sampling import native_sampling, processed_probs
from tandem.types import Draft
from tandem.verify import chain, grading, tree
from tandem.verify.stats import total_variation

pytestmark = pytest.mark.usefixtures("one_thread")

PARAMS = SamplingParams(temperature=0.4, top_k=3, max_tokens=8)
PROMPT = [5, 17, 33, 8, 91, 4, 17, 33]
# The tiny target's own greedy continuation of PROMPT loops on 51 12, so a repetition penalty
# moves its distributions a lot (TV 0.4 at position 1, 0.2 at position 2 after the first draft).
PENALTY_PROMPT = PROMPT + [51, 12, 51, 12, 51, 12]
PENALTY = SamplingParams(temperature=0.7, top_k=5, repetition_penalty=2.0, max_tokens=8)


def target_logits(ctx):
    """The tiny target's logits after ctx: [1, V], from a fresh cache."""
    _, loaded = tiny_loaded("llama")
    from tandem.model.kv_cache import KVCache
    from tandem.model.runner import ModelRunner, SeqInput

    r = ModelRunner(loaded.model, KVCache(loaded.config, 1, 64, torch.float32))
    return r.forward([SeqInput(r.cache.allocate(), ctx)]).logits


def _target_q(inp, ctx, mix=0.75):
    """q close to the target's own processed distribution (high acceptance, many bonus rounds)."""
    logits = target_logits(ctx)
    seen = torch.tensor(sorted(set(ctx))) if inp.params.repetition_penalty != 1.0 else None
    p = processed_probs(logits, inp.params, seen)[0]
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


@register("test_audit_tree")
class TopTwoTreeDrafter(Drafter):
    """A deterministic tree: the two most likely first tokens, each followed by its most likely
    successor (parents [-1, -1, 0, 1])."""

    drafts_trees = True

    def propose(self, batch):
        out = []
        for inp in batch:
            ctx = list(inp.token_ids)
            first = _target_q(inp, ctx).topk(2).indices.tolist()
            second = [int(_target_q(inp, ctx + [t]).argmax()) for t in first]
            out.append(Draft(first + second, None, [-1, -1, 0, 1]))
        return out


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


def failed(report, name):
    """The named check ran and failed."""
    check = report.check(name)
    return check.passed is False


def test_audit_passes_sampled_drafter():
    report = run_audit(engine("test_audit_sampled"), PROMPT, PARAMS, rounds=3000, batch=100)
    ran = [c for c in report.checks if c.passed is not None]
    assert {c.name for c in ran} >= {"position 1 token", "position 2 token", "recovered token (position 1)", "bonus token"}
    assert report.passed, report.render()


def test_audit_passes_ngram_drafter():
    report = run_audit(engine("ngram", k=3), PROMPT, PARAMS, rounds=2000, batch=100)
    assert report.passed, report.render()


@register("test_audit_silent")
class SilentDrafter(Drafter):
    """Never drafts, as a policy that finds no draft worth verifying would have it."""

    def propose(self, batch):
        return [Draft.empty() for _ in batch]


def test_audit_that_verified_nothing_is_inconclusive():
    """No round drafted: the position checks pass (plain sampling is exact) but nothing
    speculative was tested, which the verdict must say rather than pass; too few rounds for any
    check to run is inconclusive too, and rounds < 1 or alpha outside (0, 1) are refused."""
    report = run_audit(engine("test_audit_silent"), PROMPT, PARAMS, rounds=400, batch=100)
    assert report.drafted_rounds == 0 and report.check("position 1 token").passed
    assert report.verdict == "inconclusive" and not report.passed and "INCONCLUSIVE" in report.render()
    assert "the drafter proposed nothing for this prompt" in report.render()  # the policy was fixed
    report = run_audit(engine("ngram", k=3), PROMPT, PARAMS, rounds=20, batch=20)
    assert all(c.passed is None for c in report.checks)
    assert report.verdict == "inconclusive", report.render()
    for bad in (dict(rounds=0), dict(alpha=0.0), dict(alpha=2.0)):
        with pytest.raises(ValueError):
            run_audit(engine("ngram", k=3), PROMPT, PARAMS, **{"rounds": 10, **bad})


def test_audit_fails_soft_q_for_argmax_drafts():
    # The argmax draft is accepted with min(1, p/q) >= p: it comes out too often at position 1.
    report = run_audit(engine("test_audit_soft_argmax"), PROMPT, PARAMS, rounds=3000, batch=100)
    assert failed(report, "position 1 token"), report.render()


@pytest.fixture
def torch_grading(monkeypatch):
    """Requests without a penalty are processed and graded by tandem's kernels where they run
    (sampling.native_sampling); these controls plant their bugs in torch's path, which penalised
    requests and GPUs take, so they send every request there."""
    monkeypatch.setattr(sampling, "native_sampling", lambda *_: None)
    monkeypatch.setattr(grading, "native_sampling", lambda *_: None)


def test_audit_passes_sampled_drafter_on_torchs_path(torch_grading):
    report = run_audit(engine("test_audit_sampled"), PROMPT, PARAMS, rounds=3000, batch=100)
    assert report.passed, report.render()


def test_audit_fails_unclamped_residual(monkeypatch, torch_grading):
    monkeypatch.setattr(chain, "_residual_", lambda p, q: p.sub_(q).abs_())
    report = run_audit(engine("test_audit_sampled"), PROMPT, PARAMS, rounds=3000, batch=100)
    assert failed(report, "recovered token (position 1)"), report.render()


def test_audit_fails_bonus_from_wrong_row(monkeypatch, torch_grading):
    real = chain.verify_chain

    def bonus_from_p_k(target_probs, draft_tokens, draft_probs, num_drafts, generators, greedy):
        shifted = target_probs.clone()
        for b, k in enumerate(torch.as_tensor(num_drafts).tolist()):
            if k:
                shifted[b, k] = target_probs[b, k - 1]
        return real(shifted, draft_tokens, draft_probs, num_drafts, generators, greedy)

    monkeypatch.setattr(grading, "verify_chain", bonus_from_p_k)
    report = run_audit(engine("test_audit_sampled"), PROMPT, PARAMS, rounds=3000, batch=100)
    assert failed(report, "bonus token"), report.render()


def test_audit_passes_deterministic_tree():
    report = run_audit(engine("test_audit_tree", k=4), PROMPT, PARAMS, rounds=1500, batch=100)
    ran = {c.name for c in report.checks if c.passed is not None}
    assert {"position 1 token", "position 2 token"} <= ran, report.render()
    assert report.passed, report.render()


def test_audit_fails_tree_without_renormalisation(monkeypatch):
    """After rejecting a child, the next sibling must be accepted with p'(c) = p(c) / (1 - p(tried)).
    Without renormalising, the second root child comes out too rarely at position 1."""

    def no_renormalisation(p, children, draft_tokens, generator):
        residual = p.float().clone()
        mass = float(residual.sum())  # never updated: the bug
        for child in children:
            token = draft_tokens[child]
            u = float(torch.rand(1, generator=generator, dtype=torch.float64, device=generator.device))
            if u * mass < float(residual[token]):
                return child, residual
            residual[token] = 0.0
        return None, residual

    monkeypatch.setattr(tree, "_try_children", no_renormalisation)
    report = run_audit(engine("test_audit_tree", k=4), PROMPT, PARAMS, rounds=1500, batch=100)
    assert failed(report, "position 1 token"), report.render()


def test_audit_applies_the_repetition_penalty():
    """The audited distributions are plain decoding's, penalty included, and the engine's grading
    (which applies it row by row) passes against them."""
    eng = engine("test_audit_sampled")
    report = run_audit(eng, PENALTY_PROMPT, PENALTY, rounds=2000, batch=100)
    ran = {c.name for c in report.checks if c.passed is not None}
    assert {"position 1 token", "position 2 token"} <= ran, report.render()
    assert report.passed, report.render()
    auditor = Auditor(eng, PENALTY_PROMPT, PENALTY, batch=1)
    for prefix in [(), (51,)]:
        logits = target_logits(PENALTY_PROMPT + list(prefix))
        plain = processed_probs(logits, PENALTY, torch.tensor(sorted(set(PENALTY_PROMPT + list(prefix)))))[0]
        assert torch.allclose(auditor.exact(prefix), plain, atol=1e-5)
        assert total_variation(plain, processed_probs(logits, PENALTY)[0]) > 0.15  # the penalty matters here


def test_audit_catches_a_penalty_missing_on_the_draft_rows(monkeypatch):
    real = grading.target_probs

    def penalty_on_row_0_only(logits, draft, params, context, num_prompt_tokens=None, shift=None):
        rows = real(logits, draft, params, context, num_prompt_tokens)
        return torch.cat([rows[:1], processed_probs(logits[1:], params)])

    monkeypatch.setattr(grading, "target_probs", penalty_on_row_0_only)
    report = run_audit(engine("test_audit_sampled"), PENALTY_PROMPT, PENALTY, rounds=2000, batch=100)
    assert failed(report, "position 2 token"), report.render()


def test_engine_and_audit_grade_through_the_same_function(monkeypatch):
    """Swapping grading.grade_round swaps the engine's grading and the audit's alike."""
    calls = []
    real = grading.grade_round

    def recording(logits, draft, params, context, generator, num_prompt_tokens=None, shift=None, greedy=None):
        calls.append(len(draft))
        return real(logits, draft, params, context, generator, num_prompt_tokens, shift, greedy)

    monkeypatch.setattr(grading, "grade_round", recording)
    eng = engine("test_audit_sampled")
    eng.add_request(PROMPT, PARAMS)
    while eng.has_work():
        eng.step()
    engine_calls = len(calls)
    assert engine_calls and any(calls)
    run_audit(engine("test_audit_sampled"), PROMPT, PARAMS, rounds=20, batch=10)
    assert len(calls) == engine_calls + 20


def test_bins_are_top_tokens_plus_tail():
    p = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05] + [0.0] * 5)
    bins = make_bins(p, 200)  # expected counts 100, 60, 20, 10, 10: all named; zeros: impossible
    assert (bins.support, bins.size) == (5, 6)
    assert torch.allclose(bins.probs, torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05, 0.0, 0.0], dtype=torch.float64))
    bins = make_bins(p, 60)  # 0.05 * 60 = 3 < 5: the last two share the tail
    assert (bins.support, bins.size) == (4, 5) and bins.index[3] == bins.index[4] == 3
    bins = make_bins(torch.full((1000,), 1e-3), 10_000)  # 10 expected each: 30 named bins + the tail
    assert (bins.support, bins.size) == (31, 31)


def test_a_check_detects_the_tv_it_states():
    """Samples from a law at exactly the stated detectable binned TV fail the check; exact
    samples pass it."""
    p = torch.tensor([0.4, 0.2, 0.15, 0.1, 0.08, 0.04, 0.02, 0.01] + [0.0] * 8)
    n = 2000
    stated = detectable_tv(n, make_bins(p, n))
    shifted = p.clone()
    shifted[0] -= stated
    shifted[1] += stated
    gen = torch.Generator().manual_seed(0)
    for law, should_pass in [(p, True), (shifted, False)]:
        observed = torch.multinomial(law, n, replacement=True, generator=gen).tolist()
        check = binned_check("x", observed, p, alpha=1e-3)
        assert check.detectable == stated and check.passed is should_pass, check


def test_samples_to_detect_follows_the_bound():
    flat = torch.ones(97)
    n = samples_to_detect(flat, 0.05)
    assert detectable_tv(n, make_bins(flat, n)) <= 0.05 < detectable_tv(n // 2, make_bins(flat, n // 2))


def test_report_states_binned_tv_bound_and_power():
    """Each check prints n, bins, p-value, binned TV, its bound and the TV it detects, all below
    1 on a full vocabulary; the last lines tell how many rounds a TV of 0.05 needs."""
    report = run_audit(engine("ngram", k=3), PROMPT, SamplingParams(temperature=1.0, max_tokens=8), rounds=400, batch=100)
    text = report.render()
    ran = [c for c in report.checks if c.passed is not None]
    assert ran
    for c in ran:
        assert c.bins <= 31 and 0 < c.tv_bound < c.detectable < 1
        assert f"{c.samples:7d} {c.bins:5d} {c.p_value:10.3g} {c.tv:7.4f} {c.tv_bound:7.4f} {c.detectable:8.4f}" in text
    rounds, limiting = report.rounds_needed()
    assert limiting.samples_needed > limiting.samples  # 400 rounds cannot detect 0.05
    assert f"detecting a TV of 0.05 on every check that ran takes about {rounds} rounds" in text


def test_greedy_audit_is_token_identity():
    report = run_audit(engine("ngram", k=3), PROMPT, SamplingParams(temperature=0, max_tokens=12))
    assert report.passed and report.checks[0].name == "greedy token identity"
    assert 0 < report.drafted_rounds <= report.rounds < 12  # the speculative run's forwards, not --rounds
    assert f"rounds with a draft: {report.drafted_rounds} of {report.rounds}" in report.render()


def test_a_greedy_audit_without_drafts_proves_nothing():
    """Two tokens of a prompt the lookup finds nothing in: no round drafts, so the identity
    holds trivially and the verdict is inconclusive, not a pass."""
    report = run_audit(engine("ngram", k=3), [5, 17, 33], SamplingParams(temperature=0, max_tokens=2))
    assert report.checks[0].passed and report.drafted_rounds == 0
    assert report.verdict == "inconclusive"


def test_a_sampled_audit_needs_two_prompt_tokens():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        run_audit(engine("ngram", k=3), [5], SamplingParams(temperature=1.0, max_tokens=4), rounds=10)


# ---- cutting a draft after proposal (docs/algorithms.md, "Cutting a draft") ----------------------


@register("test_audit_confident")
class ConfidentDrafter(Drafter):
    """Sampled drafts from q = 0.7 p + 0.3 (p's top token): q overweights one token, so a cut
    that depends on the drawn token shows. Reports an honest confidence per token: the top
    probability of q_j, fixed before d_j is drawn (it depends on the earlier tokens only)."""

    def propose(self, batch):
        out = []
        for inp in batch:
            ctx, toks, qs = list(inp.token_ids), [], []
            for _ in range(min(self.spec.num_draft_tokens, inp.max_draft_tokens)):
                p = _target_q(inp, ctx, mix=1.0)
                q = 0.7 * p + 0.3 * torch.nn.functional.one_hot(p.argmax(), p.shape[0]).float()
                toks.append(int(torch.multinomial(q, 1, generator=inp.generator)))
                qs.append(q)
                ctx.append(toks[-1])
            out.append(Draft(toks, probs=torch.stack(qs), confidence=[float(q.max()) for q in qs]))
        return out


def cut_engine(min_survival):
    return Engine(tiny_loaded("llama")[1], EngineConfig(
        max_model_len=64, spec=SpecConfig("test_audit_confident", 3, min_survival=min_survival)))


def cut_before_first_where(keep_token):
    """A cut (to plant in the engine's policy) that drops the draft from the first token for
    which keep_token(position, token, draft) is False."""

    def cut(request_id, draft):
        for j, token in enumerate(draft.token_ids):
            if not keep_token(j, token, draft):
                return draft.truncated(j)
        return draft

    return cut


def test_the_policy_cuts_chains_where_survival_falls_below_the_threshold():
    policy = cut_engine(0.5).policy
    d = Draft([1, 2, 3, 4], confidence=[0.9, 0.7, 0.9, 0.9])  # survival 0.9, 0.63, 0.567, 0.51
    assert policy.cut("r", d).token_ids == [1, 2, 3, 4]
    assert policy.cut("r", Draft([1, 2, 3], confidence=[0.9, 0.5, 0.99])).token_ids == [1]
    assert policy.cut("r", Draft([1, 2, 3])).token_ids == [1, 2, 3]  # no confidences: whole
    tree = Draft([1, 2], parents=[-1, -1], confidence=[0.1, 0.1])
    assert policy.cut("r", tree) is tree
    assert cut_engine(0.0).policy.cut("r", Draft([1], confidence=[0.01])).token_ids == [1]


def test_audit_passes_a_confidence_cut_of_sampled_drafts():
    """The cut reads q_j's confidence, fixed before d_j was drawn: lossless, and the audit of the
    engine with the cut in place passes (while the cut really shortens drafts)."""
    eng = cut_engine(0.18)  # survival after 3 tokens is 0.17-0.19, depending on d_1 and d_2
    lengths = {len(r.draft) for r in Auditor(eng, PROMPT, PARAMS, batch=100).run(300)}
    assert lengths == {2, 3}, lengths  # cut, and where depends on the earlier tokens
    report = run_audit(eng, PROMPT, PARAMS, rounds=3000, batch=100)
    assert report.passed, report.render()


def test_audit_fails_a_cut_that_reads_the_targets_p_of_the_cut_token():
    eng = cut_engine(0.0)
    p1 = processed_probs(target_logits(PROMPT), PARAMS)[0]
    threshold = float(p1.sort(descending=True).values[1])  # only the top token passes at position 1
    eng.policy.cut = cut_before_first_where(lambda j, t, d: j > 0 or float(p1[t]) > threshold)
    report = run_audit(eng, PROMPT, PARAMS, rounds=3000, batch=100)
    assert failed(report, "position 1 token"), report.render()


def test_audit_fails_a_cut_that_reads_the_q_of_a_sampled_token():
    eng = cut_engine(0.0)
    # "drop d_j when q_j(d_j) is small": which tokens get verified then depends on the draw
    eng.policy.cut = cut_before_first_where(lambda j, t, d: float(d.probs[j, t]) >= 0.4)
    report = run_audit(eng, PROMPT, PARAMS, rounds=3000, batch=100)
    assert failed(report, "position 1 token"), report.render()


# Negative: repeats are rewarded, so the first token's count lifts it into position 2's top 5
# (TV about 0.86 between position 2 with and without it counted).
OUTPUT_PENALTY = SamplingParams(temperature=0.7, top_k=5, presence_penalty=-1.5, frequency_penalty=-1.0, max_tokens=8)


def test_audit_applies_the_presence_and_frequency_penalties():
    """The audited distributions count the round's generated tokens (not the prompt), and the
    engine's grading passes against them."""
    eng = engine("test_audit_sampled")
    report = run_audit(eng, PENALTY_PROMPT, OUTPUT_PENALTY, rounds=2000, batch=100)
    ran = {c.name for c in report.checks if c.passed is not None}
    assert {"position 1 token", "position 2 token"} <= ran, report.render()
    assert report.passed, report.render()
    auditor = Auditor(eng, PENALTY_PROMPT, OUTPUT_PENALTY, batch=1)
    assert torch.allclose(auditor.exact(()), processed_probs(target_logits(PENALTY_PROMPT), OUTPUT_PENALTY)[0], atol=1e-5)
    for first in (51, 12):
        logits = target_logits(PENALTY_PROMPT + [first])
        counted = processed_probs(logits, OUTPUT_PENALTY, None, (torch.tensor([first]), torch.tensor([1.0])))[0]
        assert torch.allclose(auditor.exact((first,)), counted, atol=1e-5)


def test_audit_catches_output_penalties_missing_on_the_draft_rows(monkeypatch):
    real = grading.target_probs

    def drafts_not_counted(logits, draft, params, context, num_prompt_tokens=None, shift=None):
        rows = real(logits, draft, params, context, num_prompt_tokens)
        later = processed_probs(logits[1:], params, None, grading.output_counts(context, params, num_prompt_tokens))
        return torch.cat([rows[:1], later])

    monkeypatch.setattr(grading, "target_probs", drafts_not_counted)
    report = run_audit(engine("test_audit_sampled"), PENALTY_PROMPT, OUTPUT_PENALTY, rounds=2000, batch=100)
    assert failed(report, "position 2 token"), report.render()


# Without a penalty, plain sampling, the drafters and the verifier take tandem's kernels'
# sampling path (sampling.native_sampling: PARAMS above with its top-k, and min-p here; the tiny
# target is flat, so a low temperature and min-p concentrate it as top_k=3 does), so the audit
# must pass it and catch bugs planted there too.
NATIVE = SamplingParams(temperature=0.05, min_p=0.2, max_tokens=8)
needs_kernels = pytest.mark.skipif(block_kernels() is None, reason="tandem's CPU kernels do not run here")


@needs_kernels
def test_requests_without_a_penalty_take_the_kernels_path():
    for params in (NATIVE, PARAMS):
        assert native_sampling(params, target_logits(PROMPT)) is not None
    assert native_sampling(PENALTY, target_logits(PROMPT)) is None


@needs_kernels
@pytest.mark.parametrize("algorithm", ["test_audit_sampled", "ngram"])
def test_audit_passes_the_kernels_chain_rule(algorithm):
    report = run_audit(engine(algorithm), PROMPT, NATIVE, rounds=3000, batch=100)
    ran = {c.name for c in report.checks if c.passed is not None}
    assert "position 1 token" in ran, report.render()
    assert report.passed, report.render()


@needs_kernels
def test_audit_fails_the_kernels_rule_fed_a_sampled_draft_as_deterministic(monkeypatch):
    """Grading a sampled draft without its q accepts d with p(d), not min(1, p(d) / q(d)), and
    draws the recovered token from p without d instead of max(0, p - q)."""
    real = BlockKernels.grade_chain
    monkeypatch.setattr(BlockKernels, "grade_chain", lambda self, logits, draft, q, *rest, **kw:
                        real(self, logits, draft, None, *rest, **kw))
    report = run_audit(engine("test_audit_sampled"), PROMPT, NATIVE, rounds=3000, batch=100)
    assert not report.passed, report.render()


@needs_kernels
def test_audit_fails_the_kernels_rule_drawing_the_bonus_from_the_wrong_row(monkeypatch):
    real = BlockKernels.grade_chain

    def bonus_from_p_k(self, logits, draft, q, *rest, **kw):
        rows = logits.clone()
        rows[len(draft)] = logits[len(draft) - 1]
        return real(self, rows, draft, q, *rest, **kw)

    monkeypatch.setattr(BlockKernels, "grade_chain", bonus_from_p_k)
    report = run_audit(engine("test_audit_sampled"), PROMPT, NATIVE, rounds=3000, batch=100)
    assert failed(report, "bonus token"), report.render()
