"""The target's cost curve as the running server finds it: the profile corrected by measured rounds."""

from __future__ import annotations

import bisect

from tandem.scheduler.cost_model import CostCurve

# Rounds of one size before its measured shape replaces the interpolated one (LiveCurve), the
# weight of the newest round in a size's shape, and in the level every round moves.
MIN_MEASURED = 5
SHAPE_EMA = 0.05
LEVEL_EMA = 0.5
# From SHARED_SHAPE_FROM rows on (where a row is at most an eighth of a round), measured sizes
# within SHAPE_WINDOW of a size lend it their shapes (a weighted mean). Each size's shape is a
# noisy average of its own rounds, and a draft row is priced by the difference of two
# neighbouring sizes: at 15 and 16 rows (about 30 ms a round, 1.6 ms a row on the Ice Lake Xeon)
# a few percent of noise in each can make a row look nearly free.
SHARED_SHAPE_FROM = 8
SHAPE_WINDOW = 1.25


class LiveCurve:
    """The profiled cost curve corrected by what rounds really cost in this process: the profile
    times a level times a shape.

    - level: how much slower (or faster) than the profile the machine runs now, a fast moving
      average over every round whatever its size. Other tenants of a shared CPU come and go, and
      their load slows every size alike.
    - shape[n]: how far size n is from the profile once the level is taken out, a slow moving
      average per size. A size measured MIN_MEASURED times is priced at its own shape, and from
      SHARED_SHAPE_FROM rows on at the mean shape of the sizes so measured within SHAPE_WINDOW
      of it (weighted by the rounds each average holds, up to 1 / SHAPE_EMA), so that
      neighbouring sizes share one shape and the price of a row there is the profile's; a size
      with none that near takes the shape interpolated linearly between the nearest measured
      sizes (constant beyond them), 1 before any.

    A measured profile comes convex (scheduler/profile.py, CostCurve.convex): past its knee a
    row is never priced free.

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
        self._priced: dict[int, float] = {}  # size -> its shape as priced, until the next round

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
        self._priced.clear()

    def _shape(self, tokens: int) -> float:
        shape = self._priced.get(tokens)
        if shape is None:
            shape = self._priced[tokens] = self._window_shape(tokens)
        return shape

    def _window_shape(self, tokens: int) -> float:
        t = self._trusted
        if not t:
            return 1.0
        if tokens < SHARED_SHAPE_FROM:
            near = [tokens] if self.count.get(tokens, 0) >= MIN_MEASURED else []
        else:
            near = t[bisect.bisect_left(t, tokens / SHAPE_WINDOW) : bisect.bisect_right(t, tokens * SHAPE_WINDOW)]
        if near:
            weights = [min(self.count[size], 1.0 / SHAPE_EMA) for size in near]
            return sum(w * self.shape[size] for w, size in zip(weights, near)) / sum(weights)
        i = bisect.bisect_left(t, tokens)
        lo, hi = t[max(0, i - 1)], t[min(i, len(t) - 1)]
        if lo == hi:  # below the smallest or above the largest measured size
            return self.shape[lo]
        return self.shape[lo] + (self.shape[hi] - self.shape[lo]) * (tokens - lo) / (hi - lo)

    def __call__(self, tokens: int) -> float:
        return self.profile(tokens) * self.level * self._shape(tokens)
