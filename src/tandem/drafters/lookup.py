"""The suffix lookup in front of a hidden-state head (--speculative-lookup, on by default).

A chain drafter that reads the target's hidden states (eagle, eagle3, dflash, dspark under a
fixed or adaptive policy) first asks the suffix drafter (model-free: prompt, output and earlier
answers). When its draft has LOOKUP_MIN_TOKENS tokens or more, the round proposes that draft and
the head does not run. The round's new hidden rows then wait here, and the next round the head
drafts in catches up on them all in one forward, so its caches still hold exactly the true
features before the context. A round the engine skipped breaks that chain of rows; the head's
caches then restart at the first row they have (drafts stay valid, with less context).

The lookup's drafts are deterministic (no q), so the verifier grades them with the one-hot rule
under sampling too; which source drafts a round depends only on the context.

For the confidence scheduler, which prices every draft by its confidences, the lookup's drafts
carry confidences too (`confidences=True`, LookupConfidence): position j's is how often position j
of earlier lookup drafts with the same evidence passed when every token before it had, corrected
for the request; a function of the context and past rounds only.
"""

from __future__ import annotations

import bisect
import dataclasses

import torch

from tandem.config import SpecConfig
from tandem.drafters.base import DraftInput, DraftOutcome, TargetInfo
from tandem.drafters.calibration import OnlineCalibration
from tandem.drafters.suffix import OWN_TRIE, SuffixDrafter
from tandem.types import Draft

# A head takes the suffix lookup's draft instead of drafting when the lookup has at least this
# many tokens. A one-token lookup draft comes from the weakest matches, and on tau alone 2 was
# best (eagle3 on a Zen 3: every lookup draft taken gave tau 1.76, two tokens or more 2.00). But a
# lookup round costs no drafting: on the Zen 5, three alternating runs each of Spec-Bench --limit 2
# (docs/drafters.md) gave dflash 1.11-1.20x plain with 1 against 1.07-1.12x with 2 (dspark
# alike), and eagle3 1.07-1.12x against 1.07-1.11x, although their tau fell (dflash 1.77 -> 1.67,
# eagle3 2.03 -> 1.80).
LOOKUP_MIN_TOKENS = 1


# Upper bounds of the match-length classes a lookup draft's pass rates are kept by: the context's
# tail matched over 1, 2, 3-4, 5-8, or 9 and more tokens. Replayed on 30 Spec-Bench greedy answers
# (SmolLM2, the shipped corpus), a draft's first token passed 0.25 / 0.37 / 0.45 / 0.65 / 0.91 of
# the time by class, and 0.54 from the request's own text against 0.20-0.31 from earlier answers
# or the corpus.
MATCH_CLASSES = (1, 2, 4, 8)
# Passes every rate starts with (a graded position adds one grade): at 1 of 1, a position the
# scheduler has never admitted is admitted and graded until its rate is known. Positions are only
# graded when admitted, and a start of 0.5 kept the later ones out for good: dspark scheduled
# verified one-token lookup drafts in 491 of 948 rounds where suffix decoding's own drafts ran to
# four tokens (Spec-Bench --limit 2, greedy, 128 tokens, Zen 5).
PRIOR_PASSES = 1


class LookupConfidence:
    """The confidences the lookup's drafts report, and what it learns from their grades.

    Position j's base rate is how often position j of earlier lookup drafts passed when every
    token before it had, over the whole server, kept apart by evidence (SuffixDrafter.evidence:
    the request's own text or not, and the match-length class). The request's own grades then
    move it by one logit offset per request (drafters/calibration.py), as a head's confidences
    are corrected: a request whose text drafts better or worse than the average is seen within a
    few rounds. Both are functions of the context and past rounds only."""

    def __init__(self) -> None:
        self.grades: dict[tuple[bool, int, int], tuple[int, int]] = {}  # (own, class, j) -> (graded, passed)
        self.calibration = OnlineCalibration()
        self.drafted: dict[str, tuple[bool, int]] = {}  # request -> evidence of its latest lookup draft

    @staticmethod
    def evidence_class(evidence: tuple[int, int]) -> tuple[bool, int]:
        which, matched = evidence
        return which == OWN_TRIE, bisect.bisect_left(MATCH_CLASSES, matched)

    def rate(self, evidence: tuple[int, int], j: int) -> float:
        graded, passed = self.grades.get((*self.evidence_class(evidence), j), (0, 0))
        return (passed + PRIOR_PASSES) / (graded + PRIOR_PASSES)

    def confidences(self, request_id: str, evidence: tuple[int, int], n: int) -> list[float]:
        """The confidences of the request's lookup draft of n tokens (kept until it is graded)."""
        self.drafted[request_id] = self.evidence_class(evidence)
        return self.calibration.correct(request_id, [self.rate(evidence, j) for j in range(n)])

    def not_drafted(self, request_id: str) -> None:
        """The request's latest draft is not the lookup's: nothing of it to grade here."""
        self.drafted.pop(request_id, None)
        self.calibration.not_drafted(request_id)

    def observe(self, request_id: str, verified: int, accepted: int) -> None:
        """The first `verified` tokens of the request's latest lookup draft were graded, the
        first `accepted` passed: position j was graded when every earlier one passed."""
        drafted = self.drafted.pop(request_id, None)
        if drafted is None:
            return
        for j in range(min(verified, accepted + 1)):
            graded, passed = self.grades.get((*drafted, j), (0, 0))
            self.grades[(*drafted, j)] = (graded + 1, passed + (j < accepted))
        self.calibration.observe(request_id, verified, accepted)

    def release(self, request_id: str) -> None:
        self.drafted.pop(request_id, None)
        self.calibration.release(request_id)


class LookupFirst:
    """The suffix drafter a head asks first, and the hidden rows of the rounds it drafted."""

    def __init__(self, spec: SpecConfig, target: TargetInfo, layers: tuple[int, ...], confidences: bool = False) -> None:
        # The head's path is not a corpus: the lookup matches the shipped one (spec.corpus).
        self.suffix = SuffixDrafter(dataclasses.replace(spec, algorithm="suffix", eagle_topk=1, draft_model_path=None),
                                    target)
        self.layers = layers  # the hidden layers the head reads
        # request -> (hidden rows of the lookup rounds since the head last drafted, as pieces;
        # the position after the last of them)
        self.pending: dict[str, tuple[list[dict[int, torch.Tensor]], int]] = {}
        self.confidences = confidences
        self.confidence = LookupConfidence()
        # request -> ((context length, budget), draft) from `peek`, for this round's `propose`
        self.peeked: dict[str, tuple[tuple[int, int], Draft]] = {}

    def observe(self, outcomes: list[DraftOutcome]) -> None:
        self.suffix.observe(outcomes)
        for o in outcomes:
            self.confidence.observe(o.request_id, o.num_drafted, o.num_accepted)

    def release(self, request_id: str) -> None:
        self.peeked.pop(request_id, None)
        self.pending.pop(request_id, None)
        self.confidence.release(request_id)
        self.suffix.release(request_id)

    def peek(self, inputs: list[DraftInput]) -> list[bool]:
        """Per input, whether this round's draft will be the lookup's (before anything is drafted:
        the lookup's draft is a function of the context alone). The drafts are kept for the
        round's `propose`."""
        drafts = self.suffix.propose(inputs)
        for inp, draft in zip(inputs, drafts):
            self.peeked[inp.request_id] = ((len(inp.token_ids), inp.max_draft_tokens), draft)
        return [len(d) >= LOOKUP_MIN_TOKENS for d in drafts]

    def _suffix_drafts(self, inputs: list[DraftInput]) -> list[Draft]:
        """The suffix drafter's drafts, the ones `peek` made this round where they still apply."""
        drafts: list[Draft | None] = []
        for inp in inputs:
            key, draft = self.peeked.pop(inp.request_id, (None, None))
            drafts.append(draft if key == (len(inp.token_ids), inp.max_draft_tokens) else None)
        missing = [inp for inp, d in zip(inputs, drafts) if d is None]
        fresh = iter(self.suffix.propose(missing) if missing else [])
        return [d if d is not None else next(fresh) for d in drafts]

    def propose(self, inputs: list[DraftInput]) -> list[Draft | None]:
        """Per input, the lookup's draft when it has LOOKUP_MIN_TOKENS tokens or more (its
        hidden rows then wait for the head's next round), else None: the head drafts."""
        out: list[Draft | None] = []
        for inp, draft in zip(inputs, self._suffix_drafts(inputs)):
            if len(draft) < LOOKUP_MIN_TOKENS:
                self.confidence.not_drafted(inp.request_id)
                out.append(None)
                continue
            self._defer(inp)
            if self.confidences:
                evidence = self.suffix.evidence[inp.request_id]
                draft = Draft(draft.token_ids, confidence=self.confidence.confidences(inp.request_id, evidence, len(draft)))
            out.append(draft)
        return out

    def waiting_rows(self, request_id: str) -> int:
        """Hidden rows of the request's lookup rounds that its head would catch up on first."""
        pieces, _ = self.pending.get(request_id, ([], None))
        return sum(p[self.layers[0]].shape[0] for p in pieces)

    def with_pending(self, inp: DraftInput) -> DraftInput:
        """inp with the rows waiting from earlier lookup rounds put before its own, when they end
        where its own begin."""
        pieces, end = self.pending.pop(inp.request_id, ([], None))
        if not pieces or end != self._rows_start(inp):
            return inp
        return dataclasses.replace(inp, hidden={layer: torch.cat([p[layer] for p in pieces] + [inp.hidden[layer]])
                                                for layer in self.layers})

    def _rows_start(self, inp: DraftInput) -> int:
        """The position of the first of inp's new hidden rows."""
        return len(inp.token_ids) - 1 - len(inp.hidden[self.layers[0]])

    def _defer(self, inp: DraftInput) -> None:
        """Keep the request's new hidden rows for the next round the head drafts in (as pieces,
        joined once then; rows that do not follow the waiting ones replace them)."""
        pieces, end = self.pending.get(inp.request_id, ([], None))
        if end != self._rows_start(inp):
            pieces = []
        pieces.append({layer: inp.hidden[layer] for layer in self.layers})
        self.pending[inp.request_id] = (pieces, len(inp.token_ids) - 1)
