"""DSpark's confidence-scheduled verification: which of this round's drafted tokens to verify,
across the whole batch, from the drafters' confidences and the cost curve (docs/algorithms.md
section 6)."""

from __future__ import annotations

from typing import Callable, Sequence

from tandem.config import SpecConfig
from tandem.scheduler.cost_model import CostCurve
from tandem.scheduler.policy import (GLOBAL_EMA, MIN_GAIN, REQUEST_EMA, Decision, DraftSlot, PricedPolicy,
                                     padded_rows, slot_contexts)
from tandem.types import Draft

# Rounds without a draft after which the confidence scheduler prices a request as if its draft
# would all pass, so its survivals are measured again (only where such a draft would pay).
RETRY_ROUNDS = 32
# Rounds for which the source a request's draft came from when it was last asked stands for the
# source it would draft from now, in worth_asking: priced at that source's survivals and drafting
# cost, a request whose draft would not pay is not asked again until this many rounds have
# passed (the lookup's match moves with the text). Asking each request every round cost about 1
# ms a round with 8 requests in flight on one kernel thread (4% of a step), for drafts that
# almost never paid (docs/serving.md). A head's source stands for the free lookup in front of it:
# the lookup found nothing last round but mostly finds a draft the next.
SOURCE_ROUNDS = 4


class ConfidenceScheduler(PricedPolicy):
    """DSpark's confidence-scheduled verification (docs/algorithms.md section 6).

    After drafting, each drafting request r reports survivals a_{r,j} = prod_{i<=j} c_{r,i} from
    its drafter's calibrated confidences. `admit` takes the (r, j) pairs of the whole batch in
    descending a (ties: smaller j first, so every request's admitted pairs form a prefix) and
    keeps adding them while the predicted throughput, (B + sum of admitted a) / curve(rows),
    rises; it stops at the first pair that would lower it. `curve` is the profile corrected by
    measured rounds, plus what the requests' prefixes add (PricedPolicy.seconds), and rows =
    verify_rows(1 + each request's admitted length): the rows the runner really computes.
    Drafting is sunk by then, so only verification is priced.

    Stopping at the first drop is what keeps it lossless: whether (r, j) is admitted depends only
    on the pairs ranked before it, and (r, j+1), whose survival reads x_{r,j}, never ranks before
    (r, j). An admission that looked past a dip, or picked the best set overall, would decide on
    x_{r,j} from a value that depends on it. When every draft of the round is deterministic (a
    lookup's, or argmax drafts under greedy), the verifier grades them by the one-hot rule, which
    any cut that reads nothing of the target keeps exact: admission then takes the best prefix of
    the ranked pairs, looking past dips (a suffix draft's first token may be weak where the
    tokens after it, once it passes, almost always pass too).

    The drafter reports its confidences already corrected online for the request
    (drafters/calibration.py). Before drafting, `draft_lengths` prices expected survivals (a
    moving average of each request's survivals over its recent drafts; a new request's is the server-wide
    one, which starts at 1 so that the first requests draft and measure, and is the mean of the
    first drafts' survivals once there are any, a moving average after GLOBAL_EMA's worth), with the drafter's
    measured seconds per drafting request added to the cost of its first pair, and takes the
    best prefix of the ranked pairs: nothing has been drawn yet, so looking past a dip reads
    nothing this round drafts. When that admits nothing for a request, it does not draft this
    round; when it admits nothing at all, nothing is drafted. A request idle for RETRY_ROUNDS
    rounds is priced as if its draft would all pass, so it drafts again where that would pay
    and its survivals are measured afresh (the text may have turned easier to draft).

    A drafter with two sources (a head behind the suffix lookup) says before drafting which one
    each request's draft would come from (DraftSlot.source, from the context alone): survivals
    are then kept per source, and a lookup's draft is priced without drafting cost, so a head
    whose drafts do not pay stops drafting while the lookup's drafts still go on. Asking costs
    too (the lookup walks its tries), so `worth_asking` prices a request asked within the last
    SOURCE_ROUNDS rounds at the source it had then, drafting cost included (a head's at the free
    lookup in front of it instead); others at their best expected survivals over the sources and
    the cheapest source's drafting cost.
    """

    prices_sources = True

    def __init__(self, spec: SpecConfig, curve: CostCurve | None,
                 verify_rows: Callable[[Sequence[int]], int] = padded_rows, min_gain: float = MIN_GAIN,
                 sources: Sequence[str] = ("",)) -> None:
        super().__init__(spec, curve, verify_rows, min_gain, "confidence scheduler")
        self.source_names = tuple(sources)  # what the drafter's DraftSlot.source can be
        if spec.tree:
            raise ValueError("the confidence scheduler verifies chains: use --speculative-eagle-topk 1")
        # Each drafted request's recent survivals per draft source (past rounds only), and what a
        # new request is assumed to start with, per source.
        self.expected: dict[str, dict[str, list[float]]] = {}
        self.global_expected: dict[str, list[float]] = {}
        self.global_drafts: dict[str, list[int]] = {}  # per source and position: drafts averaged in
        self.sources: dict[str, str] = {}  # this round's source of each request that drafts
        self.idle: dict[str, int] = {}  # rounds since each request last drafted
        # Each request's source when it was last asked, and the round it was asked in.
        self.asked: dict[str, tuple[str, int]] = {}
        self.rounds = 0  # rounds worth_asking has priced
        self.catch_up_per_row = 0.0  # drafting time per backlog row, beyond a steady round's
        # Seconds per running request of asking at all, once worth_asking says yes for some: the
        # drafter's source for each request asked (the lookup's trie walks) and pricing the lengths.
        self.asking_per_request = 0.0

    def _global(self, source: str) -> list[float]:
        return self.global_expected.setdefault(source, [1.0] * self.k_max)

    def _expected(self, request_id: str, source: str) -> list[float]:
        """The request's expected survivals from a source (one it has not drafted from: the
        server-wide ones)."""
        return self.expected.get(request_id, {}).get(source) or self._global(source)

    def _draft_cost(self, slot: DraftSlot, source: str) -> float:
        """What drafting the slot's request from `source` costs: nothing worth pricing for a
        lookup's draft (a trie walk); a head's round, plus catching up on its backlog."""
        return 0.0 if source == "lookup" else self.draft_seconds_per_unit + slot.backlog * self.catch_up_per_row

    def _best_case(self, slot: DraftSlot) -> tuple[list[float], float]:
        """The survivals and drafting cost worth_asking prices the request at: at the source it
        was asked at within the last SOURCE_ROUNDS rounds, if it was and is not due a retry
        (where that source was a head's and the drafter has a free one, the lookup, at the free
        one: the lookup's match moves with the text, and a request whose lookup found nothing
        last round mostly finds a draft the next); else all 1 (due a retry) or, per position,
        the best of its expected survivals over the drafter's sources, at the cheapest of their
        costs (free with a lookup, a head's round for a head alone)."""
        idle = self.idle.get(slot.request_id, 0)
        asked = self.asked.get(slot.request_id)
        cost = {source: self._draft_cost(slot, source) for source in self.source_names}
        cheapest = min(cost, key=cost.get)
        if idle < RETRY_ROUNDS and asked is not None and self.rounds - asked[1] <= SOURCE_ROUNDS:
            mine = self._draft_cost(slot, asked[0])
            if mine <= cost[cheapest]:
                return self._expected(slot.request_id, asked[0]), mine
            return self._expected(slot.request_id, cheapest), cost[cheapest]
        if idle >= RETRY_ROUNDS:
            return [1.0] * self.k_max, cost[cheapest]
        return [max(p) for p in zip(*(self._expected(slot.request_id, s) for s in self.source_names))], cost[cheapest]

    def worth_asking(self, batch: Sequence[DraftSlot]) -> list[bool]:
        """Per request, whether its draft could be admitted: the admission before drafting at
        each request's best case (_best_case) from past rounds, plus what asking costs
        (asking_per_request for every running request). Only those requests are asked anything
        (the suffix lookup walks its tries for each one asked); under load none is, and the
        load pays no drafting. (A gate, not the decision: a bound up to the prefixes' share of
        each row, which differs between requests, and up to a source that changed since the
        request was last asked.)"""
        B = len(batch)
        if B == 0:
            return []
        self.rounds += 1
        contexts = slot_contexts(batch)
        best_case, costs = zip(*(self._best_case(slot) for slot in batch))
        best_case = [survivals[: max(0, slot.limit)] for survivals, slot in zip(best_case, batch)]
        lengths, rate = self._admission(B, best_case, list(costs), past_dips=True, contexts=contexts,
                                        overhead=self.asking_per_request * B)
        if rate <= B / self.seconds([1] * B, contexts) * (1.0 + self.min_gain):
            return [False] * B
        return [n > 0 for n in lengths]

    def observe_asking(self, seconds: float, requests: int) -> None:
        """Asking the drafter for each of `requests` running requests' source and pricing their
        lengths took `seconds` (the first measurement as it is, then a moving average)."""
        if requests > 0:
            per_request = seconds / requests
            weight = 1.0 if self.asking_per_request == 0.0 else 0.2
            self.asking_per_request += weight * (per_request - self.asking_per_request)

    def skip_round(self, batch: Sequence[DraftSlot]) -> None:
        for slot in batch:
            self.idle[slot.request_id] = self.idle.get(slot.request_id, 0) + 1
        self.last = Decision(len(batch), (0,) * len(batch), 1.0)
        self._relax_draft_cost()

    def draft_lengths(self, batch: Sequence[DraftSlot]) -> list[int]:
        B = len(batch)
        if B == 0:
            return []
        survivals, costs = [], []
        for slot in batch:
            retry = self.idle.get(slot.request_id, 0) >= RETRY_ROUNDS
            expected = self._expected(slot.request_id, slot.source)
            survivals.append(([1.0] * self.k_max if retry else expected)[: max(0, slot.limit)])
            costs.append(self._draft_cost(slot, slot.source))
            if slot.limit > 0:
                self.asked[slot.request_id] = (slot.source, self.rounds)
        contexts = slot_contexts(batch)
        lengths, rate = self._admission(B, survivals, costs, past_dips=True, contexts=contexts)
        if rate <= B / self.seconds([1] * B, contexts) * (1.0 + self.min_gain):
            lengths = [0] * B
        # A request that may draft drafts its whole block: the drafter's cost is per round.
        ks = [min(slot.limit, self.k_max) if n else 0 for slot, n in zip(batch, lengths)]
        for slot, k in zip(batch, ks):
            self.idle[slot.request_id] = 0 if k else self.idle.get(slot.request_id, 0) + 1
            self.sources[slot.request_id] = slot.source
        if not any(ks):
            self._relax_draft_cost()
        return ks

    def admit(self, request_ids: Sequence[str], drafts: Sequence[Draft], batch: int,
              contexts: Sequence[int] | None = None) -> list[Draft]:
        survivals = []
        for rid, d in zip(request_ids, drafts):
            if d.is_tree or d.confidence is None:
                raise ValueError("the confidence scheduler needs chain drafts with confidences "
                                 "(dspark, dflash, suffix)")
            survivals.append(d.survival())
            # A request's first draft from a source replaces the server-wide guess it started
            # from; later ones average in.
            source = self.sources.get(rid, "")
            shared = self._global(source)
            per_source = self.expected.setdefault(rid, {})
            weight = REQUEST_EMA if source in per_source else 1.0
            mine = per_source.setdefault(source, list(shared))
            # Each position of the server-wide estimate is the mean of its first drafts, then a
            # moving average: its starting 1s make the first requests draft, and must not outlast them.
            counts = self.global_drafts.setdefault(source, [0] * self.k_max)
            for j, a in enumerate(survivals[-1]):
                mine[j] += weight * (a - mine[j])
                counts[j] += 1
                shared[j] += max(GLOBAL_EMA, 1.0 / counts[j]) * (a - shared[j])
        # Running requests without a draft are the rest of the batch: one row, one token each.
        # Deterministic drafts (no q) are graded by the one-hot rule, which any cut that reads
        # nothing of the target keeps exact: then the best prefix of the ranked pairs is taken,
        # looking past dips (a draft whose first token is weak but whose next ones are strong).
        deterministic = all(d.probs is None for d in drafts)
        lengths, predicted = self._admission(batch, survivals, past_dips=deterministic, contexts=contexts)
        self.last = Decision(batch, tuple(lengths), predicted * self.seconds([1] * batch, contexts) / batch)
        return [d.truncated(n) for d, n in zip(drafts, lengths)]

    def _admission(self, batch: int, survivals: Sequence[Sequence[float]], draft_seconds: Sequence[float] | None = None,
                   past_dips: bool = False, contexts: Sequence[int] | None = None,
                   overhead: float = 0.0) -> tuple[list[int], float]:
        """Admitted prefix lengths of the first len(survivals) requests of a batch of `batch`
        (the others verify one row and commit one token; `contexts`: every request's tokens
        before the round, in that order, or None), and their predicted committed tokens per
        second: pairs in descending survival, stopping at the first drop (past_dips: the best
        prefix of that order instead, for decisions taken before anything is drawn).
        draft_seconds: per request, what its drafting costs once it gets a pair (None: drafting
        is sunk); overhead: seconds any admission at all adds to the round."""
        order = sorted(((a, j, r) for r, s in enumerate(survivals) for j, a in enumerate(s)),
                       key=lambda t: (-t[0], t[1], t[2]))
        lengths = [0] * len(survivals)
        rows = [1] * batch  # each request's verified rows: 1 + its admitted length
        committed, drafting = float(batch), 0.0
        # What the prefixes add, kept up to date a row at a time (each row reads its request's keys).
        profile = self.curve.profile
        prefixes = profile.context_seconds(rows, contexts)
        row_share = [(c - profile.context) * profile.per_key_row for c in contexts] if contexts is not None else None
        memo: dict[int, float] = {}
        best = committed / self._priced(rows, prefixes, memo)
        best_lengths = list(lengths)
        for a, j, r in order:
            # this request's first pair also pays its drafting
            cost = draft_seconds[r] if draft_seconds is not None and lengths[r] == 0 else 0.0
            rows[r] += 1
            share = row_share[r] if row_share is not None else 0.0
            rate = (committed + a) / (self._priced(rows, prefixes + share, memo) + drafting + cost + overhead)
            if rate <= best and not past_dips:
                break
            lengths[r] += 1
            committed += a
            drafting += cost
            prefixes += share
            if rate > best:
                best, best_lengths = rate, list(lengths)
        return best_lengths, best

    def observe_draft_time(self, seconds: float, tokens: int) -> None:
        """Seconds per drafting request: the first measurement as it is (an estimate of 0 would
        make the first rounds' drafting look free), then a moving average."""
        if tokens > 0:
            per_request = seconds / tokens
            if not self.draft_rounds:
                self.draft_seconds_per_unit = per_request
            self.draft_seconds_per_unit += 0.2 * (per_request - self.draft_seconds_per_unit)
            self._measured_draft(per_request)

    def observe_catch_up(self, seconds: float, rows: int, units: int) -> None:
        if rows > 0:
            per_row = max(0.0, seconds - units * self.draft_seconds_per_unit) / rows
            self.catch_up_per_row += (1.0 if self.catch_up_per_row == 0.0 else 0.2) * (per_row - self.catch_up_per_row)

    def release(self, request_id: str) -> None:
        self.expected.pop(request_id, None)
        self.idle.pop(request_id, None)
        self.sources.pop(request_id, None)
        self.asked.pop(request_id, None)
