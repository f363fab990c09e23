"""Suffix decoding drafter (SuffixDecoding, Oliaro et al. 2024): model-free drafts from suffix tries.

A per-request trie over prompt + output and a global trie over earlier requests' outputs count how
often each continuation followed the context's tail; the drafter follows the most frequent one while
its estimated probability stays above a floor, and keeps the better-scoring of the two drafts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tandem.config import SpecConfig
from tandem.drafters.base import Drafter, DraftInput, DraftOutcome, TargetInfo, register
from tandem.types import Draft


class _Stream:
    """A token sequence whose suffixes live in a trie.

    frontier maps a suffix's start position to the node its path currently ends on, for the suffixes
    that still run through shared (materialised) nodes and are shorter than the trie's depth; they
    are the only ones an appended token has to touch. None once the stream is closed.
    """

    __slots__ = ("tokens", "frontier")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.frontier: dict[int, _Node] | None = {}


class _Node:
    """count = how many suffixes (start positions) pass through this node.

    A node seen by exactly one suffix does not materialise the rest of that suffix: it is a leaf
    whose `stream`/`offset` say the path continues as stream.tokens[offset:] (up to the trie depth).
    This keeps unrepeated text at about one node per token instead of one per token per depth level.
    """

    __slots__ = ("children", "count", "depth", "stream", "offset")

    def __init__(self, depth: int, stream: _Stream | None = None, offset: int = 0) -> None:
        self.children: dict[int, _Node] | None = None
        self.count = 1
        self.depth = depth
        self.stream = stream
        self.offset = offset


# A position in the trie: (node, j) is j tokens past `node` along its leaf tail (j = 0 at the node).
_Cursor = tuple[_Node, int]


class SuffixTrie:
    """Every suffix of its streams, cut at `max_depth` tokens, with pass-through counts.

    Appending a token costs O(frontier) <= O(max_depth) dictionary operations. Nodes are bounded by
    tokens * max_depth in the worst case (long verbatim repeats); measured about 1.1 per token on
    unrepeated text and 2-2.5 on code, at ~200 bytes per node.
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node(0)
        self.root.count = 0
        self.num_nodes = 1
        self.num_tokens = 0

    def open(self) -> _Stream:
        """A new, empty stream to `extend` token by token."""
        return _Stream()

    def extend(self, stream: _Stream, tokens: list[int]) -> None:
        root, max_depth = self.root, self.max_depth
        for tok in tokens:
            stream.tokens.append(tok)
            end = len(stream.tokens)
            root.count += 1
            frontier = stream.frontier
            frontier[end - 1] = root
            advanced: dict[int, _Node] = {}
            for start, node in frontier.items():
                children = node.children
                child = children.get(tok) if children else None
                if child is None:
                    # First suffix down this branch: leave it implicit, tailing the stream.
                    if children is None:
                        node.children = children = {}
                    children[tok] = _Node(node.depth + 1, stream, end)
                    self.num_nodes += 1
                    continue
                if child.stream is not None:
                    self._materialise_one(child)
                child.count += 1
                if child.depth < max_depth:
                    advanced[start] = child
            stream.frontier = advanced
        self.num_tokens += len(tokens)

    def add(self, tokens: list[int]) -> _Stream:
        """Insert a finished sequence; returns the handle `remove` takes."""
        stream = self.open()
        self.extend(stream, tokens)
        stream.frontier = None
        return stream

    def remove(self, stream: _Stream) -> None:
        """Take every suffix of `stream` out again, dropping nodes no other suffix uses."""
        toks = stream.tokens
        for start in range(len(toks)):
            self.root.count -= 1
            node = self.root
            for j in range(start, min(len(toks), start + self.max_depth)):
                child = node.children[toks[j]]
                child.count -= 1
                if child.count == 0:
                    # Nobody else passes here, so below it is only this suffix: a chain.
                    del node.children[toks[j]]
                    if not node.children:
                        node.children = None
                    self.num_nodes -= _chain_length(child)
                    break
                node = child
        self.num_tokens -= len(toks)

    def count(self, tokens: list[int]) -> int:
        """How many times `tokens` (at most max_depth long) occurs across the streams."""
        cursor = self._walk(tokens, 0)
        if cursor is None:
            return 0
        node, j = cursor
        return 1 if j else node.count

    def longest_match(self, context: list[int], max_len: int) -> tuple[_Cursor | None, int]:
        """The longest tail of `context` (<= max_len) seen before with a continuation, and its length.

        A suffix of a string with a continuation has one too, so the property is monotone in the
        length and a binary search finds the longest in O(max_len log max_len).
        """
        lo, hi, best = 0, min(max_len, len(context), self.max_depth - 1), None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            cursor = self._walk(context, len(context) - mid)
            if cursor is not None and self._continues(cursor):
                lo, best = mid, cursor
            else:
                hi = mid - 1
        return best, lo

    def draft(self, cursor: _Cursor, budget: int, min_prob: float) -> tuple[list[int], float]:
        """Follow the most frequent continuation from `cursor` for up to `budget` tokens.

        The path probability is the product of child/continuing-parent count ratios; stop before
        it falls under `min_prob`. Score = sum of the path probabilities = expected accepted tokens
        if each ratio were the chance the target agrees. Denominators count only the suffixes that
        do continue: the context's own tail (and a stream's end) passes through but predicts nothing.
        """
        node, j = cursor
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        while len(tokens) < budget:
            if node.stream is not None:
                pos = node.offset + j
                if pos >= self._tail_end(node):
                    break
                tok, j = node.stream.tokens[pos], j + 1
            else:
                if not node.children:
                    break
                tok, child = max(node.children.items(), key=lambda kv: kv[1].count)
                prob *= child.count / sum(c.count for c in node.children.values())
                if prob < min_prob:
                    break
                node = child
            tokens.append(tok)
            score += prob
        return tokens, score

    def _walk(self, tokens: list[int], start: int) -> _Cursor | None:
        """Follow tokens[start:] from the root; None if that string is not in the trie."""
        node, i, end = self.root, start, len(tokens)
        while i < end:
            if node.stream is not None:
                n, at = end - i, node.offset
                if at + n > self._tail_end(node) or node.stream.tokens[at : at + n] != tokens[i:end]:
                    return None
                return node, n
            child = node.children.get(tokens[i]) if node.children else None
            if child is None:
                return None
            node, i = child, i + 1
        return node, 0

    def _continues(self, cursor: _Cursor) -> bool:
        node, j = cursor
        if node.stream is not None:
            return node.offset + j < self._tail_end(node)
        return bool(node.children)

    def _tail_end(self, leaf: _Node) -> int:
        """End (exclusive) of a leaf's implicit path in its stream: the stream's end or max_depth."""
        suffix_start = leaf.offset - leaf.depth
        return min(len(leaf.stream.tokens), suffix_start + self.max_depth)

    def _materialise_one(self, leaf: _Node) -> None:
        """A second suffix reaches `leaf`: give its own suffix a real next node (still a leaf)."""
        stream, offset, end = leaf.stream, leaf.offset, self._tail_end(leaf)
        leaf.stream = None
        if offset < end:
            leaf.children = {stream.tokens[offset]: _Node(leaf.depth + 1, stream, offset + 1)}
            self.num_nodes += 1
        elif stream.frontier is not None and leaf.depth < self.max_depth:
            # Its suffix ends at the tip of another open stream: track it so that stream's next
            # token extends it. (Only reachable with several streams open at once.)
            stream.frontier[offset - leaf.depth] = leaf


def _chain_length(node: _Node) -> int:
    n = 1
    while node.children:
        (node,) = node.children.values()
        n += 1
    return n


@dataclass(slots=True)
class _Request:
    trie: SuffixTrie
    stream: _Stream
    num_prompt_tokens: int


@register("suffix")
class SuffixDrafter(Drafter):
    """Suffix decoding with a per-request trie and a global trie of earlier outputs.

    Draft length is adaptive: a tail matched over m tokens may draft at most
    min(k, floor(m * spec_factor + spec_offset)) tokens, so a short, weakly supported match drafts
    little (defaults factor 1, offset 0: a draft is never longer than the evidence behind it).

    Memory bounds: a trie's depth is max_match_len + num_draft_tokens (20 + k: a draft from a
    full-length match is never cut short; longer matches did not raise acceptance on GSM8K or code).
    The per-request trie holds prompt + output (bounded by the model's context): 1-2.5 nodes per
    token, tokens * depth at worst (a long verbatim copy). The global trie holds at most
    max_global_tokens output tokens and max_global_nodes nodes (defaults: 64k tokens, 256k nodes,
    about 60 MB); the oldest outputs are evicted first, an output longer than max_global_tokens is
    cut to its first tokens, and one that alone exceeds the node budget is not kept.
    """

    def __init__(
        self,
        spec: SpecConfig,
        target: TargetInfo,
        *,
        max_match_len: int = 20,
        spec_factor: float = 1.0,
        spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        max_global_tokens: int = 1 << 16,
        max_global_nodes: int = 1 << 18,
    ) -> None:
        super().__init__(spec, target)
        if max_match_len < 1:
            raise ValueError(f"max_match_len must be >= 1, got {max_match_len}")
        if spec_factor < 0:
            raise ValueError(f"spec_factor must be >= 0, got {spec_factor}")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob}")
        if max_global_tokens < 0:
            raise ValueError(f"max_global_tokens must be >= 0, got {max_global_tokens}")
        if max_global_nodes < 1:
            raise ValueError(f"max_global_nodes must be >= 1 (the root), got {max_global_nodes}")
        self.max_match_len = max_match_len
        self.spec_factor = spec_factor
        self.spec_offset = spec_offset
        self.min_token_prob = min_token_prob
        self.max_global_tokens = max_global_tokens
        self.max_global_nodes = max_global_nodes
        self.depth = max_match_len + spec.num_draft_tokens
        self.global_trie = SuffixTrie(self.depth)
        self._global_streams: deque[_Stream] = deque()
        self._requests: dict[str, _Request] = {}

    def propose(self, batch: list[DraftInput]) -> list[Draft]:
        return [self._propose_one(inp) for inp in batch]

    def observe(self, outcomes: list[DraftOutcome]) -> None:
        for outcome in outcomes:
            req = self._requests.get(outcome.request_id)
            if req is not None:
                req.trie.extend(req.stream, outcome.committed)

    def release(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        output = req.stream.tokens[req.num_prompt_tokens :][: self.max_global_tokens]
        if not output:
            return
        trie = self.global_trie
        self._global_streams.append(trie.add(output))
        while self._global_streams and (
            trie.num_tokens > self.max_global_tokens or trie.num_nodes > self.max_global_nodes
        ):
            trie.remove(self._global_streams.popleft())

    def _propose_one(self, inp: DraftInput) -> Draft:
        req = self._synced(inp)
        k = min(self.spec.num_draft_tokens, inp.max_draft_tokens)
        if k < 1:
            return Draft.empty()
        best, best_score = [], 0.0
        # The request's own trie first: on equal scores its evidence is the more specific.
        for trie in (req.trie, self.global_trie):
            cursor, m = trie.longest_match(inp.token_ids, self.max_match_len)
            budget = min(k, int(m * self.spec_factor + self.spec_offset))
            if cursor is None or budget < 1:
                continue
            tokens, score = trie.draft(cursor, budget, self.min_token_prob)
            if score > best_score:
                best, best_score = tokens, score
        return Draft(token_ids=best)

    def _synced(self, inp: DraftInput) -> _Request:
        """The request's trie brought up to `token_ids` (the source of truth for the context).

        Normally `observe` has already appended everything; this also covers a first call (the trie
        is built lazily here), rounds observe never saw, and a context that shrank or changed (the
        trie is rebuilt rather than trusted).
        """
        req = self._requests.get(inp.request_id)
        ids = inp.token_ids
        have = len(req.stream.tokens) if req is not None else 0
        if req is None or have > len(ids) or (have and ids[have - 1] != req.stream.tokens[-1]):
            trie = SuffixTrie(self.depth)
            req = self._requests[inp.request_id] = _Request(trie, trie.open(), inp.num_prompt_tokens)
            have = 0
        if have < len(ids):
            req.trie.extend(req.stream, ids[have:])
        return req
