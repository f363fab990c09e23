"""What one engine step reports and counts: the update each request gets (StepUpdate), a round's
draft counts (RoundCounts) and who wrote each committed token (round_origins), and the forward
inputs of prompt chunks (chunk_inputs)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.request import Request
from tandem.model.runner import SeqInput
from tandem.types import Draft, TokenLogprob


@dataclass
class StepUpdate:
    """What one step did to one request: new tokens and text to stream, and whether it ended.
    With params.token_origins also the new text cut by who wrote it (Request.origin_pieces) and
    the round's counts (None for a prompt chunk that sampled nothing); with params.logprobs each
    new token's log-probability."""

    request: Request
    new_token_ids: list[int]
    new_text: str
    text_origins: list[tuple[str, str]] | None = None
    round: RoundCounts | None = None
    # With params.logprobs: one per token of new_token_ids.
    logprobs: list[TokenLogprob] | None = None



def chunk_inputs(chunks: list[tuple[Request, int, int]]) -> list[SeqInput]:
    """The forward inputs of prompt chunks (request, start, end): logits only for a prompt's last
    token, which gives its first output token; for every token where the request asked for the
    prompt's logprobs."""
    def logits(r: Request, e: int):
        if r.params.prompt_logprobs is not None:
            return "all"
        return "last" if e == len(r.prompt_ids) else []

    return [SeqInput(r.seq, r.prompt_ids[a:e], logits=logits(r, e)) for r, a, e in chunks]


def round_origins(draft: Draft, path: list[int]) -> list[str]:
    """Who wrote each token a round commits (the accepted draft nodes on `path`, then one of the
    target's): its last token is a correction where the draft went on past the accepted path,
    a bonus where it did not, and plain decoding where nothing was drafted."""
    if not draft.token_ids:
        return ["target"]
    end = path[-1] if path else -1
    drafted_past = len(path) < len(draft) if draft.parents is None else end in draft.parents
    return ["accepted"] * len(path) + ["recovered" if drafted_past else "bonus"]


@dataclass(frozen=True)
class RoundCounts:
    """What one round drafted and had accepted, as the stats, the policy and the drafter see it.

    drafted: draft tokens (tree nodes); accepted: accepted draft tokens; depth: the positions
    graded (a chain's length, a tree's depth); tree_depths: each tree node's depth (None for a
    chain). When EOS or a stop lands inside the accepted run, `clipped` keeps only what precedes
    the stop: positions past it are neither drafted nor graded nor accepted in any count.
    """

    drafted: int
    accepted: int
    depth: int
    tree_depths: tuple[int, ...] | None = None

    @classmethod
    def of(cls, draft: Draft, accepted: int) -> "RoundCounts":
        depths = tuple(draft.node_depths()) if draft.is_tree else None
        return cls(len(draft), accepted, draft.depth, depths)

    def clipped(self, committed: int) -> "RoundCounts":
        """The counts when only the first `committed` tokens of the round were kept (a stop
        landed on token `committed`, an accepted draft token)."""
        accepted = min(self.accepted, committed)
        if self.tree_depths is None:
            return RoundCounts(min(self.drafted, committed), accepted, min(self.depth, committed))
        kept = tuple(d for d in self.tree_depths if d <= committed)
        return RoundCounts(len(kept), accepted, min(self.depth, committed), kept)

