"""The speculation policy: how many draft tokens each running request may use this round.

Decided before anything is drafted, from the batch size, the target's measured forward cost curve
and each request's acceptance in *earlier* rounds, never from the draft being decided about
(docs/algorithms.md section 5, non-anticipation): the verifier then stays lossless whatever k it picks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

from tandem.config import SpecConfig
from tandem.scheduler.cost_model import CostCurve
from tandem.scheduler.live_curve import LiveCurve
from tandem.types import Draft

# Acceptance a request is assumed to have before it has drafted anything (per position). It must
# predict a gain at batch 1 on a cheap-verification curve, or an idle policy would never draft
# and never learn; rounds that show otherwise pull the estimate down within a few rounds.
PRIOR_ACCEPTANCE = 0.6
# Weight of the newest outcome in a request's per-position moving average (about ten rounds of
# memory): acceptance moves with the text (a quoted passage drafts well, free prose badly), but a
# lookup's drafts pass or fail by the match behind each, and a three-round memory (0.3) read a run
# of short failed matches as a request not worth drafting: at one request the adaptive policy
# then verified 3% fewer tokens per unit of forward cost (docs/serving.md, "The speculation policy").
REQUEST_EMA = 0.1
# Weight of one round in the server-wide estimate new requests start from.
GLOBAL_EMA = 0.05
# Per round without a draft, a request's estimate relaxes this far toward the prior, so a request
# switched off for poor acceptance is retried after some tens of rounds rather than never; and
# the drafting time toward the fastest measured, so one slow measurement does not stop drafting
# for good.
RELAX = 0.03
# Draft only when the predicted throughput beats plain decoding by this margin: the cost curve is
# measured on a shared CPU, and being a little too cautious costs less than being slower.
MIN_GAIN = 0.03


def slot_contexts(batch: Sequence["DraftSlot"]) -> list[int] | None:
    """The slots' contexts, or None (the profile's prefix) unless every slot has one."""
    contexts = [slot.context for slot in batch]
    return None if any(c is None for c in contexts) else contexts


def padded_rows(lengths: Sequence[int]) -> int:
    """Rows of a forward that pads every sequence to the longest (the general [B, T] path)."""
    return len(lengths) * max(lengths, default=0)


@dataclass(frozen=True)
class DraftSlot:
    """One running request as the policy sees it this round: its id and the most draft tokens
    it may take (its remaining max_tokens and cache room, capped by the configured length)."""

    request_id: str
    limit: int
    # Which of the drafter's sources would draft it this round (Drafter.draft_sources, for a
    # policy that prices them apart: prices_sources); "" when the drafter has one.
    source: str = ""
    # Tokens before this round's (the keys its verified rows read; CostCurve.context_seconds);
    # None: priced at the profile's prefix.
    context: int | None = None
    # Hidden rows the drafter would catch up on before drafting (a request's prompt at its first
    # draft, the rounds a head sat out): a one-off cost on top of a round's.
    backlog: int = 0


@dataclass(frozen=True)
class Decision:
    """The last round's choice, for metrics and logs."""

    batch: int
    draft_lengths: tuple[int, ...]
    predicted_speedup: float


class SpeculationPolicy(ABC):
    """Chooses draft lengths per round; learns from verification outcomes. prices_sources: it
    wants each slot's DraftSlot.source (the engine then asks the drafter before drafting)."""

    prices_sources = False

    def __init__(self, min_survival: float = 0.0) -> None:
        self.last = Decision(0, (), 1.0)
        self.min_survival = min_survival

    @abstractmethod
    def draft_lengths(self, batch: Sequence[DraftSlot]) -> list[int]:
        """One draft length per slot, each in [0, slot.limit]; 0 turns speculation off for it."""

    def worth_asking(self, batch: Sequence[DraftSlot]) -> list[bool]:
        """Per slot, whether its draft could pay this round at the most it could bring from what
        past rounds say. The engine asks the drafter nothing for the others (their limit is 0
        this round); when none could, it drafts nothing and calls `skip_round` instead of
        draft_lengths."""
        return [True] * len(batch)

    def skip_round(self, batch: Sequence[DraftSlot]) -> None:
        """A round in which nothing is drafted because worth_asking said so for every slot."""

    def cut(self, request_id: str, draft: Draft) -> Draft:
        """The part of a proposed chain to verify: a prefix. It may read what was fixed before
        each token was drawn (the context, the earlier tokens, the drafter's confidences; for a
        deterministic draft the token itself), past rounds, the load and the cost curve; never
        this round's target output or verification randomness, and for a sampled draft never the
        sampled token (docs/algorithms.md, "Cutting a draft"). Trees pass whole.

        The default keeps the longest prefix whose survival, the product of the confidences up
        to it, stays at or above `min_survival` (SpecConfig; 0 keeps everything)."""
        if self.min_survival <= 0 or draft.confidence is None or draft.is_tree:
            return draft
        return draft.truncated(sum(1 for a in draft.survival() if a >= self.min_survival))

    def admit(self, request_ids: Sequence[str], drafts: Sequence[Draft], batch: int,
              contexts: Sequence[int] | None = None) -> list[Draft]:
        """The part of this round's drafts to verify, for all drafting requests together (`batch`:
        every running request, drafting or not; `contexts`: their tokens before this round, the
        drafting ones first, as DraftSlot.context). The same rules as `cut` bind it; the default
        cuts each draft on its own."""
        return [self.cut(r, d) for r, d in zip(request_ids, drafts)]

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """A request's draft of `drafted` tokens (a tree: its depth) had its first `accepted` accepted."""

    def observe_draft_time(self, seconds: float, tokens: int) -> None:
        """The drafter spent `seconds` proposing `tokens` tokens (trees: depth levels; a drafter
        whose cost is per round: one per draft) for the batch."""

    def observe_catch_up(self, seconds: float, rows: int, units: int) -> None:
        """The drafter spent `seconds` drafting `units` units after catching up on `rows` hidden
        rows (DraftSlot.backlog): not a steady round's cost (observe_draft_time)."""

    def observe_asking(self, seconds: float, requests: int) -> None:
        """Once worth_asking said yes for some, asking the drafter where their drafts would come
        from and choosing the lengths of a batch of `requests` running requests took `seconds`."""

    def observe_round(self, tokens: int, seconds: float, lengths: Sequence[int] | None = None,
                      contexts: Sequence[int] | None = None) -> None:
        """A verification round over `tokens` rows (those the runner computed) took `seconds`,
        drafting excluded; `lengths` and `contexts`: each request's rows and tokens before the
        round, for pricing its prefixes (CostCurve.context_seconds)."""

    def release(self, request_id: str) -> None:
        """The request finished: drop what the policy kept about it."""


class FixedPolicy(SpeculationPolicy):
    """The configured draft length every round (capped by each request's limit)."""

    def __init__(self, spec: SpecConfig, curve: CostCurve | None = None) -> None:
        super().__init__(spec.min_survival)
        self.k = spec.max_draft_len

    def draft_lengths(self, batch: Sequence[DraftSlot]) -> list[int]:
        ks = [max(0, min(self.k, s.limit)) for s in batch]
        self.last = Decision(len(batch), tuple(ks), 1.0)
        return ks


class PricedPolicy(SpeculationPolicy):
    """A policy that prices rounds: committed tokens per second from the target's profiled cost
    curve, corrected by the rounds it sees (LiveCurve), over the rows the runner computes
    (verify_rows), at most k_max draft tokens per request, speculating only past min_gain."""

    def __init__(self, spec: SpecConfig, curve: CostCurve | None, verify_rows: Callable[[Sequence[int]], int],
                 min_gain: float, name: str) -> None:
        super().__init__(spec.min_survival)
        if curve is None:
            raise ValueError(
                f"the {name} needs the target's forward cost curve: pass cost_curve= "
                "(tandem serve measures it at startup), or use policy='fixed'"
            )
        self.curve = LiveCurve(curve)
        self.k_max = spec.max_draft_len
        self.verify_rows = verify_rows
        self.min_gain = min_gain
        self.draft_seconds_per_unit = 0.0
        self.draft_rounds = 0
        self.fastest_draft = float("inf")  # the fastest drafting measured, per unit

    def _measured_draft(self, per_unit: float) -> None:
        self.fastest_draft = min(self.fastest_draft, per_unit)
        self.draft_rounds += 1

    def _relax_draft_cost(self) -> None:
        """Called for a round that drafts nothing: drafting time is only measured when something
        is drafted, so one slow measurement (the shared CPU taken away mid-draft) must not stop
        drafting for good; the estimate relaxes toward the fastest drafting measured."""
        if self.draft_rounds:
            self.draft_seconds_per_unit += RELAX * (self.fastest_draft - self.draft_seconds_per_unit)

    def observe_round(self, tokens: int, seconds: float, lengths: Sequence[int] | None = None,
                      contexts: Sequence[int] | None = None) -> None:
        self.curve.observe(tokens, seconds, self.curve.profile.context_seconds(lengths or [], contexts))

    def seconds(self, lengths: Sequence[int], contexts: Sequence[int] | None) -> float:
        """Predicted seconds of a verification forward in which request i verifies lengths[i]
        rows over a prefix of contexts[i] tokens (None: the profile's prefix): the curve at the
        rows the runner computes, plus what those prefixes add (at least half the curve's time,
        as LiveCurve keeps it)."""
        return self._priced(lengths, self.curve.profile.context_seconds(lengths, contexts))

    def _priced(self, lengths: Sequence[int], context_seconds: float, memo: dict[int, float] | None = None) -> float:
        """`seconds` with what the prefixes add already summed (callers that add rows one at a
        time update it by each row's share; memo: the curve's values already read this round)."""
        rows = self.verify_rows(lengths)
        at_profile = memo.get(rows) if memo is not None else None
        if at_profile is None:
            at_profile = self.curve(rows)
            if memo is not None:
                memo[rows] = at_profile
        return max(at_profile + context_seconds, 0.5 * at_profile)


class AdaptivePolicy(PricedPolicy):
    """Maximise predicted committed tokens per second of the whole batch.

    Request r with conditional acceptance a_r[i] (moving average of its own past rounds) commits
    tau_r(k) = 1 + sum_{j<k} prod_{i<=j} a_r[i] tokens per forward with k drafts. With a common cap K
    each request verifies min(K, ...) + 1 tokens, and the forward costs curve(rows) plus what
    the requests' prefixes add (PricedPolicy.seconds) plus the drafter's time, where rows =
    verify_rows(those lengths) is what the runner really computes (ModelRunner.verify_rows:
    their sum on the fused path, B x the longest on the padded one);
    `curve` is the profile corrected by measured rounds (LiveCurve). Trees (eagle_topk > 1): K
    is the depth, a_r[i] the acceptance at depth i, and each drafting request is costed at its
    full node budget, num_draft_tokens + 1 tokens, whatever K (an upper bound). For each K in
    0..k_max each request drafts min(K, limit, useful) where `useful` drops positions whose
    expected tokens cost more draft time than they save; the K with the best tokens/second wins
    if it beats plain decoding (K = 0: B tokens per curve(B)) by MIN_GAIN. A drafter whose cost is
    per round (per_round_drafts: a block drafter) is priced at its measured seconds per drafting
    request, whatever the length, instead of per draft token. As the batch grows the curve turns linear and K falls to 0: speculation switches
    itself off when verification stops being cheap.
    """

    def __init__(
        self,
        spec: SpecConfig,
        curve: CostCurve | None,
        prior: float = PRIOR_ACCEPTANCE,
        min_gain: float = MIN_GAIN,
        per_round_drafts: bool = False,
        verify_rows: Callable[[Sequence[int]], int] = padded_rows,
    ) -> None:
        super().__init__(spec, curve, verify_rows, min_gain, "adaptive speculation policy")
        self.per_round_drafts = per_round_drafts
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior acceptance must be in [0, 1], got {prior}")
        self.tree_tokens = spec.num_draft_tokens + 1 if spec.tree else None
        self.prior = prior
        self.global_acceptance = [prior] * self.k_max
        self.acceptance: dict[str, list[float]] = {}

    def _estimate(self, request_id: str) -> list[float]:
        if request_id not in self.acceptance:
            self.acceptance[request_id] = list(self.global_acceptance)
        return self.acceptance[request_id]

    def draft_lengths(self, batch: Sequence[DraftSlot]) -> list[int]:
        B = len(batch)
        if B == 0:
            return []
        contexts = slot_contexts(batch)
        plain_seconds = self.seconds([1] * B, contexts)
        survival = []  # survival[r][j] = P(draft tokens 0..j of request r all pass)
        for slot in batch:
            reach, s = 1.0, []
            for a in self._estimate(slot.request_id)[: max(0, slot.limit)]:
                reach *= a
                # A position is worth drafting while its expected tokens beat the draft time they
                # cost (nothing more for a drafter that proposes its whole block at once).
                if not self.per_round_drafts and reach * plain_seconds / B <= self.draft_seconds_per_unit:
                    break
                s.append(reach)
            survival.append(s)
        best_ks, best_rate = [0] * B, B / plain_seconds
        plain_rate = best_rate
        for K in range(1, self.k_max + 1):
            ks = [min(K, len(s)) for s in survival]
            if max(ks) < K:
                break  # no request can use a chain this long: larger K would repeat the last one
            lengths = [(self.tree_tokens or k + 1) if k else 1 for k in ks]
            committed = B + sum(sum(s[:k]) for s, k in zip(survival, ks))
            units = sum(k > 0 for k in ks) if self.per_round_drafts else sum(ks)
            seconds = self.seconds(lengths, contexts) + self.draft_seconds_per_unit * units
            rate = committed / seconds
            if rate > best_rate and rate > plain_rate * (1.0 + self.min_gain):
                best_ks, best_rate = ks, rate
        self.last = Decision(B, tuple(best_ks), best_rate / plain_rate)
        if not any(best_ks):
            self._relax_draft_cost()
        return best_ks

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        est = self._estimate(request_id)
        if drafted == 0:
            for i in range(len(est)):
                est[i] += RELAX * (self.prior - est[i])
            return
        # Position i was graded when every earlier draft token passed; the first rejection ends it.
        for i in range(min(drafted, accepted + 1, self.k_max)):
            outcome = 1.0 if i < accepted else 0.0
            est[i] += REQUEST_EMA * (outcome - est[i])
            self.global_acceptance[i] += GLOBAL_EMA * (outcome - self.global_acceptance[i])

    def observe_draft_time(self, seconds: float, tokens: int) -> None:
        if tokens > 0:
            per_token = seconds / tokens
            self.draft_seconds_per_unit += 0.2 * (per_token - self.draft_seconds_per_unit)
            self._measured_draft(per_token)

    def release(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)
