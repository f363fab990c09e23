"""The one forward entry point: new tokens + positions + attention structure per sequence -> logits.

Prefill, decode, chain verification and tree verification are the same call. The caller says which
new tokens need logits and which layers' hidden states it wants; nothing is implied.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import torch

from tandem.model.fused import FUSED_ROW_BUDGET, FusedDecoder
from tandem.model.kernels import TreeKeys
from tandem.model.kv_cache import KVCache
from tandem.model.transformer import AttentionPlan, AttentionSegment, TransformerLM
from tandem.types import GreedyRows, tree_paths


@dataclass
class SeqInput:
    """One sequence's part of a forward.

    parents: None for a causal chain (token t sees tokens < t); for a tree, parents[t] is the
    index of t's parent among the new tokens (-1 = hangs off the committed prefix), parents
    before children. positions default to consecutive positions after the committed prefix
    (trees: prefix_len + depth, so siblings share a position). logits: which new-token
    indices need logits ("last", "all", or a list).
    """

    seq: int
    token_ids: list[int]
    positions: list[int] | None = None
    parents: list[int] | None = None
    logits: str | list[int] = "last"

    def logit_indices(self) -> list[int]:
        if self.logits == "last":
            return [len(self.token_ids) - 1]
        if self.logits == "all":
            return list(range(len(self.token_ids)))
        return list(self.logits)


@dataclass
class ForwardOutput:
    """logits: [N, V] fp32, the requested rows sequence by sequence; rows of sequence b are
    logits[offsets[b]:offsets[b+1]]. stacked_hidden: [len(hidden_layers), R, H], the hidden
    states of every sequence's new tokens in input order for the requested layers (layer L = the
    final normed hidden state), sequence b's in rows bounds[b]:bounds[b+1]; flat_hidden[layer]:
    one layer's [R, H]; hidden[layer][b]: sequence b's [T_b, H] (views, made on first use: a
    caller keeping a few rows of every sequence indexes stacked_hidden instead, since a view per
    sequence and layer costs more than the rows)."""

    logits: torch.Tensor
    offsets: list[int]
    hidden_layers: tuple[int, ...] = ()
    stacked_hidden: torch.Tensor | None = None
    bounds: list[int] = field(default_factory=lambda: [0])
    # The logits rows' argmax and finiteness, where the LM head found them (the fused path).
    greedy: GreedyRows | None = None

    def rows(self, b: int) -> torch.Tensor:
        return self.logits[self.offsets[b] : self.offsets[b + 1]]

    def greedy_rows(self, b: int) -> GreedyRows | None:
        return None if self.greedy is None else self.greedy[self.offsets[b] : self.offsets[b + 1]]

    @functools.cached_property
    def flat_hidden(self) -> dict[int, torch.Tensor]:
        if self.stacked_hidden is None:
            return {}
        return {layer: self.stacked_hidden[i] for i, layer in enumerate(self.hidden_layers)}

    @functools.cached_property
    def hidden(self) -> dict[int, list[torch.Tensor]]:
        spans = list(zip(self.bounds, self.bounds[1:]))
        return {li: [h[a:b] for a, b in spans] for li, h in self.flat_hidden.items()}


def _stacked(by_layer: dict[int, torch.Tensor]) -> tuple[tuple[int, ...], torch.Tensor | None]:
    """Per-layer [R, H] rows as (their layers, one [layers, R, H] tensor)."""
    if not by_layer:
        return (), None
    return tuple(by_layer), torch.stack(list(by_layer.values()))


def ancestor_matrix(parents: list[int]) -> torch.Tensor:
    """[T, T] bool: entry (t, j) is True when node j is t itself or one of its ancestors."""
    n = len(parents)
    anc = torch.eye(n, dtype=torch.bool)
    for t, p in enumerate(parents):
        if p >= t:
            raise ValueError(f"tree parents must precede children; node {t} has parent {p}")
        if p >= 0:
            anc[t] |= anc[p]
    return anc


def _bounds(lengths: list[int]) -> list[int]:
    """Where each sequence's rows start in a forward's flat rows, and where the last ends."""
    return list(itertools.accumulate(lengths, initial=0))


def _pack_calls(inputs: list[SeqInput], budget: int) -> list[list[tuple[int, SeqInput]]]:
    """The inputs as native calls of at most `budget` rows, in order: (input index, piece). A chain
    fills the current call's room and continues in the next (its pieces stay in order, each
    call writing its keys before the next reads them); a tree is never split (a tree larger than
    the budget gets a call of its own)."""
    calls: list[list[tuple[int, SeqInput]]] = [[]]
    room = budget
    for b, inp in enumerate(inputs):
        n = len(inp.token_ids)
        if inp.parents is not None:
            if n > room and calls[-1]:
                calls.append([])
                room = budget
            calls[-1].append((b, inp))
            room -= n
            continue
        wanted = inp.logit_indices()
        a = 0
        while a < n:
            if room <= 0:
                calls.append([])
                room = budget
            take = min(room, n - a)
            positions = None if inp.positions is None else inp.positions[a : a + take]
            calls[-1].append((b, SeqInput(inp.seq, inp.token_ids[a : a + take], positions, None,
                                          [i - a for i in wanted if a <= i < a + take])))
            room -= take
            a += take
    return calls


# The most logits rows a forward finds the argmax of with its LM head (GreedyRows): a batch's
# verification rows; a prompt's logprobs ask for more and need none.
GREEDY_ROWS = 256


class ModelRunner:
    def __init__(self, model: TransformerLM, cache: KVCache, fused: bool = True) -> None:
        """fused=False keeps the general path where the fused CPU kernels could run (to compare
        the two)."""
        self.model = model
        self.cache = cache
        self.device = cache.k.device
        model.build_rope_tables(cache.max_len + 1)
        self.fused = FusedDecoder.for_model(model) if fused and self.device.type == "cpu" else None
        if self.fused is not None:
            cache.block_keys()  # the layout the fused kernels score 16 keys at a time from
        self.windows = sorted(set(model.cfg.layer_windows), key=lambda w: -1 if w is None else w)

    def verify_rows(self, lengths) -> int:
        """The token rows a forward over sequences of these new-token counts computes: their sum
        on the fused path (flat rows), every sequence padded to the longest on the general one."""
        if self.fused is not None:
            return sum(lengths)
        return len(lengths) * max(lengths, default=0)

    @property
    def batch_invariant(self) -> bool:
        """Whether a token's numbers are the same whatever else shares its forward and however a
        prompt is split (the fused path): then prompts may be prefilled in chunks, bit for bit."""
        return self.fused is not None

    @torch.inference_mode()
    def forward(
        self, inputs: list[SeqInput], hidden_layers: tuple[int, ...] = (), token_by_token: bool = False
    ) -> ForwardOutput:
        """Run new tokens through the model, writing their KV at the end of each sequence.

        Chains attend sequence by sequence (no padding reaches attention), so a sequence's
        numbers do not depend on what else is in the batch. token_by_token additionally gives
        each new token its own attention call over exactly the keys it would see if decoded
        alone: a verification forward then reproduces plain decoding bit for bit wherever the
        linears are row-independent (the int4/int8 kernels are; MKL's fp32 GEMM is not quite).
        Tree nodes (SeqInput.parents) with token_by_token read the prefix and then their own
        path, in the order decoding that path would read them after `KVCache.commit_path`: an
        accepted path's numbers are plain decoding's. Without token_by_token trees run as one
        padded, masked call.
        """
        if not inputs:
            raise ValueError("forward needs at least one sequence")
        for inp in inputs:
            if not inp.token_ids:
                raise ValueError(f"sequence {inp.seq} has no new tokens")
        T = max(len(i.token_ids) for i in inputs)
        for inp in inputs:
            if inp.parents is not None and inp.positions is None:
                inp.positions = [self.cache.lengths[inp.seq] + len(path) - 1 for path in tree_paths(inp.parents)]
        # On the fused path every forward (prompts, decoding, verification) is token by token:
        # one set of numbers for every token, whatever else shares the call.
        if self.fused is not None and all(i.positions is None or i.parents is not None for i in inputs):
            return self._forward_fused(inputs, hidden_layers)
        model, cache = self.model, self.cache
        if cache.keys_blocked:
            raise ValueError("this forward needs the general path, which reads keys stored [M, D], but the fused "
                             "kernels' cache stores them in blocks (positions without tree parents are not supported "
                             "on the fused path)")
        B = len(inputs)
        starts = [cache.reserve(i.seq, len(i.token_ids)) for i in inputs]
        try:
            plan, tokens, positions = self._plan(inputs, starts, T, token_by_token)
        except Exception:
            for inp, start in zip(inputs, starts):
                cache.truncate(inp.seq, start)
            raise
        x = model.embed_tokens(tokens)
        L = model.cfg.num_layers
        lens = [len(inp.token_ids) for inp in inputs]

        def unpadded(h: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> the real rows [sum lens, H]
            return h.reshape(B * T, -1) if min(lens) == T else torch.cat([h[b, :n] for b, n in enumerate(lens)])

        hidden: dict[int, torch.Tensor] = {}
        for li, layer in enumerate(model.layers):
            x = layer(x, plan, cache.layers[li])
            if li in hidden_layers:
                hidden[li] = unpadded(x)
        rows, offsets = [], [0]
        for b, inp in enumerate(inputs):
            idx = inp.logit_indices()
            rows.extend(b * T + t for t in idx)
            offsets.append(offsets[-1] + len(idx))
        flat = x.reshape(B * T, -1)
        if L in hidden_layers:
            hidden[L] = unpadded(model.norm(x))
        return ForwardOutput(self._logits(flat, rows)[0], offsets, *_stacked(hidden), _bounds(lens))

    def _logits(self, x: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, GreedyRows | None]:
        """Logits of the rows of x the inputs asked for ([0, V] when none did: a prompt chunk),
        and on the fused path, for up to GREEDY_ROWS of them, their argmax and finiteness from
        the same call (a prompt's logprobs ask for more rows, and need neither)."""
        if not rows:
            return torch.empty(0, self.model.cfg.vocab_size, device=x.device), None
        first = rows[0]
        if rows == list(range(first, first + len(rows))):  # a decode step, chains' verification: a view
            selected = x[first : first + len(rows)]
        else:
            selected = x[torch.tensor(rows, dtype=torch.long, device=x.device)]
        # One function for every forward's logits: with the fused decoder, its native norm + head.
        if self.fused is None:
            return self.model.logits(selected), None
        if len(rows) <= GREEDY_ROWS:
            return self.fused.logits_and_argmax(selected)
        return self.fused.logits(selected), None

    def _forward_fused(self, inputs: list[SeqInput], hidden_layers: tuple[int, ...]) -> ForwardOutput:
        """Chains and trees through the fused kernels (see fused.py), packed into as few native
        calls of at most FUSED_ROW_BUDGET rows as they fit: a chain longer than a call's room
        (a prompt) continues in the next call, a tree runs whole. Every call reads all the
        weights, so a batch of many short drafts must not become a call per sequence; splitting
        changes no number (every token reads exactly its own keys, the linears are
        row-independent)."""
        if sum(len(i.token_ids) for i in inputs) <= FUSED_ROW_BUDGET:
            return self._fused_call(inputs, hidden_layers)
        logits: list[list[torch.Tensor]] = [[] for _ in inputs]
        greedy: list[list[GreedyRows | None]] = [[] for _ in inputs]
        outs = []
        for call in _pack_calls(inputs, FUSED_ROW_BUDGET):
            out = self._fused_call([piece for _, piece in call], hidden_layers)
            outs.append(out)
            for j, (b, _) in enumerate(call):
                logits[b].append(out.rows(j))
                greedy[b].append(out.greedy_rows(j))
        offsets = [0]
        for rows in logits:
            offsets.append(offsets[-1] + sum(r.shape[0] for r in rows))
        # The calls hold the inputs' rows in input order (a chain continues at the start of the
        # next call), so their rows one after another are every sequence's in order.
        stacked = torch.cat([o.stacked_hidden for o in outs], dim=1) if outs[0].stacked_hidden is not None else None
        return ForwardOutput(torch.cat([r for rows in logits for r in rows]), offsets, outs[0].hidden_layers,
                             stacked, _bounds([len(i.token_ids) for i in inputs]),
                             GreedyRows.cat([g for parts in greedy for g in parts]))

    def _fused_call(self, inputs: list[SeqInput], hidden_layers: tuple[int, ...]) -> ForwardOutput:
        """One native call over flat rows, one attention per token. (The cache's slot positions
        are the general path's, for its masks; the kernels take a tree node's position from
        TreeKeys and a chain token's from its slot, so nothing here writes them.)"""
        cache, model = self.cache, self.model
        tokens, seqs, slots, rows, offsets, bounds = [], [], [], [], [0], [0]
        trees = any(i.parents is not None for i in inputs)
        pos, his, key_off, keys = [], [], [0], []  # TreeKeys, built only when a tree is present
        for inp in inputs:
            n = len(inp.token_ids)
            start = cache.reserve(inp.seq, n)
            if trees:
                positions = range(start, start + n) if inp.positions is None else inp.positions
                pos.extend(positions)
                if inp.parents is None:
                    his.extend(range(start + 1, start + n + 1))
                    key_off.extend([key_off[-1]] * n)
                else:
                    self._check_tree_window(inp, list(positions))
                    for path in tree_paths(inp.parents):
                        his.append(start)
                        keys.extend(start + node for node in path)
                        key_off.append(len(keys))
            base = len(tokens)
            tokens.extend(inp.token_ids)
            seqs.extend([inp.seq] * n)
            slots.extend(range(start, start + n))
            if inp.logits == "last":
                rows.append(base + n - 1)
            else:
                rows.extend(base + t for t in inp.logit_indices())
            offsets.append(len(rows))
            bounds.append(base + n)
        tree = None
        if trees:
            tree = TreeKeys(torch.tensor(pos), torch.tensor(his), torch.tensor(key_off), torch.tensor(keys, dtype=torch.long))
        columns = torch.tensor([tokens, seqs, slots])  # one tensor, three contiguous rows
        x, layers, stacked = self.fused.forward(columns[0], columns[1], columns[2], cache, hidden_layers, tree)
        L = model.cfg.num_layers
        if L in layers:
            stacked[layers.index(L)] = model.norm(x)
        logits, greedy = self._logits(x, rows)
        return ForwardOutput(logits, offsets, layers, stacked, bounds, greedy)

    def _plan(self, inputs: list[SeqInput], starts: list[int], T: int, token_by_token: bool):
        cache, device = self.cache, self.device
        B = len(inputs)
        lens = [len(i.token_ids) for i in inputs]
        pos_rows, tok_rows = [], []
        for inp, start, n in zip(inputs, starts, lens):
            pos = inp.positions if inp.positions is not None else range(start, start + n)
            if len(pos) != n:
                raise ValueError(f"sequence {inp.seq}: {n} tokens but {len(pos)} positions")
            pad = T - n
            pos_rows.append(list(pos) + [0] * pad)
            tok_rows.append(list(inp.token_ids) + [0] * pad)
        tokens = torch.tensor(tok_rows, dtype=torch.long, device=device)
        positions = torch.tensor(pos_rows, dtype=torch.long, device=device)
        if int(positions.max()) > cache.max_len:
            raise ValueError(f"position {int(positions.max())} exceeds max_model_len {cache.max_len}")
        for b, (inp, start, n) in enumerate(zip(inputs, starts, lens)):
            cache.slot_positions[inp.seq, start : start + n] = positions[b, :n]
        cos, sin = self.model.rope(positions)
        valid = None
        if any(n != T for n in lens):
            valid = torch.zeros(B, T, dtype=torch.bool, device=device)
            for b, n in enumerate(lens):
                valid[b, :n] = True
        plan = AttentionPlan(
            # B = 1 writes through a plain slice (write_fast); flat coordinates only for batches.
            write_seq=None if B == 1 else torch.tensor([i.seq for i, n in zip(inputs, lens) for _ in range(n)], device=device),
            write_slot=None if B == 1 else torch.tensor([s + t for s, n in zip(starts, lens) for t in range(n)], device=device),
            valid=valid,
            write_fast=(inputs[0].seq, starts[0]) if B == 1 else None,
            cos=cos,
            sin=sin,
        )
        if token_by_token or all(i.parents is None for i in inputs):
            plan.segments = self._segments(inputs, starts, lens, positions, token_by_token)
        else:
            plan.read_seqs = torch.tensor([i.seq for i in inputs], device=device)
            plan.read_len = max(s + n for s, n in zip(starts, lens))
            plan.masks = {w: self._mask(inputs, starts, lens, T, plan.read_len, positions, w) for w in self.windows}
        return plan, tokens, positions

    def _segments(self, inputs, starts, lens, positions, token_by_token) -> list[AttentionSegment]:
        """Attention calls for chains. A single query at position p sees slots [lo, p + 1) with
        lo = p - window + 1 for sliding-window layers: a slice, no mask, exactly what one-token
        decoding computes. A multi-token segment (prefill) is one causal call: with no prefix,
        a plain causal one (no mask, so attention skips the hidden half) wherever no sliding
        window cuts it; else a masked one."""
        segments = []
        for b, (inp, start, n) in enumerate(zip(inputs, starts, lens)):
            if inp.parents is not None:
                self._check_tree_window(inp, positions[b, :n].tolist())
                for t, path in enumerate(tree_paths(inp.parents)):
                    lo = {w: 0 if w is None else max(0, int(positions[b, t]) - w + 1) for w in self.windows}
                    keys = torch.tensor([start + node for node in path], device=self.device)
                    segments.append(AttentionSegment(b, inp.seq, t, t + 1, start, lo, dict.fromkeys(self.windows), keys))
            elif token_by_token or n == 1:
                for t in range(n):
                    p = start + t
                    lo = {w: 0 if w is None else max(0, int(positions[b, t]) - w + 1) for w in self.windows}
                    segments.append(AttentionSegment(b, inp.seq, t, t + 1, p + 1, lo, dict.fromkeys(self.windows)))
            else:
                hi = start + n
                causal = start == 0
                masks = {w: None if causal and (w is None or n <= w)
                         else self._mask([inp], [start], [n], n, hi, positions[b : b + 1, :n], w) for w in self.windows}
                segments.append(AttentionSegment(b, inp.seq, 0, n, hi, dict.fromkeys(self.windows, 0), masks,
                                                 causal=causal))
        return segments

    def _check_tree_window(self, inp: SeqInput, positions: list[int]) -> None:
        """Token by token, a tree node reads its whole path: every path must fit in the
        narrowest sliding window (a depth of thousands is no draft anyone makes)."""
        narrowest = min((w for w in self.windows if w is not None), default=None)
        if narrowest is not None and max(positions) - min(positions) >= narrowest:
            raise ValueError(f"sequence {inp.seq}: a tree deeper than the sliding window ({narrowest})")

    def _mask(self, inputs, starts, lens, T, read_len, positions, window) -> torch.Tensor | None:
        """[B, 1, T, read_len] bool attention mask, or None when every key is visible.

        For sequence b with committed prefix length s and n new tokens written at slots
        s..s+n-1: new token t sees all prefix slots (j < s) and the new slots of its ancestors
        (chains: tokens <= t); a sliding window further hides keys with q_pos - k_pos >= window.
        """
        B = len(inputs)
        if B == 1 and T == 1 and (window is None or int(positions.max()) < window):
            return None
        mask = torch.zeros(B, T, read_len, dtype=torch.bool, device=self.device)
        rows = torch.arange(T, device=self.device).unsqueeze(1)
        for b, (inp, s, n) in enumerate(zip(inputs, starts, lens)):
            mask[b, :, :s] = True
            if inp.parents is None:
                mask[b, :, s : s + n] = torch.arange(n, device=self.device).unsqueeze(0) <= rows
            else:
                if len(inp.parents) != n:
                    raise ValueError(f"sequence {inp.seq}: {n} tokens but {len(inp.parents)} parents")
                mask[b, :n, s : s + n] = ancestor_matrix(inp.parents).to(self.device)
        if window is not None:
            key_pos = torch.stack([self.cache.slot_positions[i.seq, :read_len] for i in inputs])  # [B, S]
            in_window = positions.unsqueeze(-1) - key_pos.unsqueeze(1) < window  # [B, T, S]
            mask &= in_window
        for b, n in enumerate(lens):
            mask[b, n:, 0] = True  # padding rows see one slot so their softmax stays finite
        return mask.unsqueeze(1)
