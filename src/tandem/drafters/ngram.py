"""N-gram (prompt lookup) drafter: copy what followed the latest earlier occurrence of the context's tail.

Model-free and deterministic (docs/algorithms.md section 3). Each request keeps an incremental index from
n-gram to its most recent continuation position, so a call costs O(ngram_max) lookups plus the
tokens that arrived since the previous call, never a rescan of the context.
"""

from __future__ import annotations

from tandem.config import SpecConfig
from tandem.drafters.base import Drafter, DraftInput, TargetInfo, register
from tandem.types import Draft


class _Index:
    """One request's tokens and, for every n-gram, the position right after its latest occurrence.

    Example (n in 1..2): tokens [7, 8, 7, 9] give (7,)->3 (the later occurrence overwrote ->1),
    (8,)->2, (7, 8)->2, (8, 7)->3. Position e is indexed only once tokens[e] exists, so the n-grams
    ending at the very end of the context ((9,), (7, 9): the lookup keys) never match themselves.
    """

    __slots__ = ("tokens", "last")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}

    def extend(self, new: list[int], n_min: int, n_max: int) -> None:
        tokens, last = self.tokens, self.last
        start = len(tokens)
        tokens.extend(new)
        # Continuation positions that now have a token: e in [start, len) except e = 0.
        for e in range(max(start, 1), len(tokens)):
            for n in range(n_min, min(n_max, e) + 1):
                last[tuple(tokens[e - n : e])] = e


@register("ngram")
class NgramDrafter(Drafter):
    """Prompt lookup over prompt + generated tokens; longer n-grams and later occurrences win."""

    def __init__(self, spec: SpecConfig, target: TargetInfo) -> None:
        super().__init__(spec, target)
        if not 1 <= spec.ngram_min <= spec.ngram_max:
            raise ValueError(
                f"ngram drafter needs 1 <= ngram_min <= ngram_max, got {spec.ngram_min}..{spec.ngram_max}"
            )
        self._requests: dict[str, _Index] = {}

    def propose(self, batch: list[DraftInput]) -> list[Draft]:
        return [self._propose_one(inp) for inp in batch]

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def _propose_one(self, inp: DraftInput) -> Draft:
        k = min(self.spec.num_draft_tokens, inp.max_draft_tokens)
        index = self._synced(inp.request_id, inp.token_ids)
        tokens, n_total = index.tokens, len(index.tokens)
        if k < 1:
            return Draft.empty()
        for n in range(min(self.spec.ngram_max, n_total - 1), self.spec.ngram_min - 1, -1):
            e = index.last.get(tuple(tokens[n_total - n :]))
            if e is not None:
                return Draft(token_ids=tokens[e : e + k])
        return Draft.empty()

    def _synced(self, request_id: str, token_ids: list[int]) -> _Index:
        """The request's index brought up to `token_ids`, the source of truth for the context.

        Only the new tail is indexed. A context that shrank, or whose token at our old end differs
        (a rollback, a reused id), is re-indexed from scratch; the O(1) check keeps calls cheap.
        """
        index = self._requests.get(request_id)
        have = len(index.tokens) if index is not None else 0
        if index is None or have > len(token_ids) or (have and token_ids[have - 1] != index.tokens[-1]):
            index = self._requests[request_id] = _Index()
            have = 0
        if have < len(token_ids):
            index.extend(token_ids[have:], self.spec.ngram_min, self.spec.ngram_max)
        return index
