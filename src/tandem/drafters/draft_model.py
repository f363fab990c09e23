"""Separate draft model (docs/algorithms.md section 3): a smaller LM with the target's tokenizer drafts k tokens.

The draft model runs on its own KV cache (`DraftLM`, shared with the cross-tokenizer drafter). Each
round a request's cache row is rolled back to the longest prefix it shares with the committed
context (dropping rejected drafts), caught up, and then extended one draft forward per position.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from tandem.config import SpecConfig
from tandem.drafters.base import Drafter, DraftInput, TargetInfo, register
from tandem.drafters.heads.io import is_head_dir, materialize_draft_model
from tandem.drafters.heads.io import shipped_head_dir
from tandem.model.kv_cache import KVCache
from tandem.model.loader import LoadedModel, load_model
from tandem.model.runner import ModelRunner, SeqInput
from tandem.sampling import NonFiniteLogitsError, row_argmax, sample_processed
from tandem.types import Draft

# TargetInfo carries no context length or batch size: the draft cache holds the engine's default
# context (EngineConfig.max_model_len) and starts with one row, doubled whenever all are taken, so
# its memory follows the number of concurrent requests.
DRAFT_MAX_LEN = 2048
DRAFT_INITIAL_SEQS = 1
# Catch-ups longer than this (first-round prefills) run in their own forward, so that the usual
# one- or two-token catch-ups of running requests are not padded to a prompt's length.
LONG_CATCH_UP = 16

# choose(rows, logits [R, V]) -> one token per row (-1 ends that row's draft); rows index the
# requests given to DraftLM.extend.
Chooser = Callable[[list[int], torch.Tensor], list[int]]


def load_draft_model(path: str, target: TargetInfo) -> LoadedModel:
    """The one place model-based drafters load their model (tests substitute a tiny one here)."""
    return load_model(path, quantization="auto", device=target.device)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists.

    Binary search over slice comparisons (C speed, O(n) in total) instead of a Python loop over a
    context of thousands of tokens: the invariant is a[:lo] == b[:lo] and a[:hi] != b[:hi].
    """
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _Row:
    """One request's cache row; `tokens` are exactly the tokens whose KV the row holds."""

    __slots__ = ("seq", "tokens")

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.tokens: list[int] = []


class DraftLM:
    """A draft model on its own KV cache, extending many requests' contexts in lockstep."""

    def __init__(self, loaded: LoadedModel, device: str, max_len: int = DRAFT_MAX_LEN,
                 max_seqs: int = DRAFT_INITIAL_SEQS) -> None:
        self.loaded = loaded
        self.cache = KVCache(loaded.config, max_seqs, max_len, loaded.dtype, device, loaded.kv_dtype(device))
        self.runner = ModelRunner(loaded.model, self.cache)
        self._rows: dict[str, _Row] = {}

    def release(self, request_id: str) -> None:
        row = self._rows.pop(request_id, None)
        if row is not None:
            self.cache.release(row.seq)

    def extend(self, requests: list[tuple[str, list[int], int]], choose: Chooser) -> list[list[int]]:
        """For each (request_id, context ids, n): up to n tokens continuing the context.

        Round structure: forward 1 feeds each row what it has not cached (after rolling it back to
        the common prefix) and yields the first draft token; forward j > 1 feeds draft token j - 1.
        The last draft token is never fed, so its KV is absent and the next round's catch-up
        (or rollback) starts from a cache that holds only tokens it has actually seen.
        """
        out: list[list[int]] = [[] for _ in requests]
        budget: dict[int, int] = {}
        feeds: dict[int, list[int]] = {}
        for i, (request_id, ids, n) in enumerate(requests):
            # The row ends at len(ids) + n - 1 tokens: the last draft token is not fed.
            n = min(n, self.cache.max_len - len(ids) + 1)
            if n < 1 or not ids:
                continue
            row = self._row(request_id)
            # Re-feed at least the last context token: its logits give the first draft token.
            keep = min(common_prefix_len(row.tokens, ids), len(ids) - 1)
            self.cache.truncate(row.seq, keep)
            del row.tokens[keep:]
            feeds[i], budget[i] = ids[keep:], n
        while feeds:
            order = list(feeds)
            logits = self._forward([(self._rows[requests[i][0]], feeds[i]) for i in order])
            next_feeds = {}
            for i, token in zip(order, choose(order, logits)):
                if token < 0:
                    continue
                out[i].append(token)
                if len(out[i]) < budget[i]:
                    next_feeds[i] = [token]
            feeds = next_feeds
        return out

    def _row(self, request_id: str) -> _Row:
        row = self._rows.get(request_id)
        if row is None:
            if not self.cache.num_free:
                self._grow()
            row = self._rows[request_id] = _Row(self.cache.allocate())
        return row

    def _grow(self) -> None:
        """Twice the rows, keeping every row's contents and index (only called when all are taken)."""
        old = self.cache
        n = old.max_seqs
        new = KVCache(self.loaded.config, 2 * n, old.max_len, self.loaded.dtype, old.k.device, old.k.dtype)
        runner = ModelRunner(self.loaded.model, new)  # first: it may choose the keys' layout
        for _ in range(n):  # a fresh cache hands out rows 0, 1, ...: the same ids the full one uses
            new.allocate()
        new.k[:, :n] = old.k
        new.v[:, :n] = old.v
        new.slot_positions[:n] = old.slot_positions
        new.lengths[:n] = old.lengths
        self.cache, self.runner = new, runner

    def _forward(self, items: list[tuple[_Row, list[int]]]) -> torch.Tensor:
        """Feed each row its tokens; logits [len(items), V] after each row's last token."""
        short = [j for j, (_, feed) in enumerate(items) if len(feed) <= LONG_CATCH_UP]
        long = [j for j, (_, feed) in enumerate(items) if len(feed) > LONG_CATCH_UP]
        parts, order = [], []
        for group in (short, long):
            if group:
                out = self.runner.forward([SeqInput(items[j][0].seq, items[j][1]) for j in group])
                parts.append(out.logits)
                order.extend(group)
        for row, feed in items:
            row.tokens.extend(feed)
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts)[torch.tensor(order).argsort()]


def check_same_vocab(draft: LoadedModel, target: TargetInfo) -> None:
    """Refuse a draft model whose token ids mean something else to the target.

    With both tokenizers at hand, every token the smaller vocabulary holds must have the same id
    in the larger one (vocab sizes may then differ by padding or extra special tokens); without
    them, the model vocab sizes must match.
    """
    t_tok, d_tok = target.tokenizer, draft.tokenizer
    if hasattr(t_tok, "get_vocab") and hasattr(d_tok, "get_vocab"):
        small, large = sorted((t_tok.get_vocab(), d_tok.get_vocab()), key=len)
        compatible = all(large.get(token) == i for token, i in small.items())
        what = "its tokenizer differs from the target's"
    else:
        compatible = draft.config.vocab_size == target.vocab_size
        what = f"its vocab size {draft.config.vocab_size} differs from the target's {target.vocab_size}"
    if not compatible:
        raise ValueError(
            f"draft model {draft.name!r} cannot draft for {target.model_name or 'the target'}: {what}. "
            "Use speculative algorithm 'cross_tokenizer' for a draft model with another tokenizer."
        )


@register("draft_model")
class DraftModelDrafter(Drafter):
    """k tokens from a same-tokenizer draft model: argmax under greedy, else sampled from q."""

    def __init__(self, spec: SpecConfig, target: TargetInfo) -> None:
        super().__init__(spec, target)
        path = spec.draft_model_path or shipped_head_dir(target.model_name, "draft_model")
        if not path:
            raise ValueError("draft_model drafter needs a draft model: set draft_model_path (speculative_draft_model_path) "
                             f"to a model directory or a `tandem train --method draft_model` output; tandem ships none "
                             f"for {target.model_name or 'this target'}")
        if is_head_dir(path):  # trained layers only: add the target's embedding once, cached
            path = materialize_draft_model(path, target)
        loaded = load_draft_model(str(path), target)
        check_same_vocab(loaded, target)
        self.lm = DraftLM(loaded, target.device)
        # Draft logits are cut (extra ids never proposed) or q zero-padded to the target's vocab.
        self.vocab = min(loaded.config.vocab_size, target.vocab_size)
        # A target id the draft model has no embedding for (a padding row of a larger target
        # vocab) is fed as the draft's unknown token, so the request keeps drafting.
        self.stand_in = getattr(loaded.tokenizer, "unk_token_id", None) or 0

    def propose(self, batch: list[DraftInput]) -> list[Draft]:
        q_rows: list[list[torch.Tensor]] = [[] for _ in batch]
        seen = [self._seen(inp) for inp in batch]

        def choose(rows: list[int], logits: torch.Tensor) -> list[int]:
            logits = logits[:, : self.vocab]
            tokens = [-1] * len(rows)
            plain = [j for j, i in enumerate(rows) if batch[i].params.greedy and seen[i] is None]
            if plain:  # the common case: one argmax for every plain-greedy request
                for j, token in zip(plain, row_argmax(logits[plain]).tolist()):
                    tokens[j] = token
            for j, i in enumerate(rows):
                if tokens[j] >= 0:
                    continue
                params = batch[i].params
                try:  # greedy with a repetition penalty: the argmax of the penalised row (one-hot q)
                    q, tokens[j] = sample_processed(logits[j : j + 1], params, batch[i].generator, seen[i])  # [1, V_d]
                except NonFiniteLogitsError:
                    continue  # a broken draft row ends this draft; the target decides alone
                if not params.greedy:
                    q_rows[i].append(F.pad(q, (0, self.target.vocab_size - q.shape[-1])))
            return tokens

        k = self.spec.num_draft_tokens
        requests = [(inp.request_id, self._draft_ids(inp.token_ids), min(k, inp.max_draft_tokens)) for inp in batch]
        drafted = self.lm.extend(requests, choose)
        return [
            Draft(tokens, torch.cat(q_rows[i]) if q_rows[i] else None)
            for i, tokens in enumerate(drafted)
        ]

    def release(self, request_id: str) -> None:
        self.lm.release(request_id)

    def _draft_ids(self, ids: list[int]) -> list[int]:
        draft_vocab = self.lm.loaded.config.vocab_size
        if not ids or max(ids) < draft_vocab:
            return ids
        return [t if t < draft_vocab else self.stand_in for t in ids]

    def _seen(self, inp: DraftInput) -> torch.Tensor | None:
        """The context's distinct ids when a repetition penalty applies, as the target sees them."""
        if inp.params.repetition_penalty == 1.0:
            return None
        return torch.tensor(sorted(t for t in set(inp.token_ids) if t < self.vocab), dtype=torch.long)
