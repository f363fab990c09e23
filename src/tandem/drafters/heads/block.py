"""A trainable llama-style decoder layer for draft heads, with a per-request KV cache for drafting.

EAGLE, EAGLE-3 and MTP heads each run one such layer. Training runs whole sequences (plus the
EAGLE-3 training-time-test steps, whose queries also see their own chain's keys); drafting feeds
a few tokens per request against a small cache that is truncated back after every draft.
Attention visibility is decided by positions: a key at position pk is visible to a query at pq
when pk == pq or pk <= pq - gap (gap 1 = causal; MTP module k uses gap k, see mtp.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.model.arch import ModelConfig
from tandem.model.transformer import rope_inv_freq


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, gap: int = 1) -> torch.Tensor:
    """[..., Tq, Tk] bool from positions [..., Tq] and [..., Tk]."""
    q, k = q_pos.unsqueeze(-1), k_pos.unsqueeze(-2)
    return (k == q) | (k <= q - gap)


class RowCache:
    """One request's keys and values for one block: [Hkv, capacity, D] each, grown by doubling.

    positions[i] is the position of the token whose key sits in slot i; `truncate` drops the
    slots of draft tokens after a round (their keys came from predicted features). origin: the
    position of slot 0 (0 unless the cache had to restart mid-sequence).
    """

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, capacity: int = 64,
                 origin: int = 0) -> None:
        self.origin = origin
        self.k = torch.zeros(kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.positions = torch.zeros(capacity, dtype=torch.long, device=device)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """k, v: [Hkv, t, D]; positions [t]."""
        t = k.shape[1]
        need = self.length + t
        self.reserve(t)
        self.k[:, self.length : need] = k
        self.v[:, self.length : need] = v
        self.positions[self.length : need] = positions
        self.length = need

    def reserve(self, t: int) -> None:
        """Room for t slots after `length` (a writer that fills them itself, then moves length)."""
        need = self.length + t
        if need > self.k.shape[1]:
            cap = max(need, 2 * self.k.shape[1])
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_zeros(old.shape[0], cap, old.shape[2])
                new[:, : self.length] = old[:, : self.length]
                setattr(self, name, new)
            pos = self.positions.new_zeros(cap)
            pos[: self.length] = self.positions[: self.length]
            self.positions = pos

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


class DraftBlock(nn.Module):
    """Pre-norm attention + gated MLP, shaped like the target's layers (heads, head_dim, rope).

    The caller passes the residual stream and the (already normed) attention input separately:
    a plain layer uses attn_in = norm(x); EAGLE-3 feeds concat(norm(embedding), norm(hidden)),
    hence `attn_in_features` may be 2H.
    """

    def __init__(self, cfg: ModelConfig, attn_in_features: int | None = None, intermediate_size: int | None = None) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.attn_scale
        self.activation = cfg.activation
        inter = intermediate_size or cfg.intermediate_size
        self.qkv = nn.Linear(attn_in_features or H, (self.heads + 2 * self.kv_heads) * self.head_dim, bias=False)
        self.o = nn.Linear(self.heads * self.head_dim, H, bias=False)
        self.mlp_norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.gate_up = nn.Linear(H, 2 * inter, bias=False)
        self.down = nn.Linear(inter, H, bias=False)
        theta, scaling = cfg.rope_tables[cfg.layer_rope[-1]]
        self.register_buffer("inv_freq", rope_inv_freq(self.head_dim, theta, scaling).float(), persistent=False)

    def init_from(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy a target layer's weights (TargetParts.layer_weights) where the shapes match."""
        with torch.no_grad():
            for name, module in (("qkv", self.qkv), ("o", self.o), ("gate_up", self.gate_up), ("down", self.down)):
                if weights[name].shape == module.weight.shape:
                    module.weight.copy_(weights[name])
            if weights["mlp_norm"].shape == self.mlp_norm.weight.shape:
                self.mlp_norm.weight.copy_(weights["mlp_norm"])

    # ---- pieces --------------------------------------------------------------------------------

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, h, T, D] rotated at positions [B, T] (rotate-half convention, fp32 angles)."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [B, 1, T, D]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def qkv_heads(self, attn_in: torch.Tensor, positions: torch.Tensor):
        """attn_in [B, T, Din] -> q [B, h, T, D], k/v [B, hkv, T, D], q and k rotated."""
        B, T, _ = attn_in.shape
        q, k, v = self.qkv(attn_in).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1
        )
        q = q.view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        return self._rope(q, positions), self._rope(k, positions), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual x [B, T, H] + o(attn [B, h, T, D]), then the gated MLP."""
        B, _, T, _ = attn.shape
        x = x + self.o(attn.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        act = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return x + self.down(act * up)

    def _expand(self, kv: torch.Tensor) -> torch.Tensor:
        rep = self.heads // self.kv_heads
        return kv if rep == 1 else kv.repeat_interleave(rep, dim=1)

    # ---- training ------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, attn_in: torch.Tensor, positions: torch.Tensor, gap: int = 1,
                return_kv: bool = False):
        """Whole sequences: x [B, T, H], attn_in [B, T, Din], positions [B, T] -> [B, T, H]
        (and this pass's (k, v) when return_kv, the base keys of forward_unrolled)."""
        q, k, v = self.qkv_heads(attn_in, positions)
        mask = visible(positions, positions, gap).unsqueeze(1)  # [B, 1, T, T]
        attn = F.scaled_dot_product_attention(q, self._expand(k), self._expand(v), attn_mask=mask, scale=self.scale)
        out = self.finish(x, attn)
        return (out, (k, v)) if return_kv else out

    def forward_unrolled(
        self,
        x: torch.Tensor,
        attn_in: torch.Tensor,
        positions: torch.Tensor,
        base_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        chain_kv: list[tuple[torch.Tensor, torch.Tensor]],
        starts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One training-time-test step (EAGLE-3): the chain starting at every position j runs
        its step s at position j + s and sees the base keys at positions <= j (the true
        features) plus its own chain's keys from steps 1..s, one per step (a diagonal).

        base_kv: (k, v, base positions [B, T]) of step 0; starts [B, Tq]: the chain start of each
        query (default: the base positions, one chain per position); chain_kv: (k, v) of steps
        1..s-1, each [B, hkv, Tq, D] in the same query order. Returns the output and this step's (k, v).
        """
        q, k, v = self.qkv_heads(attn_in, positions)
        k0, v0, pos0 = base_kv
        start = pos0 if starts is None else starts
        # Base part: key j' visible to chain j when j' <= j.
        scores0 = torch.matmul(q, self._expand(k0).transpose(-1, -2)) * self.scale  # [B, h, Tq, T]
        allowed = (pos0.unsqueeze(-2) <= start.unsqueeze(-1)).unsqueeze(1)
        scores0 = scores0.masked_fill(~allowed, float("-inf"))
        diag_k = [ck for ck, _ in chain_kv] + [k]
        diag_v = [cv for _, cv in chain_kv] + [v]
        diag = torch.stack([(q * self._expand(dk)).sum(-1) * self.scale for dk in diag_k], dim=-1)  # [B, h, Tq, s]
        probs = torch.softmax(torch.cat([scores0, diag], dim=-1).float(), dim=-1).to(q.dtype)
        p0, pd = probs[..., : scores0.shape[-1]], probs[..., scores0.shape[-1] :]
        attn = torch.matmul(p0, self._expand(v0))
        for i, dv in enumerate(diag_v):
            attn = attn + pd[..., i : i + 1] * self._expand(dv)
        return self.finish(x, attn), (k, v)

    # ---- drafting ------------------------------------------------------------------------------

    def new_cache(self, device: torch.device, origin: int = 0) -> RowCache:
        return RowCache(self.kv_heads, self.head_dim, self.mlp_norm.weight.dtype, device, origin=origin)

    def step(self, x: torch.Tensor, attn_in: torch.Tensor, positions: torch.Tensor, caches: list[RowCache], gap: int = 1,
             masks: list[torch.Tensor] | None = None) -> torch.Tensor:
        """R requests, t new tokens each: x [R, t, H], attn_in [R, t, Din], positions [R, t].
        Appends the new keys to each request's cache and attends over it (one call per request,
        no padding: a request's numbers do not depend on the batch). masks: per request a [t, n]
        bool over its cache slots after the append (tree drafts: the prefix and the node's own
        path) instead of the positional rule."""
        q, k, v = self.qkv_heads(attn_in, positions)
        outs = []
        for r, cache in enumerate(caches):
            cache.append(k[r], v[r], positions[r])
            n = cache.length
            mask = (visible(positions[r], cache.positions[:n], gap) if masks is None else masks[r])[None, None]
            outs.append(
                F.scaled_dot_product_attention(
                    q[r : r + 1], cache.k[None, :, :n], cache.v[None, :, :n], attn_mask=mask, scale=self.scale,
                    enable_gqa=self.heads != self.kv_heads,
                )
            )
        return self.finish(x, torch.cat(outs))
