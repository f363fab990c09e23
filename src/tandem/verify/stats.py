"""Goodness-of-fit statistics: do sampled tokens follow a known distribution?

Shared by the verifier's distribution tests and `tandem audit`: a chi-square test with rare bins
pooled, the total variation of an empirical distribution, and the largest total variation that
sampling noise alone explains. scipy is optional (a test extra); without it torch computes the tail.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch


class ChiSquare(NamedTuple):
    statistic: float
    p_value: float
    dof: int


def chi_square_test(
    observed_counts: torch.Tensor | Sequence[float],
    expected_probs: torch.Tensor | Sequence[float],
    min_expected: float = 5.0,
) -> ChiSquare:
    """Pearson's chi-square test of counts [V] against probabilities [V] (normalised here).

    Bins expected to hold fewer than `min_expected` observations are pooled into one bin, since
    the chi-square approximation needs about 5 per bin; if the pool itself stays below that it
    joins the smallest regular bin. Any observation in a zero-probability bin is impossible under
    the hypothesis: statistic inf, p-value 0.
    """
    counts, probs = _as_pair(observed_counts, expected_probs)
    total = float(counts.sum())
    if total <= 0:
        raise ValueError("chi_square_test needs at least one observation")
    impossible = bool(((probs == 0) & (counts > 0)).any())
    support = probs > 0
    counts, expected = counts[support], total * probs[support] / probs.sum()
    rare = expected < min_expected
    if bool(rare.any()):
        counts = torch.cat([counts[~rare], counts[rare].sum()[None]])
        expected = torch.cat([expected[~rare], expected[rare].sum()[None]])
        if expected[-1] < min_expected and len(expected) > 1:
            smallest = int(expected[:-1].argmin())
            counts[smallest] += counts[-1]
            expected[smallest] += expected[-1]
            counts, expected = counts[:-1], expected[:-1]
    dof = len(expected) - 1
    if impossible:
        return ChiSquare(math.inf, 0.0, dof)
    if dof == 0:
        return ChiSquare(0.0, 1.0, 0)
    statistic = float(((counts - expected) ** 2 / expected).sum())
    return ChiSquare(statistic, chi2_sf(statistic, dof), dof)


def chi2_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X ~ chi-square(dof): scipy when installed, else torch.

    The survival function of chi-square(dof) at x is the regularised upper incomplete gamma
    function Q(dof / 2, x / 2), which torch.special.gammaincc computes.
    """
    try:
        from scipy.stats import chi2  # lazy: scipy is slow to import and only the audit's checks use it
    except ImportError:
        a = torch.tensor(dof / 2, dtype=torch.float64)
        return float(torch.special.gammaincc(a, torch.tensor(statistic / 2, dtype=torch.float64)))
    return float(chi2.sf(statistic, dof))


def total_variation(counts: torch.Tensor | Sequence[float], probs: torch.Tensor | Sequence[float]) -> float:
    """TV distance between the empirical distribution of counts [V] and probs [V] (normalised here)."""
    counts, probs = _as_pair(counts, probs)
    return 0.5 * float((counts / counts.sum() - probs / probs.sum()).abs().sum())


def tv_bound(num_samples: int, support: int, confidence: float = 0.9999) -> float:
    """A TV distance that n exact samples exceed with probability at most 1 - confidence.

    Let P_n be the empirical distribution of n i.i.d. draws from P on m = `support` outcomes and
    delta = 1 - confidence; TV(P_n, P) = max over the 2^m events A of P_n(A) - P(A). Two bounds hold
    with probability >= 1 - delta each; the smaller is returned (it is one of them, so it holds too):
    1. Hoeffding for each event, P(P_n(A) - P(A) >= t) <= exp(-2 n t^2), and a union over the 2^m
       events: t = sqrt((m ln 2 + ln(1/delta)) / (2 n)).
    2. The mean, E TV = 1/2 sum_j E|P_n(j) - P(j)| <= 1/2 sum_j sqrt(P(j)(1 - P(j)) / n)
       <= 1/2 sqrt((m - 1) / n) (Jensen, then Cauchy-Schwarz with sum_j P(j)^2 >= 1/m), plus
       McDiarmid (one draw moves TV by at most 1/n): t = 1/2 sqrt((m - 1) / n) + sqrt(ln(1/delta) / (2 n)).
    The first is tighter for small supports, the second for large ones.
    """
    if num_samples < 1 or support < 1:
        raise ValueError(f"tv_bound needs num_samples >= 1 and support >= 1, got {num_samples}, {support}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    log_inv_delta = -math.log1p(-confidence)
    union = math.sqrt((support * math.log(2) + log_inv_delta) / (2 * num_samples))
    mcdiarmid = 0.5 * math.sqrt((support - 1) / num_samples) + math.sqrt(log_inv_delta / (2 * num_samples))
    return min(union, mcdiarmid)


def _as_pair(counts, probs) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.as_tensor(counts, dtype=torch.float64).flatten().cpu()
    probs = torch.as_tensor(probs, dtype=torch.float64).flatten().cpu()
    if counts.shape != probs.shape:
        raise ValueError(f"counts and probabilities differ in length: {len(counts)} vs {len(probs)}")
    if bool((counts < 0).any()) or bool((probs < 0).any()) or not float(probs.sum()) > 0:
        raise ValueError("counts must be >= 0 and probabilities >= 0 with positive total mass")
    return counts, probs
