"""A draft layer's steps on tandem's block kernels: native calls instead of per-op PyTorch.

A served DraftBlock whose linears are 8-bit block linears (serving.serving_kernels) decodes through
the kernels the target's fused path uses: the qkv projection; RoPE, the write of the new keys and
values into the request's RowCache and attention, in one call (kernels.attend); the o projection
with the residual add; the MLP norm fused into gate_up; the activation fused into down with the
residual add. A step costs four linears over all requests' rows together plus one attention call
per request, whatever the batch, where the PyTorch path runs about thirty small operators.

What a query sees is given to the kernel as TreeKeys: a prefix of cache slots [0, hi) and then a
list of further slots. A chain step's query sees [0, its own slot]; a tree node's, the committed
prefix and its own path; a DFlash block row's, the whole context and the whole block; an MTP
module's, the keys at least its gap behind it and its own. Drafts only
propose, so the kernels' rounding (RoPE from fp32 tables, fused norms) never reaches the output.
"""

from __future__ import annotations

import torch

from tandem.drafters.heads.block import DraftBlock, RowCache
from tandem.model.block_linear import BlockQ8Linear
from tandem.model.kernels import (
    GEGLU,
    RMS_NORM,
    SWIGLU,
    BlockKernels,
    TreeKeys,
    block_kernels,
)

MIN_POSITIONS = 1024  # rope table rows built at first; doubled whenever a position needs more


class NativeBlock:
    """DraftBlock.step on the block kernels (see the module docstring). Build with `of`."""

    def __init__(self, block: DraftBlock, kernels: BlockKernels) -> None:
        self.block, self.kernels = block, kernels
        self.qkv, self.o = block.qkv.blocks(kernels), block.o.blocks(kernels)
        self.gate_up, self.down = block.gate_up.blocks(kernels), block.down.blocks(kernels)
        self.mlp_norm, self.eps = _norm_parts(block.mlp_norm)
        self.activation = SWIGLU if block.activation == "silu" else GEGLU
        self.cos = self.sin = torch.empty(0)

    @classmethod
    def of(cls, block: DraftBlock) -> "NativeBlock | None":
        """The native path of a served block, or None where it cannot run (no kernels, or
        linears that are not 8-bit blocks, e.g. a head trained and drafted on a GPU)."""
        kernels = block_kernels()
        linears = (block.qkv, block.o, block.gate_up, block.down)
        if kernels is None or not all(isinstance(m, BlockQ8Linear) for m in linears):
            return None
        return cls(block, kernels)

    @classmethod
    def all_of(cls, blocks: list[DraftBlock]) -> "list[NativeBlock] | None":
        """The native paths of a head's blocks, or None unless every one of them has one."""
        natives = [cls.of(block) for block in blocks]
        return natives if all(n is not None for n in natives) else None

    def _tables(self, positions: int) -> None:
        """cos and sign-folded sin [P, D] (the layout kernels.attend reads) for P > positions."""
        if positions < len(self.cos):
            return
        size = max(MIN_POSITIONS, 2 * positions)
        freqs = torch.arange(size, dtype=torch.float32).unsqueeze(-1) * self.block.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        half = emb.shape[-1] // 2
        sin = emb.sin()
        self.cos = emb.cos().contiguous()
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).contiguous()

    def step(self, x: torch.Tensor, attn_in: torch.Tensor, positions: torch.Tensor, caches: list[RowCache],
             masks: list[torch.Tensor] | None = None, keep: bool = True, gap: int = 1,
             attn_norm: torch.nn.RMSNorm | None = None, whole: bool = False) -> torch.Tensor:
        """DraftBlock.step: R requests, t new rows each; x [R, t, H], attn_in [R, t, Din],
        positions [R, t]. The rows' keys are written to each cache after its `length` slots;
        keep=False leaves `length` as it was (the slots are scratch: a draft query, a DFlash
        block). masks: per request [t, n] bool over the cache slots after the append; None: the
        positional rule of DraftBlock (a key is visible at its own slot or at a position <= the
        query's - gap), for caches whose positions ascend. whole: every row sees every slot, the
        cache's and this step's (a DFlash block). attn_norm: an RMSNorm the qkv projection
        applies to attn_in first (fused into it)."""
        R, t, H = x.shape
        x2 = x.reshape(R * t, H).float().contiguous().clone()
        attn = self._attend(attn_in, positions, caches, masks, keep, gap, attn_norm, whole)
        k = self.kernels
        k.linear(attn, self.o, residual=x2, out=x2)
        gate_up = k.linear(x2, self.gate_up, transform=RMS_NORM, norm_weight=self.mlp_norm, eps=self.eps)
        k.linear(gate_up, self.down, transform=self.activation, residual=x2, out=x2)
        return x2.reshape(R, t, H)

    def write_keys(self, attn_in: torch.Tensor, positions: torch.Tensor, cache: RowCache) -> None:
        """Append the keys and values of rows attn_in [1, t, Din] at positions [1, t] to the
        cache, causally, without the rest of the layer (context rows whose outputs nobody reads)."""
        self._attend(attn_in, positions, [cache], None, True, 1, None, False)

    def _attend(self, attn_in: torch.Tensor, positions: torch.Tensor, caches: list[RowCache],
                masks: list[torch.Tensor] | None, keep: bool, gap: int,
                attn_norm: torch.nn.RMSNorm | None, whole: bool) -> torch.Tensor:
        """qkv projection, then per request RoPE + cache write + attention: [R * t, heads * D]."""
        k, blk = self.kernels, self.block
        R, t = positions.shape
        rows = attn_in.reshape(R * t, -1).float().contiguous()
        if attn_norm is None:
            qkv = k.linear(rows, self.qkv)
        else:
            weight, eps = _norm_parts(attn_norm)
            qkv = k.linear(rows, self.qkv, transform=RMS_NORM, norm_weight=weight, eps=eps)
        self._tables(int(positions.max()) + 1)
        attn = []
        for r, cache in enumerate(caches):
            cache.reserve(t)
            slots = torch.arange(cache.length, cache.length + t, dtype=torch.int64)
            rows = positions[r].to(torch.int64)
            if whole:
                keys = TreeKeys(rows, torch.full((t,), cache.length + t, dtype=torch.int64),
                                torch.zeros(t + 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
            elif masks is None:
                keys = _positional_keys(torch.cat([cache.positions[: cache.length].cpu(), rows.cpu()]), slots, gap)
            else:
                keys = _mask_keys(masks[r], rows)
            attn.append(k.attend(qkv[r * t : (r + 1) * t], torch.zeros(t, dtype=torch.int64), slots, self.cos, self.sin,
                                 cache.k.unsqueeze(0), cache.v.unsqueeze(0), blk.heads, blk.kv_heads, None, blk.scale,
                                 tree=keys))
            cache.positions[cache.length : cache.length + t] = positions[r]
            if keep:
                cache.length += t
        return torch.cat(attn)


def _norm_parts(norm: torch.nn.RMSNorm) -> tuple[torch.Tensor, float]:
    """An RMSNorm's weight as the kernels read it, and its eps (torch's default when unset)."""
    eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
    return norm.weight.detach().float().contiguous(), eps


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
    return TreeKeys(positions, torch.tensor(his, dtype=torch.int64), offsets, keys)
