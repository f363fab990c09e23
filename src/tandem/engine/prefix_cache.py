"""Prefix caching: the KV-cache rows of finished requests, kept so that a new prompt starting with
the same tokens (a shared system prompt, a multi-turn chat, an agent re-sending its transcript)
copies their keys and values instead of computing them again.

Bookkeeping only; the engine copies the rows (KVCache.copy_prefix) and evicts the least recently
used row when it needs a free row or the token budget. Reuse is exact only where a token's KV does
not depend on how it was computed (prompt, decoding, verification, alone or batched): the fused
CPU path, where admission enables it (Admission.prefix_cache).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass
class CachedRow:
    """A cache row kept after its request: the tokens whose keys and values it holds, in order,
    and their hidden states for drafters that read them ({layer: [len(tokens), H]}, or {})."""

    seq: int
    tokens: list[int]
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case of a re-sent transcript: one C-level comparison
        return n
    lo, hi = 0, n  # the first difference by bisection over slice comparisons
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def longest_shared_prefix(prompt: list[int], holders, at_least: int = 0):
    """Of (holder, tokens) pairs, the holder whose tokens share the longest prefix with `prompt`,
    and that length, when it exceeds `at_least` (else (None, at_least)). At most len(prompt) - 1:
    the last prompt token is always computed, its logits give the first output token."""
    best, best_len = None, at_least
    reusable = prompt[:-1]
    for holder, tokens in holders:
        n = common_prefix_len(tokens, reusable)
        if n > best_len:
            best, best_len = holder, n
    return best, best_len


class PrefixCache:
    def __init__(self) -> None:
        self._rows: OrderedDict[int, CachedRow] = OrderedDict()  # least recently used first
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of those, tokens whose KV was reused

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def tokens_held(self) -> int:
        return sum(len(r.tokens) for r in self._rows.values())

    def add(self, row: CachedRow) -> None:
        self._rows[row.seq] = row

    def longest_prefix(self, prompt: list[int]) -> tuple[CachedRow | None, int]:
        """The kept row sharing the longest prefix with `prompt`, and that length."""
        return longest_shared_prefix(prompt, ((row, row.tokens) for row in self._rows.values()))

    def record(self, prompt_len: int, reused: int, row: CachedRow | None) -> None:
        """Count a lookup; a used row becomes the most recently used."""
        self.queried_tokens += prompt_len
        self.hit_tokens += reused
        if row is not None and reused and row.seq in self._rows:  # (a row taken over is gone)
            self._rows.move_to_end(row.seq)

    def record_shared(self, tokens: int) -> None:
        """Count prompt tokens whose KV a request copied from a live request's row."""
        self.hit_tokens += tokens

    def evict(self, keep: int | None = None) -> CachedRow | None:
        """Remove and return the least recently used row other than row `keep`, or None."""
        for seq in self._rows:
            if seq != keep:
                return self._rows.pop(seq)
        return None

    def take(self, seq: int) -> CachedRow:
        return self._rows.pop(seq)
