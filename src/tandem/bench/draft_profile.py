"""What `tandem bench spec` records around a drafter in one run: per draft position how often it
was reachable and passed, the drafter's time, and for drafters that report confidences how well
their survivals predicted what passed (the calibration error)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

CALIBRATION_BINS = 10


@dataclass
class DraftProfile:
    """Draft accounting taken around the drafter: per draft position, how often the position was
    reachable (the budget allowed it and every earlier draft token passed) and how often a draft
    token there passed; plus the time spent proposing and the positions asked for."""

    rounds: int = 0
    requested: int = 0
    seconds: float = 0.0
    reached: list[int] = field(default_factory=list)
    passed: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # lengths[n] = rounds that drafted n tokens
    # Drafters that report confidences: per bin of predicted survival (prod of the confidences up
    # to a verified position), [positions, sum of survivals, how many of them passed with every
    # earlier one].
    calibration: list[list[float]] = field(default_factory=list)

    def record(self, budget: int, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.requested += budget
        _grow(self.lengths, min(drafted, budget) + 1)
        self.lengths[min(drafted, budget)] += 1
        # Worked example: budget 4, accepted 2 -> positions 0, 1, 2 were reachable, 0 and 1 passed.
        reachable = min(budget, accepted + 1)
        _grow(self.reached, budget)
        _grow(self.passed, budget)
        for i in range(reachable):
            self.reached[i] += 1
        for i in range(min(accepted, budget)):
            self.passed[i] += 1

    def record_survival(self, survivals: list[float], verified: int, accepted: int) -> None:
        """A draft's survivals a_j at the positions that were verified, and whether each passed."""
        if not self.calibration:
            self.calibration = [[0, 0.0, 0] for _ in range(CALIBRATION_BINS)]
        for j, a in enumerate(survivals[:verified]):
            cell = self.calibration[min(int(a * CALIBRATION_BINS), CALIBRATION_BINS - 1)]
            cell[0] += 1
            cell[1] += a
            cell[2] += int(j < accepted)

    @property
    def calibration_error(self) -> float | None:
        """Expected calibration error of the survivals: sum over bins of (share of positions) x
        |mean survival - share that passed|; None without confidences."""
        total = sum(c[0] for c in self.calibration)
        if not total:
            return None
        return sum(c[0] / total * abs(c[1] / c[0] - c[2] / c[0]) for c in self.calibration if c[0])

    def merge(self, other: "DraftProfile") -> None:
        self.rounds += other.rounds
        self.requested += other.requested
        self.seconds += other.seconds
        if other.calibration:
            if not self.calibration:
                self.calibration = [[0, 0.0, 0] for _ in range(CALIBRATION_BINS)]
            for mine, theirs in zip(self.calibration, other.calibration):
                for i in range(3):
                    mine[i] += theirs[i]
        for mine, theirs in ((self.reached, other.reached), (self.passed, other.passed), (self.lengths, other.lengths)):
            _grow(mine, len(theirs))
            for i, v in enumerate(theirs):
                mine[i] += v

    def acceptance(self, k: int | None = None) -> list[float]:
        """drafted_acceptance per position, padded with 0 to k (a position never reached has no
        evidence that the drafter ever gets there)."""
        k = len(self.reached) if k is None else k
        return [self.passed[i] / self.reached[i] if i < len(self.reached) and self.reached[i] else 0.0
                for i in range(k)]

    @property
    def seconds_per_position(self) -> float:
        """Drafter time per requested draft position (the draft cost model is linear in k)."""
        return self.seconds / self.requested if self.requested else 0.0

    @classmethod
    def from_dict(cls, d: dict) -> "DraftProfile":
        """The counters back from `as_dict`."""
        return cls(rounds=d["rounds"], requested=d["requested_positions"], seconds=d["seconds"],
                   reached=list(d["reached_per_position"]), passed=list(d["passed_per_position"]),
                   lengths=list(d["drafted_lengths"]), calibration=[list(c) for c in d.get("calibration", [])])

    def as_dict(self) -> dict:
        out = {"rounds": self.rounds, "requested_positions": self.requested, "seconds": round(self.seconds, 4),
               "reached_per_position": list(self.reached), "passed_per_position": list(self.passed),
               "drafted_lengths": list(self.lengths),
               "drafted_acceptance": [round(a, 4) for a in self.acceptance()]}
        if self.calibration:
            out["calibration"] = [[c[0], round(c[1], 4), c[2]] for c in self.calibration]
            out["calibration_error"] = round(self.calibration_error, 4)
        return out


def _grow(counts: list[int], n: int) -> None:
    if len(counts) < n:
        counts.extend([0] * (n - len(counts)))


class ProbedDrafter:
    """Stands in for the engine's drafter: times `propose` and pairs each request's draft budget
    with the accepted count `observe` reports, into the current DraftProfile."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self._budgets: dict[str, int] = {}
        self._survivals: dict[str, list[float]] = {}
        self.profile = DraftProfile()

    def propose(self, batch):
        t = time.perf_counter()
        drafts = self._inner.propose(batch)
        self.profile.seconds += time.perf_counter() - t
        for inp, draft in zip(batch, drafts):
            self._budgets[inp.request_id] = inp.max_draft_tokens
            if draft.confidence is not None and not draft.is_tree:
                self._survivals[inp.request_id] = draft.survival()
        return drafts

    def observe(self, outcomes) -> None:
        for o in outcomes:
            budget = self._budgets.pop(o.request_id, 0)
            if budget:
                self.profile.record(budget, o.num_drafted, o.num_accepted)
            survivals = self._survivals.pop(o.request_id, None)
            if survivals is not None:
                self.profile.record_survival(survivals, o.num_drafted, o.num_accepted)
        self._inner.observe(outcomes)

    def __getattr__(self, name):
        return getattr(self._inner, name)
