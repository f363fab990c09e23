"""The suffix trie behind suffix decoding (drafters/suffix.py) and its corpus (drafters/corpus.py):
every suffix of some token streams, cut at a depth, with how many suffixes pass through each node,
and the most frequent continuation of a matched context.
"""

from __future__ import annotations


class TrieStream:
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

    def __init__(self, depth: int, stream: TrieStream | None = None, offset: int = 0) -> None:
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
        # Counts whole streams added or removed (`extend` only appends to a stream): a match bound
        # from an earlier call (longest_match's at_most) holds while it stays the same.
        self.version = 0
        # Each node's most frequent child and its children's total count, remembered the first
        # time a draft passes and forgotten at the trie's next change (`changes`), instead of
        # rescanning children that can number thousands near the root: a corpus (frozen) keeps
        # them for good, the global trie of earlier answers until a request ends.
        self.changes = 0
        self._followed: dict[_Node, tuple[int, _Node, int]] = {}
        self._followed_at = 0
        self.frozen = False

    def freeze(self) -> None:
        """No more changes: extend, add and remove refuse from now on."""
        self.frozen = True

    def _change(self) -> None:
        """A change is about to be made: refused once frozen, else counted (`changes`)."""
        if self.frozen:
            raise RuntimeError("this suffix trie is frozen (a corpus is only read)")
        self.changes += 1

    def open(self) -> TrieStream:
        """A new, empty stream to `extend` token by token."""
        return TrieStream()

    def extend(self, stream: TrieStream, tokens: list[int]) -> None:
        self._change()
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

    def add(self, tokens: list[int]) -> TrieStream:
        """Insert a finished sequence; returns the handle `remove` takes."""
        stream = self.open()
        self.extend(stream, tokens)
        stream.frontier = None
        self.version += 1
        return stream

    def remove(self, stream: TrieStream) -> None:
        """Take every suffix of `stream` out again, dropping nodes no other suffix uses."""
        self._change()
        self.version += 1
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

    def longest_match(self, context: list[int], max_len: int, at_most: int | None = None) -> tuple[_Cursor | None, int]:
        """The longest tail of `context` (<= max_len) seen before with a continuation, and its length.

        A suffix of a string with a continuation has one too, so the property is monotone in the
        length and a binary search finds the longest in O(max_len log max_len). at_most: a bound
        the caller knows: the match of a context it extended by c tokens since an earlier call
        (same `version`, or its own stream grown by `extend`) is at most that call's match + c,
        because the new tail's first length - c tokens then matched with a continuation.
        """
        hi = min(max_len, len(context), self.max_depth - 1)
        if at_most is not None:
            hi = min(hi, at_most)
        lo, best = 0, None
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
                tok, child, total = self._most_frequent(node)
                prob *= child.count / total
                if prob < min_prob:
                    break
                node = child
            tokens.append(tok)
            score += prob
        return tokens, score

    def _most_frequent(self, node: _Node) -> tuple[int, _Node, int]:
        """(token, child) of the node's most frequent continuation, and its children's total count."""
        followed = self._followed
        if self._followed_at != self.changes:
            followed.clear()
            self._followed_at = self.changes
        found = followed.get(node)
        if found is None:
            tok, child = max(node.children.items(), key=lambda kv: kv[1].count)
            found = followed[node] = (tok, child, sum(c.count for c in node.children.values()))
        return found

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
