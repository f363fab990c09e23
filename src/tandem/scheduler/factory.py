"""The speculation policy a SpecConfig names."""

from __future__ import annotations

from typing import Callable, Sequence

from tandem.config import SpecConfig
from tandem.scheduler.confidence import ConfidenceScheduler
from tandem.scheduler.cost_model import CostCurve
from tandem.scheduler.policy import AdaptivePolicy, FixedPolicy, SpeculationPolicy, padded_rows


def create_policy(spec: SpecConfig, curve: CostCurve | None = None, per_round_drafts: bool = False,
                  verify_rows: Callable[[Sequence[int]], int] = padded_rows,
                  sources: Sequence[str] = ("",)) -> SpeculationPolicy:
    """The policy spec.policy names (SpecConfig has validated the name); per_round_drafts: the
    drafter's cost is per round (Drafter.cost_per_round), which the adaptive policy prices;
    verify_rows: the rows a verification forward computes for given per-request lengths
    (ModelRunner.verify_rows), which the adaptive policy and the confidence scheduler price;
    sources: the drafter's source names (Drafter.source_names), which the scheduler bounds by."""
    if spec.policy == "fixed":
        return FixedPolicy(spec, curve)
    if spec.policy == "confidence":
        return ConfidenceScheduler(spec, curve, verify_rows, sources=sources)
    return AdaptivePolicy(spec, curve, per_round_drafts=per_round_drafts, verify_rows=verify_rows)
