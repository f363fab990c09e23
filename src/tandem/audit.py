"""`tandem audit`: a statistical proof that a target + drafter pair is lossless on the user's setup.

Many independent speculative rounds are run from one context with the real drafter, the real
target forward and the engine's own grading (`tandem.verify.grading.grade_round`: the same
processing of p, penalties included, and the same chain or tree rule). Each outcome is
compared against distributions computed exactly from the target, as plain decoding would sample
(the repetition penalty sees the context and the prefix; the presence and frequency penalties
count the prefix, the round's generated tokens):
- the token at draft position j, given the round reached j with the most common accepted prefix,
  must follow p_j(. | context, prefix) (position 1 is the first committed token);
- the recovered token after a rejection at position 1 must follow norm(max(0, p_1 - q_1)) (a
  deterministic draft, or a tree's root children: p_1 with every tried token zeroed);
- the bonus token after a fully accepted draft must follow p_{k+1}(. | context, draft).
Greedy decoding is audited by token identity with plain decoding instead.

Binned checks. A check's bins are fixed from its exact distribution and its sample count n
before any of its tokens are counted (n and the group's prefix depend only on other tokens than
the ones tested): every token expected at least MIN_EXPECTED times (at most MAX_BINS of them,
and always the most likely one) gets its own bin, the other tokens with mass share one tail bin,
and the tokens of probability 0 one "impossible" bin. On these bins each check computes
- a chi-square p-value, compared with alpha / (number of checks) (Bonferroni);
- the binned total variation. Merging tokens into bins never increases TV, so the binned TV is a
  lower bound on the true TV (a difference inside the tail is invisible);
- the TV bound t(n, m) = tv_bound(n, m) over the m bins with mass: exact sampling exceeds it with
  probability <= 1e-4, so the check fails when the binned TV is above it;
- its power, the smallest detectable TV: t(n, m) + t(n, M), M = m plus the impossible bin if any.
  If the true binned law is at TV D from the exact one, the empirical law is within t(n, M) of
  the true one with probability >= 0.9999 (tv_bound holds for any law on M outcomes), so its TV
  to the exact law is at least D - t(n, M), above t(n, m) once D > t(n, m) + t(n, M): such a
  bug fails the TV test with probability >= 0.9999 (the chi-square test usually catches less).
Both bounds scale as 1 / sqrt(n), which gives the rounds a check needs to detect a TV of
POWER_TV: the report's last line.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field, replace

import torch

from tandem.config import SamplingParams, SpecConfig
from tandem.drafters import DraftInput, DraftOutcome
from tandem.engine.engine import Engine
from tandem.model.kv_cache import KVCache
from tandem.model.runner import ModelRunner, SeqInput
from tandem.progress import progress
from tandem.sampling import OTHER_DEVICE_SEED_OFFSET, make_generator, processed_probs
from tandem.types import rooted_parents
from tandem.verify import grading
from tandem.verify.stats import chi_square_test, total_variation, tv_bound

MIN_GROUP = 200  # fewer samples than this: the check is skipped
MIN_EXPECTED = 5.0  # a token gets its own bin when the check expects at least this many of it
MAX_BINS = 30  # tokens with their own bin, at most (plus the tail and the impossible bin)
POWER_TV = 0.05  # the report says how many rounds detecting this binned TV takes


@dataclass
class AuditCheck:
    """One check's result. tv: binned TV (a lower bound on the true TV); tv_bound: the largest
    binned TV exact sampling explains; detectable: the smallest binned TV this n detects with
    probability >= 0.9999; samples_needed: the n that detects a binned TV of POWER_TV."""

    name: str
    samples: int
    p_value: float | None = None
    tv: float | None = None
    tv_bound: float | None = None
    passed: bool | None = None  # None: skipped (too few samples)
    bins: int | None = None
    detectable: float | None = None
    samples_needed: int | None = None


@dataclass
class AuditReport:
    algorithm: str
    rounds: int
    alpha: float
    checks: list[AuditCheck] = field(default_factory=list)
    drafted_rounds: int | None = None  # the rounds whose draft was not empty
    policy: str = "fixed"  # the speculation policy the engine ran

    @property
    def verdict(self) -> str:
        """fail: a check failed. inconclusive: none failed, but none ran (too few samples), or
        no round had a draft to verify (the policy drafted nothing: nothing speculative was
        tested). pass otherwise."""
        if any(c.passed is False for c in self.checks):
            return "fail"
        if not any(c.passed for c in self.checks) or self.drafted_rounds == 0:
            return "inconclusive"
        return "pass"

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def check(self, name: str) -> AuditCheck:
        return next(c for c in self.checks if c.name == name)

    def rounds_needed(self) -> tuple[int, AuditCheck] | None:
        """Rounds for every check that ran to detect a binned TV of POWER_TV, and the check that
        needs the most: its samples_needed scaled by the share of rounds that reached it."""
        best = None
        for c in self.checks:
            if c.samples_needed is None or c.passed is None:
                continue
            need = math.ceil(c.samples_needed * max(self.rounds, c.samples) / c.samples)
            if best is None or need > best[0]:
                best = (need, c)
        return best

    def render(self) -> str:
        lines = [f"tandem audit: {self.algorithm}, {self.rounds} rounds, alpha {self.alpha:g} (Bonferroni over checks)"]
        lines.append(f"{'check':30} {'n':>7} {'bins':>5} {'p-value':>10} {'TV':>7} {'bound':>7} {'detects':>8}  verdict")
        for c in self.checks:
            if c.passed is None:
                lines.append(f"{c.name:30} {c.samples:7d} {'-':>5} {'-':>10} {'-':>7} {'-':>7} {'-':>8}  skipped (fewer than {MIN_GROUP})")
            elif c.bins is None:  # an identity check: no distribution
                lines.append(f"{c.name:30} {c.samples:7d} {'-':>5} {'-':>10} {'-':>7} {'-':>7} {'-':>8}  {'pass' if c.passed else 'FAIL'}")
            else:
                lines.append(f"{c.name:30} {c.samples:7d} {c.bins:5d} {c.p_value:10.3g} {c.tv:7.4f} {c.tv_bound:7.4f} "
                             f"{c.detectable:8.4f}  {'pass' if c.passed else 'FAIL'}")
        if any(c.bins is not None for c in self.checks):
            lines.append("TV: binned total variation, a lower bound on the true TV; bound: what exact sampling stays "
                         "under (probability 0.9999); detects: the smallest binned TV this n catches (probability 0.9999)")
            need = self.rounds_needed()
            if need is not None:
                rounds, limiting = need
                skipped = any(x.passed is None and x.samples for x in self.checks)
                lines.append(f"power: detecting a TV of {POWER_TV:g} on every check that ran takes about {rounds} rounds "
                             f"(this run: {self.rounds}; limiting check: {limiting.name}, {limiting.samples} samples "
                             f"here, {limiting.samples_needed} needed)" + ("; the skipped checks need more" if skipped else ""))
        if self.drafted_rounds is not None:
            lines.append(f"rounds with a draft: {self.drafted_rounds} of {self.rounds}")
        verdict = self.verdict
        if verdict == "pass":
            lines.append("verdict: PASS (lossless within the test's power)")
        elif verdict == "fail":
            lines.append("verdict: FAIL")
        elif self.drafted_rounds == 0:
            why = ("the drafter proposed nothing for this prompt: give one it can draft for (the lookup drafters "
                   "need text that repeats)" if self.policy == "fixed" else
                   f"the {self.policy} speculation policy drafted nothing here; --speculative-policy fixed drafts "
                   "every round the drafter can")
            lines.append(f"verdict: INCONCLUSIVE: no round drafted, so no draft was verified ({why})")
        else:
            lines.append(f"verdict: INCONCLUSIVE: no check had {MIN_GROUP} samples (raise --rounds)")
        return "\n".join(lines)


@dataclass
class _Round:
    """One round: its draft's tokens, q_1 (sampled chains), the accepted count, the committed
    tokens, the tokens tried at position 1 (a chain's first draft token; a tree's root children)
    and whether the accepted path ended at a leaf (the last token is then the bonus)."""

    draft: tuple[int, ...]
    q1: torch.Tensor | None
    accepted: int
    committed: list[int]
    first_tried: tuple[int, ...]
    at_leaf: bool


class Auditor:
    """Runs rounds from one context; `batch` rounds share one target forward."""

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams, batch: int = 64) -> None:
        if engine.drafter is None:
            raise ValueError("audit needs a speculative algorithm (--speculative-algorithm)")
        self.engine = engine
        self.ctx = list(prompt_ids)
        self.params = params
        self.k = engine.config.spec.num_draft_tokens
        cfg = engine.loaded.config
        self.batch = batch
        self.cache = KVCache(cfg, batch, len(self.ctx) + 2 * self.k + 4, engine.loaded.dtype, engine.config.device,
                             engine.cache.k.dtype)
        self.runner = ModelRunner(engine.loaded.model, self.cache)
        self.rows = [self.cache.allocate() for _ in range(batch)]
        # Prefill the context once and copy its KV rows: every round starts from the same state.
        # Drafters that read target hidden states (trained heads) get the context's rows, as the
        # engine gives them after a prefill.
        prefill = self.runner.forward([SeqInput(self.rows[0], self.ctx[:-1])], engine.drafter.needs.hidden_layers)
        self.hidden = {layer: rows[0] for layer, rows in prefill.hidden.items()}
        n = len(self.ctx) - 1
        for r in self.rows[1:]:
            self.cache.k[:, r, :, :n] = self.cache.k[:, self.rows[0], :, :n]
            self.cache.v[:, r, :, :n] = self.cache.v[:, self.rows[0], :, :n]
            self.cache.lengths[r] = n
        self._exact: dict[tuple[int, ...], torch.Tensor] = {}

    def exact(self, prefix: tuple[int, ...]) -> torch.Tensor:
        """The target distribution plain decoding samples after context + prefix: [V], processed
        with the repetition penalty over context and prefix and the presence and frequency
        penalties over the prefix (the context is the prompt). Computed here, independently of
        the grading under audit."""
        if prefix not in self._exact:
            row, n = self.rows[0], len(self.ctx) - 1
            logits = self.runner.forward([SeqInput(row, [self.ctx[-1], *prefix], logits="last")]).logits
            self.cache.truncate(row, n)
            seen = counts = None
            if self.params.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(self.ctx) | set(prefix)), dtype=torch.long)
            if self.params.penalizes_output:  # the prefix is all the output there is
                generated = collections.Counter(prefix)
                ids = sorted(generated)
                counts = (torch.tensor(ids, dtype=torch.long), torch.tensor([generated[i] for i in ids], dtype=torch.float32))
            self._exact[prefix] = processed_probs(logits, self.params, seen, counts)[0]
        return self._exact[prefix]

    def run(self, rounds: int, seed: int = 0) -> list[_Round]:
        """`rounds` independent rounds, each verified like the engine's (one token-by-token forward
        per batch, chains and trees alike) and graded by `grading.grade_round`."""
        drafter, n = self.engine.drafter, len(self.ctx) - 1
        out: list[_Round] = []
        with progress(total=rounds, desc="audit rounds") as bar:
            for start in range(0, rounds, self.batch):
                size = min(self.batch, rounds - start)
                seeds = [seed * 1_000_003 + start + i for i in range(size)]
                # As in the engine: the verifier draws on the target's device, the drafter on its own.
                gens = [make_generator(s, self.engine.config.device) for s in seeds]
                draft_device = torch.device(drafter.sampling_device)
                draft_gens = gens if draft_device.type == gens[0].device.type else [
                    make_generator(s + OTHER_DEVICE_SEED_OFFSET, draft_device) for s in seeds]
                inputs = [
                    DraftInput(f"audit-{start + i}", self.ctx, len(self.ctx), self.k, self.params, g, self.hidden)
                    for i, g in enumerate(draft_gens)
                ]
                # The engine's admission, as the engine applies it (the batch's drafts together):
                # the audit checks it too.
                drafts = self.engine.policy.admit([inp.request_id for inp in inputs],
                                                  [d.pruned(self.k, self.k) for d in drafter.propose(inputs)], size,
                                                  [len(self.ctx)] * size)
                fwd = self.runner.forward([
                    SeqInput(self.rows[i], [self.ctx[-1], *d.token_ids], logits="all",
                             parents=rooted_parents(d.parents))
                    for i, d in enumerate(drafts)
                ], token_by_token=True)
                outcomes = []
                for i, d in enumerate(drafts):
                    # Through the module attribute, as the engine does: a test that swaps in a
                    # broken grading breaks both.
                    committed, path = grading.grade_round(fwd.rows(i), d, self.params, self.ctx, gens[i])
                    parents = d.parents if d.is_tree else list(range(-1, len(d) - 1))
                    at_leaf = bool(path) and path[-1] not in parents
                    first_tried = tuple(t for t, p in zip(d.token_ids, parents) if p < 0)
                    q1 = d.probs[0] if d.probs is not None and not d.is_tree and len(d) else None
                    out.append(_Round(tuple(d.token_ids), q1, len(path), committed, first_tried, at_leaf))
                    outcomes.append(DraftOutcome(inputs[i].request_id, len(d), len(path), committed))
                    self.cache.truncate(self.rows[i], n)
                self._finish(inputs, outcomes)
                bar.update(size)
        return out

    def _finish(self, inputs: list[DraftInput], outcomes: list[DraftOutcome]) -> None:
        drafter = self.engine.drafter
        drafter.observe(outcomes)
        for inp in inputs:
            drafter.release(inp.request_id)


@dataclass(frozen=True)
class Bins:
    """A partition of the vocabulary for one check. index: [V] each token's bin; probs: each
    bin's exact mass (named tokens, then the tail, then the impossible tokens; empty bins have
    mass 0 and receive nothing); support: the bins with mass (m); size: the non-empty bins (M)."""

    index: torch.Tensor
    probs: torch.Tensor
    support: int
    size: int


def make_bins(expected: torch.Tensor, samples: int) -> Bins:
    """Bins fixed from the exact distribution [V] and the sample count alone (never from counts):
    the tokens expected >= MIN_EXPECTED times, at most MAX_BINS, always the most likely one; a
    tail bin for the rest with mass; one bin for the tokens of probability 0."""
    p = expected.double().cpu()
    p = p / p.sum()
    order = torch.argsort(p, descending=True, stable=True)[:MAX_BINS]
    named = order[(samples * p[order] >= MIN_EXPECTED) & (p[order] > 0)]
    if not named.numel():
        named = order[:1]
    tail, impossible = len(named), len(named) + 1
    index = torch.full(p.shape, tail, dtype=torch.long)
    index[named] = torch.arange(len(named))
    index[p == 0] = impossible
    probs = torch.zeros(len(named) + 2, dtype=torch.float64).scatter_add_(0, index, p)
    sizes = torch.bincount(index, minlength=len(probs))
    return Bins(index, probs, int((probs > 0).sum()), int((sizes > 0).sum()))


def detectable_tv(samples: int, bins: Bins) -> float:
    """The smallest binned TV that `samples` draws detect with probability >= 0.9999: the pass
    threshold tv_bound(n, m) plus the empirical law's own deviation bound tv_bound(n, M)."""
    return tv_bound(samples, bins.support) + tv_bound(samples, bins.size)


def samples_to_detect(expected: torch.Tensor, tv: float = POWER_TV) -> int:
    """The fewest samples whose detectable TV is at most `tv`. Both bounds are c / sqrt(n)
    (c = tv_bound(1, .)), so n = ((c_m + c_M) / tv)^2 for fixed bins; the bins themselves grow
    with n, so iterate to the fixed point (they stop growing at MAX_BINS)."""
    n = MIN_GROUP
    for _ in range(MAX_BINS + 3):
        bins = make_bins(expected, n)
        need = max(MIN_GROUP, math.ceil(((tv_bound(1, bins.support) + tv_bound(1, bins.size)) / tv) ** 2))
        if need <= n:
            return n
        n = need
    return n


def binned_check(name: str, observed: list[int], expected: torch.Tensor, alpha: float) -> AuditCheck:
    """Observed tokens against an exact (possibly unnormalised) distribution [V], on bins fixed
    from it and len(observed) (module docstring); skipped below MIN_GROUP samples."""
    n = len(observed)
    needed = samples_to_detect(expected) if n else None
    if n < MIN_GROUP:
        return AuditCheck(name, n, samples_needed=needed)
    bins = make_bins(expected, n)
    counts = torch.bincount(bins.index[torch.tensor(observed)], minlength=len(bins.probs)).double()
    test = chi_square_test(counts, bins.probs)
    tv = total_variation(counts, bins.probs)
    bound = tv_bound(n, bins.support)
    return AuditCheck(name, n, test.p_value, tv, bound, test.p_value >= alpha and tv <= bound, bins.support,
                      detectable_tv(n, bins), needed)


def audit_rounds(auditor: Auditor, rounds: list[_Round], alpha: float) -> list[AuditCheck]:
    k = auditor.k
    num_checks = k + 2
    a = alpha / num_checks
    checks = []
    # Token at position j given the round reached j through the most common accepted prefix.
    for j in range(k + 1):
        reached = [r for r in rounds if len(r.committed) > j]
        groups = collections.Counter(tuple(r.committed[:j]) for r in reached)
        if not groups:
            checks.append(AuditCheck(f"position {j + 1} token", 0))
            continue
        prefix, _ = groups.most_common(1)[0]
        obs = [r.committed[j] for r in reached if tuple(r.committed[:j]) == prefix]
        checks.append(binned_check(f"position {j + 1} token", obs, auditor.exact(prefix), a))
    # Recovered token after rejecting draft position 1, grouped by the (most common) first draft.
    rejected = [r for r in rounds if r.draft and r.accepted == 0]
    if rejected:
        by_first = collections.Counter(r.first_tried for r in rejected if r.q1 is None)
        p1 = auditor.exact(())
        if by_first and by_first.most_common(1)[0][1] >= len(rejected) / 2:
            tried = by_first.most_common(1)[0][0]
            group = [r for r in rejected if r.q1 is None and r.first_tried == tried]
            residual = p1.clone()
            residual[list(tried)] = 0.0
        else:
            group = [r for r in rejected if r.q1 is not None]
            residual = torch.clamp(p1 - group[0].q1.float(), min=0.0) if group else p1
        obs = [r.committed[0] for r in group]
        checks.append(binned_check("recovered token (position 1)", obs, residual, a) if residual.sum() > 0 else AuditCheck("recovered token (position 1)", 0))
    else:
        checks.append(AuditCheck("recovered token (position 1)", 0))
    # Bonus token after the most common fully accepted path (a chain's whole draft, a tree's
    # path to a leaf).
    full = [r for r in rounds if r.draft and r.at_leaf]
    groups = collections.Counter(tuple(r.committed[:-1]) for r in full)
    if groups:
        path, _ = groups.most_common(1)[0]
        obs = [r.committed[-1] for r in full if tuple(r.committed[:-1]) == path]
        checks.append(binned_check("bonus token", obs, auditor.exact(path), a))
    else:
        checks.append(AuditCheck("bonus token", 0))
    return checks


def run_audit(engine: Engine, prompt_ids: list[int], params: SamplingParams, rounds: int = 4000,
              alpha: float = 1e-3, batch: int = 64, seed: int = 0) -> AuditReport:
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha is a significance level in (0, 1), got {alpha}")
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if not params.greedy and (params.structured_output is not None or params.logit_bias or params.min_tokens):
        raise ValueError("the sampled audit checks the target's own distribution; a structured output, a logit "
                         "bias or min_tokens shifts it (tests/test_structured_output.py and test_engine_sampling.py "
                         "check those cases)")
    report = AuditReport(engine.config.spec.algorithm or "", rounds, alpha, policy=engine.config.spec.policy)
    if params.greedy:
        check, report.rounds, report.drafted_rounds = _greedy_identity(engine, prompt_ids, params)
        report.checks.append(check)
        return report
    if len(prompt_ids) < 2:
        raise ValueError("the sampled audit replays rounds after the prompt's last token, so the prompt needs at "
                         "least 2 tokens")
    auditor = Auditor(engine, prompt_ids, params, batch)
    ran = auditor.run(rounds, seed)
    report.checks = audit_rounds(auditor, ran, alpha)
    report.drafted_rounds = sum(1 for r in ran if r.draft)
    return report


def _greedy_identity(engine: Engine, prompt_ids: list[int], params: SamplingParams) -> tuple[AuditCheck, int, int]:
    """Greedy: speculative output must equal plain output token for token. Returns the check,
    the speculative run's rounds (its target forwards) and how many of them verified a draft:
    none means nothing speculative was compared."""
    plain = Engine(engine.loaded, replace(engine.config, spec=SpecConfig()))
    reqs = []
    for eng in (engine, plain):
        req = eng.add_request(prompt_ids, params)
        while eng.has_work():
            eng.step()
        reqs.append(req)
    same = reqs[0].output_ids == reqs[1].output_ids
    check = AuditCheck("greedy token identity", len(reqs[0].output_ids), 1.0 if same else 0.0, 0.0, 0.0, same)
    return check, reqs[0].stats.num_forwards, reqs[0].stats.num_drafts
