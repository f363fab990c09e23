"""The drafting side of an engine round: what the speculation policy lets each running request
draft before anything is drafted, the drafter's drafts, what the policy admits of them, and what
drafting cost; and how well the drafter does, for the engine's periodic log."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Sequence

from tandem.config import EngineConfig
from tandem.drafters import Drafter, DraftInput, TargetInfo, create_drafter
from tandem.engine.request import Request
from tandem.model.kv_cache import KVCache
from tandem.model.loader import LoadedModel
from tandem.scheduler.cost_model import CostCurve
from tandem.scheduler.factory import create_policy
from tandem.scheduler.policy import DraftSlot, SpeculationPolicy
from tandem.types import Draft, SpecStats

log = logging.getLogger("tandem.engine")

POOR_DRAFTER_TAU = 2.0


class Drafting:
    """An engine's drafter and speculation policy, and the round's proposal step."""

    def __init__(self, drafter: Drafter, policy: SpeculationPolicy, config: EngineConfig, cache: KVCache) -> None:
        self.drafter = drafter  # bench/spec.py wraps it in a probe after the engine is built
        self.policy = policy
        self.config = config
        self.cache = cache

    @classmethod
    def create(cls, loaded: LoadedModel, config: EngineConfig, cost_curve: CostCurve | None,
               eos_ids: frozenset[int], verify_rows: Callable[[Sequence[int]], int], cache: KVCache) -> "Drafting":
        """The drafter config.spec names for `loaded`, and its policy, which prices verification
        on `cost_curve` at the rows the runner computes (`verify_rows`)."""
        target = TargetInfo.of(loaded, tuple(eos_ids), config.device)
        drafter = create_drafter(config.spec, target)
        if config.spec.policy == "confidence" and not drafter.reports_confidences:
            raise ValueError(
                f"the confidence scheduler prices drafts by the confidences their drafter reports, and "
                f"{config.spec.algorithm} reports none: use it with dflash, dspark or suffix, or choose "
                "--speculative-policy adaptive or fixed")
        policy = create_policy(config.spec, cost_curve, drafter.cost_per_round, verify_rows, drafter.source_names)
        return cls(drafter, policy, config, cache)

    def propose(self, batch: list[Request], contexts: list[int]) -> list[Draft]:
        """Each running request's draft for this round, as admitted (empty where it drafts
        nothing); contexts: each request's tokens before the round."""
        # The policy decides every length before anything is drafted (non-anticipation).
        slots = [DraftSlot(r.request_id, self.budget(r), context=c,
                           backlog=len(r.hidden) + self.drafter.waiting_rows(r.request_id))
                 for r, c in zip(batch, contexts)]
        worth = self.policy.worth_asking(slots)
        if not any(worth):  # nothing could pay: no drafter is asked anything
            self.policy.skip_round(slots)
            return [Draft.empty() for _ in batch]
        # A request whose draft could not pay even at its best is not asked anything either.
        slots = [s if w else dataclasses.replace(s, limit=0) for s, w in zip(slots, worth)]
        asking = time.perf_counter()
        sources = self._sources(batch, slots) if self.policy.prices_sources else None
        if sources is not None:
            slots = [dataclasses.replace(s, source=source) for s, source in zip(slots, sources)]
        budgets = self.policy.draft_lengths(slots)
        self.policy.observe_asking(time.perf_counter() - asking, len(batch))
        inputs, rows = [], []
        for i, (req, k) in enumerate(zip(batch, budgets)):
            if k > 0:
                rows.append(i)
                inputs.append(
                    DraftInput(req.request_id, req.context, len(req.prompt_ids), k, req.params,
                               req.generator_on(self.drafter.sampling_device), req.hidden.take())
                )
        drafts = [Draft.empty() for _ in batch]
        t0 = time.perf_counter()
        proposed = self.drafter.propose(inputs) if inputs else []
        pruned = [d.pruned(inp.max_draft_tokens, self.cache_room(batch[i])) for i, inp, d in zip(rows, inputs, proposed)]
        # What to verify of each draft: the same rules as the lengths, decided for the batch at once.
        drafting = set(rows)
        others = [c for i, c in enumerate(contexts) if i not in drafting]
        admitted = self.policy.admit([inp.request_id for inp in inputs], pruned, len(batch),
                                     [contexts[i] for i in rows] + others)
        for i, draft in zip(rows, admitted):
            drafts[i] = draft
        if inputs:
            self._learn_draft_time(time.perf_counter() - t0, [i for i in rows if sources is None or sources[i] != "lookup"],
                                   slots, drafts)
        return drafts

    def _learn_draft_time(self, seconds: float, drafted: list[int], slots: list[DraftSlot], drafts: list[Draft]) -> None:
        """The policy learns the drafting time of the requests a drafter drafted (a lookup's
        drafts cost none): per request for a drafter whose cost is per round, per draft token
        otherwise. A round in which some had more hidden rows to catch up on than one round
        commits (a request's first draft: its whole prompt, 15 ms for 300 tokens with dspark
        against 1 ms a round; a head's first draft after lookup rounds) is a one-off cost, which
        the policy learns apart (observe_catch_up)."""
        units = len(drafted) if self.drafter.cost_per_round else sum(drafts[i].depth for i in drafted)
        if not units:
            return
        most = self.config.spec.max_draft_len + 1
        if all(slots[i].backlog <= most for i in drafted):
            self.policy.observe_draft_time(seconds, units)
        else:
            self.policy.observe_catch_up(seconds, sum(slots[i].backlog for i in drafted), units)

    def _sources(self, batch: list[Request], slots: list[DraftSlot]) -> list[str] | None:
        """Which source each request's draft would come from this round (Drafter.draft_sources),
        asked before the policy decides; "" for requests that may not draft."""
        may = [i for i, s in enumerate(slots) if s.limit > 0]
        if not may:
            return None
        peeks = [DraftInput(batch[i].request_id, batch[i].context, len(batch[i].prompt_ids), slots[i].limit,
                            batch[i].params, batch[i].generator) for i in may]
        found = self.drafter.draft_sources(peeks)
        if found is None:
            return None
        sources = [""] * len(slots)
        for i, source in zip(may, found):
            sources[i] = source
        return sources

    def budget(self, req: Request) -> int:
        """The most draft tokens this request may use this round (the policy picks within it):
        the configured length or the request's own (params.max_draft_tokens), never past its
        max_tokens (the bonus token is free) or the cache's end."""
        remaining = req.params.max_tokens - len(req.output_ids) - 1
        longest = self.config.spec.max_draft_len
        if req.params.max_draft_tokens is not None:
            longest = min(longest, req.params.max_draft_tokens)
        return max(0, min(longest, remaining, self.cache_room(req)))

    def cache_room(self, req: Request) -> int:
        """How many draft tokens (tree nodes) fit in the cache after next_token."""
        return self.config.max_model_len - self.cache.lengths[req.seq] - 1

    def release(self, request_id: str) -> None:
        self.drafter.release(request_id)
        self.policy.release(request_id)

    def log_acceptance(self, stats: SpecStats) -> None:
        """The engine's periodic line on how its drafts fare, and a warning for a poor drafter."""
        algorithm = self.config.spec.algorithm
        log.info(
            "spec %s: acceptance rate %.2f, mean acceptance length (tau) %.2f over %d forwards; %d of them "
            "verified a draft (%.1f draft tokens on average, tau %.2f)",
            algorithm, stats.acceptance_rate, stats.mean_acceptance_length, stats.num_forwards, stats.num_drafts,
            stats.num_draft_tokens / stats.num_drafts, stats.drafted_tau,
        )
        if poor_drafter(stats):
            log.warning(
                "tau %.2f < %.1f in the rounds that verified %.1f draft tokens on average: the drafter %r is a poor "
                "match for this target; swap the drafter rather than raising the number of draft tokens",
                stats.drafted_tau, POOR_DRAFTER_TAU, stats.num_draft_tokens / stats.num_drafts, algorithm,
            )


def poor_drafter(stats: SpecStats) -> bool:
    """Whether the drafter itself holds tau under POOR_DRAFTER_TAU: judged on the rounds that
    verified a draft, once there are 20, and only where those drafts averaged at least two tokens.
    Rounds the policy drafted nothing in (a loaded server) say nothing of the drafter, and a draft
    the policy cut to one token cannot reach tau 2 however good it is."""
    if stats.num_drafts < 20 or stats.num_draft_tokens < 2 * stats.num_drafts:
        return False
    return stats.drafted_tau < POOR_DRAFTER_TAU
