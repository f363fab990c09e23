"""The chain verifier is lossless: simulated rounds commit tokens distributed exactly as the target.

p_1..p_{K+1} do not depend on the prefix here, so the rule of docs/algorithms.md section 1 implies: the
token committed at position j of a round, among rounds that reach j, is distributed as p_j whatever
the drafter did. Each scenario also checks the recovered tokens against the residual and the
acceptance rate at each position. Negative controls (broken verifiers) must fail the same checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import pytest
import torch

from tandem.config import SamplingParams
from tandem.sampling import processed_probs
from tandem.types import VerifyResult
from tandem.verify import chain
from tandem.verify.chain import verify_chain_from_uniforms
from tandem.verify.stats import ChiSquare, chi2_sf, chi_square_test, total_variation, tv_bound

V = 12
K = 3
ROUNDS_PER_CALL = 20_000
CALLS = 5  # 100k simulated rounds per scenario
ALPHA = 1e-4  # fixed seeds make each check deterministic; this only guards against an unlucky seed


pytestmark = pytest.mark.usefixtures("one_thread")


def noise(rows: int, seed: int, scale: float) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * scale


def processed_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    return torch.cat([processed_probs(logits[i : i + 1], sp) for i, sp in enumerate(params)])


@dataclass(frozen=True)
class Scenario:
    """target: [K+1, V] p_1..p_{K+1}. draft_dist: [K, V], what draft token i is drawn from.
    sampled: the drafter passes q = draft_dist; otherwise its drafts are deterministic (q None)."""

    name: str
    target: torch.Tensor
    draft_dist: torch.Tensor
    sampled: bool


# Drafts agree with the target only partly, like a real drafter: its logits are the target's
# plus noise. That keeps acceptance high enough for the later positions to get samples.
TARGET_LOGITS = noise(K + 1, seed=1, scale=2.0)
TARGET = torch.softmax(TARGET_LOGITS, -1)
SOFT_Q = torch.softmax(TARGET_LOGITS[:K] + noise(K, seed=2, scale=1.0), -1)
ARGMAX_Q = torch.nn.functional.one_hot(SOFT_Q.argmax(-1), V).float()
OTHER_Q = torch.softmax(2 * TARGET_LOGITS[:K] + noise(K, seed=5, scale=1.5), -1)
PROCESSED_TARGET = processed_rows(TARGET_LOGITS, [
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(top_p=0.8),
    SamplingParams(min_p=0.2),
    SamplingParams(temperature=1.3, top_k=4, top_p=0.9),
])
PROCESSED_Q = processed_rows(TARGET_LOGITS[:K] + noise(K, seed=4, scale=1.5), [
    SamplingParams(top_k=4),
    SamplingParams(temperature=1.5, min_p=0.1),
    SamplingParams(temperature=0.5, top_p=0.9),
])

SCENARIOS = [
    Scenario("sampled", TARGET, SOFT_Q, sampled=True),
    Scenario("deterministic", TARGET, OTHER_Q, sampled=False),
    Scenario("argmax", TARGET, ARGMAX_Q, sampled=False),
    Scenario("processed_sampled", PROCESSED_TARGET, PROCESSED_Q, sampled=True),
    Scenario("processed_deterministic", PROCESSED_TARGET, PROCESSED_Q, sampled=False),
]

Verifier = Callable[..., VerifyResult]  # the signature of verify_chain_from_uniforms


def draw_drafts(draft_dist: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """n independent drafts, token i from draft_dist[i]: [n, K]."""
    return torch.stack([torch.multinomial(draft_dist[i], n, True, generator=gen) for i in range(K)], 1)


def simulate(verifier: Verifier, scen: Scenario, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CALLS x ROUNDS_PER_CALL independent rounds with k = K: tokens [N, K+1], num_accepted [N]."""
    gen = torch.Generator().manual_seed(seed)
    n = ROUNDS_PER_CALL
    tokens, accepted = [], []
    for _ in range(CALLS):
        drafts = draw_drafts(scen.draft_dist, n, gen)
        accept_u = torch.rand(n, K, generator=gen, dtype=torch.float64)
        draw_u = torch.rand(n, generator=gen, dtype=torch.float64)
        draft_probs = scen.draft_dist.expand(n, K, V) if scen.sampled else [None] * n
        target = scen.target.expand(n, K + 1, V)
        result = verifier(target, drafts, draft_probs, [K] * n, accept_u, draw_u, [False] * n)
        tokens.append(result.tokens)
        accepted.append(result.num_accepted)
    return torch.cat(tokens), torch.cat(accepted)


@dataclass
class Check:
    name: str
    chi: ChiSquare
    tv: float
    bound: float

    @property
    def passed(self) -> bool:
        return self.chi.p_value >= ALPHA and self.tv <= self.bound


def fit(name: str, tokens: torch.Tensor, probs: torch.Tensor) -> Check:
    counts = torch.bincount(tokens, minlength=len(probs))
    support = int((probs > 0).sum())
    return Check(name, chi_square_test(counts, probs), total_variation(counts, probs),
                 tv_bound(len(tokens), support, 1 - ALPHA))


def lossless_checks(tokens, num_accepted, target, draft_dist, sampled, k=K) -> list[Check]:
    """Marginal of every committed position, recovered tokens and acceptance counts per position."""
    checks = []
    for j in range(k + 1):
        reached = num_accepted >= j
        checks.append(fit(f"position {j + 1} ~ p_{j + 1}", tokens[reached, j], target[j]))
    for j in range(k):
        p, r = target[j], draft_dist[j]
        # Recovered token after rejecting position j: sampled drafts leave max(0, p - q); a
        # deterministic draft d ~ r leaves p with d zeroed, which mixes over d (weighted by the
        # rejection chance 1 - p(d)) to a law proportional to p(x) (1 - r(x)).
        residual = (p - r).clamp(min=0) if sampled else p * (1 - r)
        recovered = tokens[num_accepted == j, j]
        if residual.sum() > 1e-6 and len(recovered):  # a missing rejection shows in the acceptance check
            checks.append(fit(f"recovered at {j + 1}", recovered, residual))
        accept_rate = float(torch.minimum(p, r).sum() if sampled else (p * r).sum())
        reached = num_accepted >= j
        outcome = (num_accepted[reached] > j).long()  # 1 = draft j + 1 accepted
        checks.append(fit(f"acceptance at {j + 1}", outcome, torch.tensor([1 - accept_rate, accept_rate])))
    return checks


def report(checks: list[Check]) -> str:
    return "\n".join(
        f"{c.name}: p={c.chi.p_value:.3g} (chi2={c.chi.statistic:.1f}, dof={c.chi.dof}) "
        f"tv={c.tv:.4f} bound={c.bound:.4f}"
        for c in checks
    )


@pytest.mark.parametrize("scen", SCENARIOS, ids=lambda s: s.name)
def test_committed_tokens_follow_the_target(scen):
    tokens, num_accepted = simulate(verify_chain_from_uniforms, scen, seed=100)
    checks = lossless_checks(tokens, num_accepted, scen.target, scen.draft_dist, scen.sampled)
    assert all(c.passed for c in checks), report(checks)


def test_processed_scenario_exercises_support_mismatch():
    # Drafts outside the target's top-k/top-p/min-p support, and target mass the drafter filtered out.
    assert ((PROCESSED_Q > 0) & (PROCESSED_TARGET[:K] == 0)).any()
    assert ((PROCESSED_Q == 0) & (PROCESSED_TARGET[:K] > 0)).any()


def test_mixed_batch_rows_follow_the_target():
    # One batch mixes sampled and deterministic drafts and k = 3, 2, 1, 0; padding rows are NaN
    # and padding draft ids out of range, and must not matter.
    n = ROUNDS_PER_CALL
    gen = torch.Generator().manual_seed(7)
    kinds = [(True, 3), (False, 2), (True, 1), (False, 0)]
    group = torch.arange(n) % len(kinds)
    draft_dist = {True: SOFT_Q, False: OTHER_Q}
    sampled = torch.tensor([kinds[g][0] for g in group.tolist()])
    num_drafts = torch.tensor([kinds[g][1] for g in group.tolist()])
    draft_probs = [SOFT_Q if s else None for s in sampled.tolist()]
    target = TARGET.expand(n, K + 1, V).clone()
    target[torch.arange(K + 1) > num_drafts[:, None]] = float("nan")
    tokens, accepted = [], []
    for _ in range(CALLS):
        drafts = torch.where(sampled[:, None], draw_drafts(SOFT_Q, n, gen), draw_drafts(OTHER_Q, n, gen))
        drafts = drafts.masked_fill(torch.arange(K) >= num_drafts[:, None], V + 7)
        accept_u = torch.rand(n, K, generator=gen, dtype=torch.float64)
        draw_u = torch.rand(n, generator=gen, dtype=torch.float64)
        greedy = [False] * n
        result = verify_chain_from_uniforms(target, drafts, draft_probs, num_drafts, accept_u, draw_u, greedy)
        tokens.append(result.tokens)
        accepted.append(result.num_accepted)
    tokens, accepted = torch.cat(tokens), torch.cat(accepted)
    group = group.repeat(CALLS)
    checks = []
    for g, (is_sampled, k) in enumerate(kinds):
        rows = group == g
        assert (tokens[rows, k + 1 :] == -1).all()
        for c in lossless_checks(tokens[rows], accepted[rows], TARGET, draft_dist[is_sampled], is_sampled, k):
            c.name = f"k={k} {'sampled' if is_sampled else 'deterministic'}: {c.name}"
            checks.append(c)
    assert all(c.passed for c in checks), report(checks)


def test_draws_over_a_large_vocabulary_follow_the_target():
    # V = 3000 spans two full blocks of the two-level draw and a short last one; the mass sits on
    # block edges plus a sparse tail, and every other id has zero mass (chi-square flags any hit).
    vocab, n = 3000, 5_000
    gen = torch.Generator().manual_seed(3)
    p = torch.zeros(vocab)
    p[100:2900:7] = 0.2 / len(range(100, 2900, 7))
    p[[1, 1023, 1024, 2047, 2048, 2999]] = 0.8 * torch.softmax(torch.randn(6, generator=gen), 0)
    tokens = []
    for _ in range(4):  # 20k draws: each tail token expects 10
        draw_u = torch.rand(n, generator=gen, dtype=torch.float64)
        result = verify_chain_from_uniforms(
            p.expand(n, 1, vocab), torch.empty(n, 0, dtype=torch.long), [None] * n, [0] * n,
            torch.empty(n, 0, dtype=torch.float64), draw_u, [False] * n,
        )
        tokens.append(result.tokens[:, 0])
    check = fit("large vocabulary", torch.cat(tokens), p)
    assert check.passed, report([check])


# Negative controls: verifiers with bugs that have shipped elsewhere (docs/algorithms.md sections 1, 7).


def soft_q_for_argmax_draft(target, drafts, draft_probs, *rest):
    """Grades an argmax draft with the draft model's soft probabilities instead of a one-hot q."""
    return verify_chain_from_uniforms(target, drafts, SOFT_Q.expand(len(drafts), K, V), *rest)


def unclamped_residual(*args):
    """Recovers from |p - q| instead of max(0, p - q): mass where the drafter over-proposed leaks in."""
    with mock.patch.object(chain, "_residual_", lambda p, q: p.sub_(q).abs_()):
        return verify_chain_from_uniforms(*args)


def bonus_from_last_draft_row(target, *rest):
    """Draws the bonus token from p_K (off by one) instead of p_{K+1}."""
    return verify_chain_from_uniforms(torch.cat([target[:, :K], target[:, K - 1 : K]], 1), *rest)


SCENARIO = {s.name: s for s in SCENARIOS}


@pytest.mark.parametrize(
    "broken, scenario, failing_check",
    [
        (soft_q_for_argmax_draft, "argmax", "position 1 ~ p_1"),
        (unclamped_residual, "sampled", "position 1 ~ p_1"),
        (bonus_from_last_draft_row, "sampled", f"position {K + 1} ~ p_{K + 1}"),
    ],
    ids=lambda x: getattr(x, "__name__", None),
)
def test_negative_controls_are_rejected(broken, scenario, failing_check):
    scen = SCENARIO[scenario]
    tokens, num_accepted = simulate(broken, scen, seed=100)
    checks = lossless_checks(tokens, num_accepted, scen.target, scen.draft_dist, scen.sampled)
    checks = {c.name: c for c in checks}
    assert checks[failing_check].chi.p_value < ALPHA, report(list(checks.values()))


# The statistics themselves.


def test_chi_square_matches_scipy_and_the_torch_fallback():
    stats = pytest.importorskip("scipy.stats")
    counts = torch.tensor([62.0, 49, 41, 18, 19, 11], dtype=torch.float64)
    probs = torch.tensor([0.3, 0.25, 0.2, 0.1, 0.1, 0.05], dtype=torch.float64)
    result = chi_square_test(counts, probs)
    reference = stats.chisquare(counts.numpy(), (probs * counts.sum()).numpy())
    assert result.dof == 5
    assert math.isclose(result.statistic, reference.statistic, rel_tol=1e-9)
    assert math.isclose(result.p_value, reference.pvalue, rel_tol=1e-9)
    with mock.patch.dict("sys.modules", {"scipy": None, "scipy.stats": None}):
        for x, dof in [(3.2, 1), (25.0, 7), (80.0, 20), (0.5, 11)]:
            assert math.isclose(chi2_sf(x, dof), stats.chi2.sf(x, dof), rel_tol=1e-8)


def test_chi_square_pools_rare_bins_and_flags_impossible_ones():
    # Expected counts 50, 40, 4, 3, 3 -> the three rare bins pool into one of 10: dof 2.
    probs = torch.tensor([0.5, 0.4, 0.04, 0.03, 0.03])
    assert chi_square_test(torch.tensor([50.0, 40, 4, 3, 3]), probs).dof == 2
    # Expected 94, 4, 2: the pool (6) is large enough alone; 97, 2, 1 -> pool of 3 joins bin 0.
    assert chi_square_test(torch.tensor([94.0, 4, 2]), torch.tensor([0.94, 0.04, 0.02])).dof == 1
    pooled_away = chi_square_test(torch.tensor([97.0, 2, 1]), torch.tensor([0.97, 0.02, 0.01]))
    assert pooled_away == ChiSquare(0.0, 1.0, 0)
    impossible = chi_square_test(torch.tensor([10.0, 10, 1]), torch.tensor([0.5, 0.5, 0.0]))
    assert impossible.p_value == 0.0 and impossible.statistic == math.inf


def test_tv_bound_covers_sampling_noise():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(noise(1, seed=11, scale=1.5)[0], -1)
    n = 2000
    bound = tv_bound(n, V, confidence=0.999)
    tvs = []
    for _ in range(200):
        counts = torch.bincount(torch.multinomial(probs, n, True, generator=gen), minlength=V)
        tvs.append(total_variation(counts, probs))
    assert max(tvs) <= bound
    assert bound < 4 * sum(tvs) / len(tvs)  # and it is not vacuous
    assert tv_bound(4 * n, V) < tv_bound(n, V)
