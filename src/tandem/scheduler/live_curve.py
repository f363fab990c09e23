"""The target's cost curve as the running server finds it: the profile corrected by measured rounds."""

from __future__ import annotations

import bisect

from tandem.scheduler.cost_model import CostCurve

# Rounds of one size before its measured shape replaces the interpolated one (LiveCurve), the
# weight of the newest round in a size's shape, and in the level every round moves.
MIN_MEASURED = 5
SHAPE_EMA = 0.05
LEVEL_EMA = 0.5


class LiveCurve:
    """The profiled cost curve corrected by what rounds really cost in this process: the profile
    times a level times a shape.

    - level: how much slower (or faster) than the profile the machine runs now, a fast moving
      average over every round whatever its size. Other tenants of a shared CPU come and go, and
      their load slows every size alike.
    - shape[n]: how far size n is from the profile once the level is taken out, a slow moving
      average per size. A size measured fewer than MIN_MEASURED times takes the shape
      interpolated linearly between the nearest measured sizes (constant beyond them), 1 before
      any.

    So a busy spell moves the level, not the shape: a size last measured during one is not
    priced high for good after the load has gone (per-size averages alone did that, and the
    policies then stopped drafting for whole requests). A shape the profile got wrong is still
    learnt around the sizes the server runs. Worked example: profile 10 ms flat, rounds taking
    10 ms at n=1 and 70 ms at n=7 -> shapes 1 : 7, and n=4 costs 4x n=1.

    Times are kept at the profile's prefix: what a round's longer (or shorter) prefixes added is
    taken off as it is observed, and the policy adds its own batch's (PricedPolicy.seconds).
    """

    def __init__(self, profile: CostCurve) -> None:
        self.profile = profile
        self.level = 1.0
        self.shape: dict[int, float] = {}
        self.count: dict[int, int] = {}
        self._trusted: list[int] = []  # sorted sizes with >= MIN_MEASURED rounds

    def observe(self, tokens: int, seconds: float, context_seconds: float = 0.0) -> None:
        """A round over `tokens` rows took `seconds`, of which `context_seconds` came from its
        prefixes being longer than the profile's (CostCurve.context_seconds): the rest is kept,
        at least half the profile's time for the size (a prefix priced too high must not drive
        a size's time to nothing)."""
        if tokens < 1 or not seconds > 0:
            return
        seconds = max(seconds - context_seconds, 0.5 * self.profile(tokens))
        ratio = seconds / self.profile(tokens)
        mine = self.shape.get(tokens) or self._shape(tokens)
        self.level += LEVEL_EMA * (ratio / mine - self.level)
        n = self.count.get(tokens, 0)
        # The first round sets the size's shape; later ones move it slowly (the level moves fast).
        weight = SHAPE_EMA if n else 1.0
        self.shape[tokens] = mine + weight * (ratio / self.level - mine)
        self.count[tokens] = n + 1
        if n + 1 == MIN_MEASURED:
            bisect.insort(self._trusted, tokens)

    def _shape(self, tokens: int) -> float:
        if self.count.get(tokens, 0) >= MIN_MEASURED:
            return self.shape[tokens]
        t = self._trusted
        if not t:
            return 1.0
        i = bisect.bisect_left(t, tokens)
        lo, hi = t[max(0, i - 1)], t[min(i, len(t) - 1)]
        if lo == hi:  # below the smallest or above the largest measured size
            return self.shape[lo]
        return self.shape[lo] + (self.shape[hi] - self.shape[lo]) * (tokens - lo) / (hi - lo)

    def __call__(self, tokens: int) -> float:
        return self.profile(tokens) * self.level * self._shape(tokens)
