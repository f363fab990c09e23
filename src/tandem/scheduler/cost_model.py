"""When speculation pays: expected acceptance length, forward cost curves and the best draft length.

Pure Python math shared by the serving policy (per step) and the advisor (offline). A draft of k
tokens costs one target forward over k + 1 tokens per request; with B requests in the batch the
target runs B * (k + 1) tokens where plain decoding runs B. Speculation pays when the tokens it
commits per forward (tau) outgrow that cost ratio:

    speedup(k, B) = tau(k) * cost(B) / (cost(B * (k + 1)) + draft_cost(k))
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Sequence


def expected_tau(acceptance: Sequence[float], k: int) -> float:
    """Tokens committed per target forward with k draft tokens, from the conditional acceptance
    per position (acceptance[i] = P(token i passes | tokens before it passed)); positions past the
    profile reuse its last value. Includes the recovered/bonus token, so tau >= 1."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    tau, reach = 1.0, 1.0
    for i in range(k):
        a = acceptance[min(i, len(acceptance) - 1)] if acceptance else 0.0
        reach *= a
        tau += reach
    return tau


def expected_tau_uniform(alpha: float, k: int) -> float:
    """The same with one acceptance rate alpha at every position: (1 - alpha^(k+1)) / (1 - alpha)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class CostCurve:
    """Measured seconds of one target forward over n new tokens, interpolated linearly between
    measured sizes and extrapolated with the slope of the last two beyond them.

    The sizes are measured at one prefix (`context` tokens). Attention makes a forward's cost
    grow with the prefix its rows read: a sequence verifying n rows over a prefix of L keys costs
    about (L - context) * (per_key + per_key_row * n) more (`context_seconds`). per_key is reading
    its cached keys and values once, shared by its rows; per_key_row is each row's dot products.
    On SmolLM2 (avx512, fp16 cache, Zen 5) a forward over 5 new tokens costs 1.25x one token at a
    64-token prefix and 1.61x at 800, and three profiles fitted 0.13-0.42 and 0.27-0.33 us.
    Zero (the default) prices every prefix like the measured one.
    """

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    context: int = 0
    per_key: float = 0.0
    per_key_row: float = 0.0

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.seconds) or not self.sizes:
            raise ValueError("a cost curve needs one time per size and at least one point")
        if list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError(f"sizes must be distinct, increasing and >= 1, got {self.sizes}")
        if any(not (math.isfinite(s) and s > 0) for s in self.seconds):
            raise ValueError(f"times must be positive, got {self.seconds}")
        if self.context < 0 or not (self.per_key >= 0 and self.per_key_row >= 0):
            raise ValueError(f"context {self.context} and per-key costs {self.per_key}, {self.per_key_row} "
                             "must be >= 0")

    @classmethod
    def from_points(cls, points: dict[int, float]) -> "CostCurve":
        sizes = tuple(sorted(int(n) for n in points))
        return cls(sizes, tuple(float(points[n]) for n in sizes))

    def as_points(self) -> dict[int, float]:
        return dict(zip(self.sizes, self.seconds))

    def monotone(self) -> "CostCurve":
        """A forward over more tokens never costs less: a size measured slower than a larger one
        was slowed by other load (on a shared CPU load only adds time), so it takes the larger
        size's time, a running minimum from the right. Worked example: 1: 4.7, 2: 0.34, 4: 0.46
        -> 1: 0.34, 2: 0.34, 4: 0.46. The serving profile and the advisor both use this rule."""
        seconds, low = [], float("inf")
        for s in reversed(self.seconds):
            low = min(low, s)
            seconds.append(low)
        return dataclasses.replace(self, seconds=tuple(reversed(seconds)))

    def convex(self) -> "CostCurve":
        """The curve whose cost per added row never falls as rows are added: its slopes between
        measured sizes replaced by their closest non-decreasing sequence (least squares, each
        weighted by the rows it spans: pool-adjacent-violators), from the same first time. A
        forward costs the weights' read, flat, until its rows' arithmetic takes over, and from
        there a row costs about the same: a convex curve. Measured points are not: one size read
        fast makes the sizes below it flat after `monotone` (12 and 16 rows at 25.8 ms on the
        Ice Lake Xeon, where a row costs 1.6 ms), and a scheduler pricing rows by the curve's
        differences then takes those rows for free. The first and last times stay; worked
        example: 1: 10, 2: 10, 4: 14, 8: 14, 16: 30 -> slopes per row 0, 2, 0, 2 -> 0, 2/3, 2/3,
        2 -> 1: 10, 2: 10, 4: 11.33, 8: 14, 16: 30 (the pooled span keeps its rise: 4 over 6 rows)."""
        points = list(zip(self.sizes, self.seconds))
        slopes = [(tb - ta) / (b - a) for (a, ta), (b, tb) in zip(points, points[1:])]
        if all(x <= y + 1e-9 * abs(y) + 1e-15 for x, y in zip(slopes, slopes[1:])):
            return self  # already convex (to rounding): the very same times
        widths = [b - a for a, b in zip(self.sizes, self.sizes[1:])]
        pools: list[tuple[float, int, int]] = []  # (slope, rows spanned, measured spans pooled)
        for slope, width in zip(slopes, widths):
            pools.append((slope, width, 1))
            while len(pools) > 1 and pools[-2][0] > pools[-1][0]:
                (s2, w2, n2), (s1, w1, n1) = pools.pop(), pools.pop()
                pools.append(((s1 * w1 + s2 * w2) / (w1 + w2), w1 + w2, n1 + n2))
        pooled = [slope for slope, _, spans in pools for _ in range(spans)]  # each measured span's
        seconds, t = [self.seconds[0]], self.seconds[0]
        for slope, width in zip(pooled, widths):
            t += slope * width
            seconds.append(t)
        return dataclasses.replace(self, seconds=tuple(seconds))

    def context_seconds(self, lengths: Sequence[int], contexts: Sequence[int] | None) -> float:
        """What a forward costs beyond curve(rows) because its sequences' prefixes differ from
        the measured one: lengths[i] rows of sequence i over a prefix of contexts[i] keys
        (negative where the prefixes are shorter). None: the measured prefix."""
        if contexts is None:
            return 0.0
        return sum((c - self.context) * (self.per_key + self.per_key_row * n) for n, c in zip(lengths, contexts))

    def __call__(self, n: int) -> float:
        if n < 1:
            raise ValueError(f"a forward covers >= 1 token, got {n}")
        xs, ys = self.sizes, self.seconds
        if len(xs) == 1:
            return ys[0] * n / xs[0] if n > xs[0] else ys[0]
        if n <= xs[0]:
            return ys[0]
        i = bisect.bisect_left(xs, n)
        if i < len(xs) and xs[i] == n:
            return ys[i]
        lo, hi = (i - 1, i) if i < len(xs) else (len(xs) - 2, len(xs) - 1)
        slope = (ys[hi] - ys[lo]) / (xs[hi] - xs[lo])
        return max(ys[lo] + slope * (n - xs[lo]), ys[0])


def fit_context_costs(short: dict[int, float], long: dict[int, float], extra_keys: int) -> tuple[float, float]:
    """(per_key, per_key_row) of CostCurve from one sequence's forwards over n rows at two
    prefixes `extra_keys` apart: the least-squares line through (n, (long[n] - short[n]) /
    extra_keys), each coefficient at least 0 (noise can tilt a flat line below it).
    Worked example: 1 row 2.55 -> 2.99 ms and 8 rows 4.61 -> 6.41 ms over 900 more keys give
    0.49 and 2.0 us per key: 0.27 us per key plus 0.22 per key and row."""
    sizes = sorted(set(short) & set(long))
    if extra_keys <= 0 or not sizes:
        raise ValueError("fitting the context's cost needs forwards of the same sizes at two prefixes")
    slopes = [(long[n] - short[n]) / extra_keys for n in sizes]
    if len(sizes) == 1:
        return max(slopes[0], 0.0), 0.0
    mean_n, mean_s = sum(sizes) / len(sizes), sum(slopes) / len(slopes)
    per_row = sum((n - mean_n) * (s - mean_s) for n, s in zip(sizes, slopes)) / sum((n - mean_n) ** 2 for n in sizes)
    per_row = max(per_row, 0.0)
    return max(mean_s - per_row * mean_n, 0.0), per_row


DraftCost = Callable[[int, int], float]
"""(k, batch) -> seconds the drafter spends proposing k tokens for each of `batch` requests."""


def no_draft_cost(k: int, batch: int) -> float:
    return 0.0


def speedup(tau: float, k: int, batch: int, curve: CostCurve, draft_cost: DraftCost = no_draft_cost) -> float:
    """Tokens/s with k draft tokens per request over tokens/s of plain decoding, at this batch."""
    if k == 0:
        return 1.0
    return tau * curve(batch) / (curve(batch * (k + 1)) + draft_cost(k, batch))


def best_k(
    acceptance: Sequence[float],
    curve: CostCurve,
    batch: int = 1,
    k_max: int = 8,
    draft_cost: DraftCost = no_draft_cost,
) -> tuple[int, float]:
    """(k, predicted speedup) maximising speedup for k in 0..k_max; k = 0 (speedup 1) when no
    draft length beats plain decoding."""
    best = (0, 1.0)
    for k in range(1, k_max + 1):
        s = speedup(expected_tau(acceptance, k), k, batch, curve, draft_cost)
        if s > best[1]:
            best = (k, s)
    return best


def break_even_batch(
    acceptance: Sequence[float],
    curve: CostCurve,
    k_max: int = 8,
    max_batch: int = 256,
    draft_cost: DraftCost = no_draft_cost,
) -> int | None:
    """The smallest batch at which no draft length beats plain decoding (None: it pays up to max_batch)."""
    for batch in range(1, max_batch + 1):
        if best_k(acceptance, curve, batch, k_max, draft_cost)[0] == 0:
            return batch
    return None
