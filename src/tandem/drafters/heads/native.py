"""A draft layer's steps on tandem's block kernels: one native call per step for every request.

A served DraftBlock whose linears are 8-bit block linears (serving.serving_kernels) decodes through
the kernels the target's fused path uses, in one call (kernels.draft_layer) over the rows of all
the requests of a step: the attention input's norms fused into the qkv projection (one norm, or
EAGLE-3's two over [embedding | feature]); RoPE, the write of the new keys and values into each
request's RowCache and attention; the o projection with the residual add; the MLP norm fused into
gate_up; the activation fused into down with the residual add; and, for a head with its own
vocabulary projection, the norm before it and the logits of the rows that draft. The PyTorch path
runs about thirty small operators per step, and an earlier version of this one six native calls
plus the norms in torch: per draft token the Python between the kernels cost about twice the
kernels themselves.

What a query sees: a chain's rows (the default), each at a position after every key its cache
holds, see their cache up to their own slot; otherwise the kernel is given TreeKeys, a prefix of
cache slots [0, hi) and then a list of further slots. A tree node's are the committed prefix and
its own path; a DFlash block row's, the whole context and the whole block; an MTP module's, the
keys at least its gap behind it and its own. Drafts only propose, so the kernels' rounding (RoPE
from fp32 tables, fused norms) never reaches the output.
"""

from __future__ import annotations

import torch

from tandem.drafters.heads.block import DraftBlock, RowCache
from tandem.model.block_linear import BlockQ8Linear
from tandem.model.kernels import (
    GEGLU,
    IDENTITY,
    RMS_NORM,
    RMS_NORM_HALVES,
    SWIGLU,
    BlockKernels,
    BlockWeights,
    DecoderShape,
    DraftChain,
    DraftLayer,
    DraftRows,
    LayerParts,
    TreeKeys,
    block_kernels,
    decoder_layers,
)
from tandem.model.kernels.arena import place_contiguously

MIN_POSITIONS = 1024  # rope table rows built at first; doubled whenever a position needs more


class NativeBlock:
    """DraftBlock.step on the block kernels (see the module docstring). Build with `of`.

    input_norms: the RMSNorms the layer's attention input passes through first, fused into its
    qkv projection: none (the input comes normed), one, or two that each norm one half of the
    input (EAGLE-3's [embedding | feature]). vocab: (norm, projection) of a head's own vocabulary
    after the layer, whose logits `step` can return in the same call.
    """

    def __init__(self, block: DraftBlock, kernels: BlockKernels, input_norms: tuple[torch.nn.RMSNorm, ...] = (),
                 vocab: tuple[torch.nn.RMSNorm, BlockQ8Linear] | None = None) -> None:
        self.block, self.kernels = block, kernels
        self.qkv, self.o = block.qkv.blocks(kernels), block.o.blocks(kernels)
        self.gate_up, self.down = block.gate_up.blocks(kernels), block.down.blocks(kernels)
        self.mlp_norm, eps = _norm_parts(block.mlp_norm)
        activation = SWIGLU if block.activation == "silu" else GEGLU
        self.shape = DecoderShape(self.o.out_features, block.heads, block.kv_heads, block.head_dim, eps, block.scale,
                                  activation)
        self.attn_transform, self.attn_norm, self.attn_eps = _input_transform(input_norms)
        self.vocab = self.vocab_norm = None
        self.vocab_eps = 0.0
        if vocab is not None:
            norm, projection = vocab
            self.vocab = projection.blocks(kernels)
            self.vocab_norm, self.vocab_eps = _norm_parts(norm)
        self.cos = self.sin = torch.empty(0)
        self.layer: DraftLayer | None = None

    @classmethod
    def of(cls, block: DraftBlock, input_norms: tuple[torch.nn.RMSNorm, ...] = (),
           vocab: tuple[torch.nn.RMSNorm, torch.nn.Module] | None = None) -> "NativeBlock | None":
        """The native path of a served block, or None where it cannot run (no kernels, or
        linears that are not 8-bit blocks, e.g. a head trained and drafted on a GPU). A vocab
        projection that is not an 8-bit block linear stays out (its logits are then the
        caller's to compute)."""
        kernels = block_kernels()
        linears = (block.qkv, block.o, block.gate_up, block.down)
        if kernels is None or not all(isinstance(m, BlockQ8Linear) for m in linears):
            return None
        if vocab is not None and not isinstance(vocab[1], BlockQ8Linear):
            vocab = None
        return cls(block, kernels, input_norms, vocab)

    @property
    def has_vocab(self) -> bool:
        return self.vocab is not None

    @property
    def weights(self) -> list[BlockWeights]:
        """The layer's packed weights in the order a step reads them."""
        return [self.qkv, self.o, self.gate_up, self.down] + ([self.vocab] if self.vocab is not None else [])

    @staticmethod
    def stream_together(natives: "list[NativeBlock]") -> None:
        """A head's layers' weights in one buffer, in the order its steps read them
        (model/kernels/arena.py): every draft step streams them back to back."""
        place_contiguously([w for native in natives for w in native.weights])

    def _tables(self, positions: int) -> DraftLayer:
        """The layer record, with rope tables (cos and sign-folded sin [P, D], the layout the
        kernels read) for P > positions; rebuilt when a position needs longer tables."""
        if positions >= len(self.cos) or self.layer is None:
            size = max(MIN_POSITIONS, 2 * positions, len(self.cos))
            freqs = torch.arange(size, dtype=torch.float32).unsqueeze(-1) * self.block.inv_freq.float()
            emb = torch.cat((freqs, freqs), dim=-1)
            half = emb.shape[-1] // 2
            sin = emb.sin()
            self.cos = emb.cos().contiguous()
            self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).contiguous()
            parts = LayerParts(self.qkv, self.o, self.gate_up, self.down, self.attn_norm, self.mlp_norm, None,
                               self.cos, self.sin)
            self.layer = DraftLayer(decoder_layers([parts]), self.shape, self.attn_transform, self.attn_eps,
                                    self.vocab, self.vocab_norm, self.vocab_eps)
        return self.layer

    def step(self, x: torch.Tensor, attn_in: torch.Tensor, positions: torch.Tensor, caches: list[RowCache],
             masks: list | None = None, keep: bool = True, gap: int = 1, whole: bool = False,
             logits: str | torch.Tensor | None = None,
             placed: DraftRows | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """DraftBlock.step: R requests, t new rows each; x [R, t, H], attn_in [R, t, Din] (before
        the input norms), positions [R, t]. The rows' keys are written to each cache after its
        `length` slots; keep=False leaves `length` as it was (the slots are scratch: a draft
        query, a DFlash block). masks: per request [t, n] bool over the cache slots after the
        append, or the same visibility as TreeKeys (path_keys: cheaper to build); None: the
        positional rule of DraftBlock (a key is visible at its own slot or at a position <= the
        query's - gap). whole: every row sees every slot, the cache's and this step's (a DFlash
        block).

        Returns the output [R, t, H] and, with a vocab and logits "all", "last" or row indices
        into the flat [R * t] rows, the logits of every row [R * t, V'], of each request's last
        row [R, V'] or of the rows named (else None). placed: the rows' placement (`place`) when
        another layer's caches, at the same lengths and positions, already gave it."""
        R, t, H = x.shape
        out, out_logits = self.rows(x.reshape(R * t, H), attn_in.reshape(R * t, -1), positions.reshape(-1), [t] * R,
                                    caches, masks, keep, gap, whole, logits, placed)
        return out.reshape(R, t, H), out_logits

    def rows(self, x: torch.Tensor, attn_in: torch.Tensor, positions: torch.Tensor, counts: list[int],
             caches: list[RowCache], masks: list | None = None, keep: bool = True, gap: int = 1,
             whole: bool = False, logits: str | torch.Tensor | None = None,
             placed: DraftRows | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`step` over flat rows, request r's counts[r] rows after request r - 1's (ragged:
        several requests' catch-ups in one call): x [N, H], attn_in [N, Din], positions [N].
        Returns the output [N, H] and the logits `step` describes (indices into these N rows)."""
        out = x.float().contiguous().clone()
        rows_in = attn_in.float().contiguous()
        layer = self._tables(int(positions.max()) + 1)
        if placed is None:
            placed = self.place(positions, counts, caches, masks, gap, whole)
        for cache, t in zip(caches, counts):
            cache.reserve(t)
        logit_rows = logits
        if isinstance(logits, str) and logits == "last":
            logit_rows = torch.tensor(counts, dtype=torch.int64).cumsum(0) - 1
        out_logits = self.kernels.draft_layer(layer, out, rows_in, placed, [(c.k, c.v) for c in caches], logit_rows)
        start = 0
        for cache, t in zip(caches, counts):
            cache.positions[cache.length : cache.length + t] = positions[start : start + t]
            if keep:
                cache.length += t
            start += t
        return out, out_logits

    @staticmethod
    def place(positions: torch.Tensor, counts: list[int], caches: list[RowCache], masks: list | None = None,
              gap: int = 1, whole: bool = False) -> DraftRows:
        """Where `rows` puts request r's counts[r] rows at `positions` [N] (the slots after each
        cache's `length`) and which keys each reads (masks, gap, whole as in `step`). A function of
        the caches' lengths and positions only: a head's layers, whose caches advance together,
        share one placement per step."""
        pos = positions.to(torch.int64).cpu().contiguous()
        seq, slot, keys = [], [], []
        start = 0
        for r, (cache, t) in enumerate(zip(caches, counts)):
            own = positions[start : start + t]
            seq.extend([r] * t)
            slot.extend(range(cache.length, cache.length + t))
            if whole:
                keys.append(_all_keys(own, cache.length + t))
            elif masks is not None:
                keys.append(masks[r] if isinstance(masks[r], TreeKeys) else _mask_keys(masks[r], own))
            elif gap != 1 or not _after_cache(cache, own):
                slots = torch.arange(cache.length, cache.length + t, dtype=torch.int64)
                keys.append(_positional_keys(torch.cat([cache.positions[: cache.length].cpu(), own.cpu()]), slots, gap))
            else:
                keys.append(None)
            start += t
        tree = None if all(k is None for k in keys) else _joined(keys, pos, slot, counts)
        return DraftRows(torch.tensor(seq, dtype=torch.int64), torch.tensor(slot, dtype=torch.int64), pos, tree)

    def chain(self, feat: torch.Tensor, logits: torch.Tensor, caches: list[RowCache], positions: list[int],
              budgets: list[int], vocab_ids: torch.Tensor | None, embed: torch.Tensor,
              embed_scale: float) -> list[list[int]]:
        """Greedy drafts of R requests in one native call (kernels.draft_chain), for a layer
        whose raw input is [embedding | feature] with the feature as its residual stream
        (EAGLE-3) and that has its vocabulary head: from each request's feat [R, H] and logits
        [R, V'] (of its last fed row), argmax tokens (mapped through vocab_ids to target ids),
        each fed at positions[r] + s with the feature that produced it, until budgets[r] tokens
        or a logits row that is not finite. The steps' keys are written after each cache's
        `length`, which does not move (they are scratch: the next round's keys come from true
        features). Returns each request's draft tokens."""
        layer = self._tables(max(p + b for p, b in zip(positions, budgets)) + 1)
        for cache, budget in zip(caches, budgets):
            cache.reserve(budget)
        chain = DraftChain(feat.float().contiguous(), logits.float().contiguous(),
                           torch.tensor([c.length for c in caches], dtype=torch.int64),
                           torch.tensor(positions, dtype=torch.int64), torch.tensor(budgets, dtype=torch.int64),
                           None if vocab_ids is None else vocab_ids.to(torch.int64).contiguous(),
                           embed, float(embed_scale))
        tokens = self.kernels.draft_chain(layer, chain, [(c.k, c.v) for c in caches])
        return [[t for t in row if t >= 0] for row in tokens.tolist()]

    def trees(self, feat: torch.Tensor, logits: torch.Tensor, caches: list[RowCache], positions: list[int], topk: int,
              depths: list[int], vocab_ids: torch.Tensor | None, embed: torch.Tensor,
              embed_scale: float) -> list[tuple[list[int], list[int], list[float]]]:
        """R requests' EAGLE-2 trees in one native call (kernels.draft_tree), for the layers
        `chain` serves: from each request's feat [R, H] and logits [R, V'] (of its last fed row),
        depths[r] levels of the top-`topk` children of every frontier node, each request's `topk`
        most likely new nodes fed through the layer at positions[r] + level - 1 (all requests'
        in one layer call per level), each node seeing its cache and its own path. Returns per
        request the nodes (target ids), their parents (-1: the root) and path log-probabilities,
        as EagleDrafter's loop builds them; the levels' keys are scratch after each cache's
        `length`, which does not move."""
        layer = self._tables(max(p + d for p, d in zip(positions, depths)) + 1)
        for cache, depth in zip(caches, depths):
            cache.reserve(max(depth - 1, 0) * topk)
        return self.kernels.draft_tree(layer, feat.float().contiguous(), logits.float().contiguous(),
                                       [(c.k, c.v) for c in caches], topk, torch.tensor(depths, dtype=torch.int64),
                                       torch.tensor([c.length for c in caches], dtype=torch.int64),
                                       torch.tensor(positions, dtype=torch.int64),
                                       None if vocab_ids is None else vocab_ids.to(torch.int64).contiguous(), embed,
                                       float(embed_scale))

    def write_keys(self, attn_in: torch.Tensor, positions: torch.Tensor, counts: list[int], caches: list[RowCache],
                   norm: torch.nn.RMSNorm | None = None, placed: DraftRows | None = None) -> None:
        """Append the keys and values of rows attn_in [N, Din] at positions [N] to the caches,
        request r's counts[r] rows after request r - 1's, causally, without the rest of the layer
        (context rows whose outputs nobody reads): one qkv projection and one attention call for
        all requests. Their input goes to the qkv projection through `norm` (fused), not the
        input norms. placed: `place(positions, counts, caches)`, when another layer gave it."""
        k, blk = self.kernels, self.block
        rows = attn_in.float().contiguous()
        if norm is None:
            qkv = k.linear(rows, self.qkv)
        else:
            weight, eps = _norm_parts(norm)
            qkv = k.linear(rows, self.qkv, transform=RMS_NORM, norm_weight=weight, eps=eps)
        self._tables(int(positions.max()) + 1)
        if placed is None:
            placed = self.place(positions, counts, caches)
        for cache, t in zip(caches, counts):
            cache.reserve(t)
        k.attend_own_caches(qkv, placed, self.cos, self.sin, [(c.k, c.v) for c in caches], blk.heads, blk.kv_heads,
                            blk.scale)
        start = 0
        for cache, t in zip(caches, counts):
            cache.positions[cache.length : cache.length + t] = positions[start : start + t]
            cache.length += t
            start += t


def path_keys(prefix: int, paths: list[list[int]], positions: torch.Tensor) -> TreeKeys:
    """Rows that each see cache slots [0, prefix) and then the slots of their own path (root
    first, the row's own slot last), at rope positions [t]: a tree's frontier."""
    offsets = [0]
    for path in paths:
        offsets.append(offsets[-1] + len(path))
    return TreeKeys(positions.to(torch.int64).cpu(), torch.full((len(paths),), prefix, dtype=torch.int64),
                    torch.tensor(offsets, dtype=torch.int64), torch.tensor([s for p in paths for s in p], dtype=torch.int64))


def path_mask(prefix: int, paths: list[list[int]], slots: int) -> torch.Tensor:
    """path_keys as a [t, slots] bool mask (DraftBlock.step's form)."""
    mask = torch.zeros(len(paths), slots, dtype=torch.bool)
    mask[:, :prefix] = True
    for j, path in enumerate(paths):
        mask[j, path] = True
    return mask


def _input_transform(norms: tuple[torch.nn.RMSNorm, ...]) -> tuple[int, torch.Tensor | None, float]:
    """(transform, norm weight, eps) the qkv projection applies to the attention input."""
    if not norms:
        return IDENTITY, None, 0.0
    parts = [_norm_parts(norm) for norm in norms]
    if len(parts) == 1:
        return RMS_NORM, parts[0][0], parts[0][1]
    (wa, ea), (wb, eb) = parts if len(parts) == 2 else (None, None)
    if len(parts) != 2 or ea != eb or len(wa) != len(wb):
        raise ValueError("a draft layer's input takes one norm, or two of the same width and eps (one per half)")
    return RMS_NORM_HALVES, torch.cat([wa, wb]).contiguous(), ea


def _norm_parts(norm: torch.nn.RMSNorm) -> tuple[torch.Tensor, float]:
    """An RMSNorm's weight as the kernels read it, and its eps (torch's default when unset)."""
    eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
    return norm.weight.detach().float().contiguous(), eps


def _after_cache(cache: RowCache, positions: torch.Tensor) -> bool:
    """Whether rows at `positions` [t] come, in ascending order, after every key of the cache:
    then the positional rule at gap 1 lets each see exactly the slots up to its own."""
    rows = positions.tolist()
    if any(b <= a for a, b in zip(rows, rows[1:])):
        return False
    return cache.length == 0 or int(cache.positions[cache.length - 1]) < rows[0]


def _all_keys(positions: torch.Tensor, slots: int) -> TreeKeys:
    """Every row sees slots [0, slots): the cache and the whole block."""
    t = len(positions)
    return TreeKeys(positions.to(torch.int64).cpu(), torch.full((t,), slots, dtype=torch.int64),
                    torch.zeros(t + 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))


def _chain_keys(slots: list[int], positions: torch.Tensor) -> TreeKeys:
    """Each row sees the slots up to its own (what the kernel does without TreeKeys)."""
    t = len(slots)
    return TreeKeys(positions.to(torch.int64).cpu(), torch.tensor(slots, dtype=torch.int64) + 1,
                    torch.zeros(t + 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))


def _joined(keys: list[TreeKeys | None], pos: torch.Tensor, slot: list[int], counts: list[int]) -> TreeKeys:
    """The requests' TreeKeys (counts[r] rows each) as one over all rows of the call, a request
    without any getting its chain rule spelled out; key lists concatenated, their offsets shifted."""
    parts, start = [], 0
    for key, t in zip(keys, counts):
        parts.append(key if key is not None else _chain_keys(slot[start : start + t], pos[start : start + t]))
        start += t
    offsets, shift = [], 0
    for key in parts:
        offsets.append(key.key_off[:-1] + shift)
        shift += int(key.key_off[-1])
    offsets.append(torch.tensor([shift], dtype=torch.int64))
    return TreeKeys(torch.cat([k.pos for k in parts]), torch.cat([k.hi for k in parts]), torch.cat(offsets),
                    torch.cat([k.keys for k in parts]))


def _positional_keys(positions: torch.Tensor, slots: torch.Tensor, gap: int) -> TreeKeys:
    """positions [n]: every slot's position (ascending), the new rows' at `slots` included. A row
    sees the slots at positions <= its own - gap (a prefix, as positions ascend) and itself."""
    rows = positions[slots]
    hi = torch.searchsorted(positions, rows - gap, right=True)
    own = slots >= hi  # gap <= 0 puts the row's own slot inside the prefix already
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), own.to(torch.int64).cumsum(0)])
    return TreeKeys(rows, hi.to(torch.int64), offsets, slots[own].clone())


def _mask_keys(mask: torch.Tensor, positions: torch.Tensor) -> TreeKeys:
    """Each row's visible slots (a row of mask [t, n]) as a prefix [0, hi) and the rest listed."""
    his, rest = [], []
    for row in mask.to(torch.bool).cpu():
        hidden = (~row).nonzero()
        hi = int(hidden[0]) if len(hidden) else len(row)
        his.append(hi)
        rest.append(row[hi:].nonzero().flatten() + hi)
    offsets = torch.tensor([0] + [len(r) for r in rest], dtype=torch.int64).cumsum(0)
    keys = torch.cat(rest).to(torch.int64) if rest else torch.zeros(0, dtype=torch.int64)
    return TreeKeys(positions.to(torch.int64).cpu(), torch.tensor(his, dtype=torch.int64), offsets, keys)
