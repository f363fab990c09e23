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
carry confidences too (drafters/suffix.py, LookupConfidence): position j's is how often position j
of earlier lookup drafts with the same evidence passed when every token before it had, corrected
for the request; a function of the context and past rounds only.
"""

from __future__ import annotations

import dataclasses

import torch

from tandem.config import SpecConfig
from tandem.drafters.base import DraftInput, DraftOutcome, TargetInfo
from tandem.drafters.suffix import SuffixDrafter
from tandem.types import Draft

# A head takes the suffix lookup's draft instead of drafting when the lookup has at least this
# many tokens. A one-token lookup draft comes from the weakest matches, and on tau alone 2 was
# best (eagle3 on a Zen 3: every lookup draft taken gave tau 1.76, two tokens or more 2.00). But a
# lookup round costs no drafting: on the Zen 5, three alternating runs each of Spec-Bench --limit 2
# (docs/drafters.md) gave dflash 1.11-1.20x plain with 1 against 1.07-1.12x with 2 (dspark
# alike), and eagle3 1.07-1.12x against 1.07-1.11x, although their tau fell (dflash 1.77 -> 1.67,
# eagle3 2.03 -> 1.80). Choosing by the lookup's evidence (match length, own text) instead lifts
# eagle3's tau to 2.11 and still loses to suffix decoding alone (docs/drafters.md, "Heads with the
# lookup"): a head round costs more than its extra tokens bring.
LOOKUP_MIN_TOKENS = 1


class LookupFirst:
    """The suffix drafter a head asks first, and the hidden rows of the rounds it drafted."""

    def __init__(self, spec: SpecConfig, target: TargetInfo, layers: tuple[int, ...]) -> None:
        # The head's path is not a corpus: the lookup matches the shipped one (spec.corpus).
        self.suffix = SuffixDrafter(dataclasses.replace(spec, algorithm="suffix", eagle_topk=1, draft_model_path=None),
                                    target)
        self.layers = layers  # the hidden layers the head reads
        # request -> (hidden rows of the lookup rounds since the head last drafted, as pieces; the
        # position of the first of them; the position after the last)
        self.pending: dict[str, tuple[list[dict[int, torch.Tensor]], int, int]] = {}
        # request -> ((context length, budget), draft) from `peek`, for this round's `propose`
        self.peeked: dict[str, tuple[tuple[int, int], Draft]] = {}

    def observe(self, outcomes: list[DraftOutcome]) -> None:
        self.suffix.observe(outcomes)

    def release(self, request_id: str) -> None:
        self.peeked.pop(request_id, None)
        self.pending.pop(request_id, None)
        self.suffix.release(request_id)

    def peek(self, inputs: list[DraftInput]) -> list[bool]:
        """Per input, whether this round's draft will be the lookup's (before anything is drafted:
        the lookup's draft is a function of the context alone). The drafts are kept for the
        round's `propose`."""
        drafts = self.suffix.lookup(inputs)
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
        fresh = iter(self.suffix.lookup(missing) if missing else [])
        return [d if d is not None else next(fresh) for d in drafts]

    def propose(self, inputs: list[DraftInput]) -> list[Draft | None]:
        """Per input, the lookup's draft when it has LOOKUP_MIN_TOKENS tokens or more (its
        hidden rows then wait for the head's next round), else None: the head drafts."""
        out: list[Draft | None] = []
        for inp, draft in zip(inputs, self._suffix_drafts(inputs)):
            if len(draft) < LOOKUP_MIN_TOKENS:
                self.suffix.not_drafted(inp.request_id)
                out.append(None)
                continue
            self._defer(inp)
            out.append(self.suffix.with_confidences(inp.request_id, draft))
        return out

    def waiting_rows(self, request_id: str) -> int:
        """Hidden rows of the request's lookup rounds that its head would catch up on first."""
        _, start, end = self.pending.get(request_id, ((), 0, 0))
        return end - start  # the pieces are contiguous

    def with_pending(self, inp: DraftInput) -> DraftInput:
        """inp with the rows waiting from earlier lookup rounds put before its own, when they end
        where its own begin."""
        pieces, _, end = self.pending.pop(inp.request_id, ([], None, None))
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
        pieces, start, end = self.pending.get(inp.request_id, ([], None, None))
        if end != self._rows_start(inp):
            pieces, start = [], self._rows_start(inp)
        pieces.append({layer: inp.hidden[layer] for layer in self.layers})
        self.pending[inp.request_id] = (pieces, start, len(inp.token_ids) - 1)
