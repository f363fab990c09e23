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
# Weight of the newest outcome in a request's per-position moving average (~3-round memory):
# acceptance moves with the text (a quoted passage drafts well, free prose badly).
REQUEST_EMA = 0.3
# Weight of one round in the server-wide estimate new requests start from.
GLOBAL_EMA = 0.05
# Per round without a draft, a request's estimate relaxes this far toward the prior, so a request
# switched off for poor acceptance is retried after some tens of rounds rather than never; and
# the drafting time toward the fastest measured, so one slow measurement does not stop drafting
# for good.
RELAX = 0.03
# Rounds without a draft after which the confidence scheduler prices a request as if its draft
# would all pass, so its survivals are measured again (only where such a draft would pay).
RETRY_ROUNDS = 32
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

    def may_pay(self, batch: Sequence[DraftSlot]) -> bool:
        """Whether any draft could pay this round, at the most it could bring from what past
        rounds say. False: the engine drafts nothing, asks no drafter anything and calls
        `skip_round` instead of draft_lengths."""
        return True

    def skip_round(self, batch: Sequence[DraftSlot]) -> None:
        """A round in which nothing is drafted because may_pay said so."""

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
    x_{r,j} from a value that depends on it.

    The drafter reports its confidences already corrected online for the request
    (drafters/calibration.py). Before drafting, `draft_lengths` prices expected survivals (a
    moving average of each request's survivals over its recent drafts; a new request's is the server-wide
    one, which starts at 1 so that the first requests draft and measure), with the drafter's
    measured seconds per drafting request added to the cost of its first pair, and takes the
    best prefix of the ranked pairs: nothing has been drawn yet, so looking past a dip reads
    nothing this round drafts. When that admits nothing for a request, it does not draft this
    round; when it admits nothing at all, nothing is drafted. A request idle for RETRY_ROUNDS
    rounds is priced as if its draft would all pass, so it drafts again where that would pay
    and its survivals are measured afresh (the text may have turned easier to draft).

    A drafter with two sources (a head behind the suffix lookup) says before drafting which one
    each request's draft would come from (DraftSlot.source, from the context alone): survivals
    are then kept per source, and a lookup's draft is priced without drafting cost, so a head
    whose drafts do not pay stops drafting while the lookup's drafts still go on.
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
        self.sources: dict[str, str] = {}  # this round's source of each request that drafts
        self.idle: dict[str, int] = {}  # rounds since each request last drafted
        self.catch_up_per_row = 0.0  # drafting time per backlog row, beyond a steady round's

    def _global(self, source: str) -> list[float]:
        return self.global_expected.setdefault(source, [1.0] * self.k_max)

    def _best_expected(self, slot: DraftSlot) -> list[float]:
        """The highest survivals draft_lengths could price this request at, whichever source
        drafts it: per position, the best of its expected survivals over the drafter's sources
        (a source it has not drafted from: the server-wide ones), or all 1 once it is due a retry."""
        if self.idle.get(slot.request_id, 0) >= RETRY_ROUNDS:
            return [1.0] * self.k_max
        mine = self.expected.get(slot.request_id, {})
        return [max(p) for p in zip(*((mine.get(s) or self._global(s)) for s in self.source_names))]

    def may_pay(self, batch: Sequence[DraftSlot]) -> bool:
        """The admission before drafting at each request's best expected survivals, with no
        drafting cost: the most this round's drafts could bring, from past rounds. Under load it
        brings too little, and nothing is drafted at all, not even the suffix lookup asked for
        its draft, so the load pays no drafting. (An upper bound up to the prefixes' share of
        each row, which differs between requests: a gate, not the decision.)"""
        B = len(batch)
        if B == 0:
            return False
        contexts = slot_contexts(batch)
        best_case = [self._best_expected(slot)[: max(0, slot.limit)] for slot in batch]
        _, rate = self._admission(B, best_case, past_dips=True, contexts=contexts)
        return rate > B / self.seconds([1] * B, contexts) * (1.0 + self.min_gain)

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
            expected = self.expected.get(slot.request_id, {}).get(slot.source) or self._global(slot.source)
            survivals.append(([1.0] * self.k_max if retry else expected)[: max(0, slot.limit)])
            # A lookup's draft is a trie walk: it costs no drafting worth pricing. A head's costs
            # a round, plus catching up on the rows it has not seen (its backlog).
            costs.append(0.0 if slot.source == "lookup"
                         else self.draft_seconds_per_unit + slot.backlog * self.catch_up_per_row)
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
                raise ValueError("the confidence scheduler needs chain drafts with confidences (dspark, dflash)")
            survivals.append(d.survival())
            # A request's first draft from a source replaces the server-wide guess it started
            # from; later ones average in.
            source = self.sources.get(rid, "")
            shared = self._global(source)
            per_source = self.expected.setdefault(rid, {})
            weight = REQUEST_EMA if source in per_source else 1.0
            mine = per_source.setdefault(source, list(shared))
            for j, a in enumerate(survivals[-1]):
                mine[j] += weight * (a - mine[j])
                shared[j] += GLOBAL_EMA * (a - shared[j])
        # Running requests without a draft are the rest of the batch: one row, one token each.
        lengths, predicted = self._admission(batch, survivals, contexts=contexts)
        self.last = Decision(batch, tuple(lengths), predicted * self.seconds([1] * batch, contexts) / batch)
        return [d.truncated(n) for d, n in zip(drafts, lengths)]

    def _admission(self, batch: int, survivals: Sequence[Sequence[float]], draft_seconds: Sequence[float] | None = None,
                   past_dips: bool = False, contexts: Sequence[int] | None = None) -> tuple[list[int], float]:
        """Admitted prefix lengths of the first len(survivals) requests of a batch of `batch`
        (the others verify one row and commit one token; `contexts`: every request's tokens
        before the round, in that order, or None), and their predicted committed tokens per
        second: pairs in descending survival, stopping at the first drop (past_dips: the best
        prefix of that order instead, for decisions taken before anything is drawn).
        draft_seconds: per request, what its drafting costs once it gets a pair (None: drafting
        is sunk)."""
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
            rate = (committed + a) / (self._priced(rows, prefixes + share, memo) + drafting + cost)
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
