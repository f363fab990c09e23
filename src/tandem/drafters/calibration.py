"""Per-request online correction of a head's confidences (dflash, dspark).

A head's confidences are calibrated on held-out answers like its training ones; on other text
they can run high (the shipped SmolLM2 dspark head gives the first token about 0.55 on
Spec-Bench, where 0.31 of them pass). So the drafter reports every confidence as
sigmoid(logit(c) + d_r), with one logit offset d_r per request, fitted online to the request's
own graded positions: after each round, every graded position j of the verified prefix moves d_r
by OFFSET_RATE (outcome - corrected c_j), outcome 1 if it passed (a logistic-regression step). A
new request starts from the server-wide offset, which takes each step at GLOBAL_RATE of its size.

d_r is a function of past rounds only, so a corrected confidence is still fixed before its token
is drawn (docs/algorithms.md section 6), and the map is monotone and the same for every position
of a request: survivals stay non-increasing.
"""

from __future__ import annotations

import math

OFFSET_RATE = 0.3
GLOBAL_RATE = 0.05
MAX_OFFSET = 4.0


class OnlineCalibration:
    """The offsets d_r, and the corrected confidences of each request's latest draft."""

    def __init__(self) -> None:
        self.offset: dict[str, float] = {}
        self.global_offset = 0.0
        self.reported: dict[str, list[float]] = {}  # each request's latest corrected confidences

    def correct(self, request_id: str, confidences: list[float]) -> list[float]:
        """The confidences of a draft for request_id, corrected by its offset (kept until graded)."""
        d = self.offset.get(request_id, self.global_offset)
        corrected = [shifted(c, d) for c in confidences]
        self.reported[request_id] = corrected
        return corrected

    def not_drafted(self, request_id: str) -> None:
        """The request's latest draft is not the head's (a lookup draft): nothing to grade."""
        self.reported.pop(request_id, None)

    def observe(self, request_id: str, verified: int, accepted: int) -> None:
        """The first `verified` tokens of the request's latest draft were graded, the first
        `accepted` passed: position j was graded when every earlier one passed."""
        reported = self.reported.pop(request_id, [])
        if not reported or not verified:
            return
        start = d = self.offset.get(request_id, self.global_offset)
        for j, c in enumerate(reported[: min(verified, accepted + 1)]):
            step = OFFSET_RATE * ((1.0 if j < accepted else 0.0) - shifted(c, d - start))
            d += step
            self.global_offset = clamp(self.global_offset + GLOBAL_RATE * step, MAX_OFFSET)
        self.offset[request_id] = clamp(d, MAX_OFFSET)

    def release(self, request_id: str) -> None:
        self.offset.pop(request_id, None)
        self.reported.pop(request_id, None)


def clamp(x: float, bound: float) -> float:
    return max(-bound, min(bound, x))


def shifted(c: float, offset: float) -> float:
    """sigmoid(logit(c) + offset): a confidence moved by a logit offset (0 and 1 stay put)."""
    if offset == 0.0 or c <= 0.0 or c >= 1.0:
        return c
    return 1.0 / (1.0 + (1.0 - c) / c * math.exp(-offset))
