"""The lean decoder shared by every supported architecture (Llama family and Gemma 3).

Weights arrive through a WeightSource (HF safetensors, native GGUF blocks, ...), which decides how
each linear is stored (dense, int8, int4); the decoder only calls them. Attention reads and writes
the preallocated KV cache through an AttentionPlan built once per forward by the runner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tandem.model.arch import ModelConfig


class WeightSource(Protocol):
    """Hands out a model's weights by Hugging Face parameter name."""

    def tensor(self, name: str) -> torch.Tensor:
        """A float tensor (norm weights, embeddings)."""

    def linear(self, names: list[str], bias: bool) -> nn.Module:
        """One linear layer whose output rows are the named weights stacked in order (fusion)."""

    def has(self, name: str) -> bool: ...


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        # Llama 3.1 frequency-dependent scaling: long wavelengths slowed by `factor`, short ones
        # kept, a smooth blend in between.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > old_len / low, inv / factor, inv)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(mid, blended, out)
    raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3 are)")


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float, offset: float, dtype: torch.dtype) -> None:
        super().__init__()
        # Gemma stores w and multiplies by (1 + w); fold the offset in once at load.
        self.weight = nn.Parameter((weight.float() + offset).to(dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


@dataclass
class LayerCache:
    """Views of one layer's K/V cache: [S, Hkv, M, D] each."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass
class AttentionSegment:
    """One attention call: queries t0:t1 of batch row b against keys [lo[window], hi) of cache
    row `seq`, with masks[window] ([1, 1, t1 - t0, hi - lo] bool) or None for no mask (causal:
    None means the plain causal mask of a prompt with no prefix); then, for a tree node, the
    slots `keys` (its path, root first)."""

    b: int
    seq: int
    t0: int
    t1: int
    hi: int
    lo: dict[int | None, int]
    masks: dict[int | None, torch.Tensor | None]
    keys: torch.Tensor | None = None
    causal: bool = False


@dataclass
class AttentionPlan:
    """Per-forward attention structure, shared by all layers (built once by the runner).

    write_seq / write_slot: flat [N] cache coordinates of the N valid new tokens (B > 1);
    write_fast is (seq, start) when B = 1 so the write is a plain slice. cos/sin[rope_index]: [B, T, 1, D].
    Chains run as `segments` (one attention call each, see ModelRunner.forward); trees run as one
    padded call over cache rows read_seqs with masks[window] [B, 1, T, read_len].
    """

    write_seq: torch.Tensor | None
    write_slot: torch.Tensor | None
    valid: torch.Tensor | None  # [B, T] bool, None when no padding
    write_fast: tuple[int, int] | None
    cos: list[torch.Tensor]
    sin: list[torch.Tensor]
    segments: list[AttentionSegment] | None = None
    read_seqs: torch.Tensor | None = None
    read_len: int = 0
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, x * cos + rotate_half(x) * sin, written as x * cos + roll(x) * sin'
    with sin' = [-sin_1, sin_2] folded into the table once (rotate_half(x) = roll(x) * [-1, 1])."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, src: WeightSource, dtype: torch.dtype) -> None:
        super().__init__()
        p = f"model.layers.{index}."
        eps, off = cfg.rms_norm_eps, cfg.norm_offset
        self.cfg = cfg
        self.window = cfg.layer_windows[index]
        self.rope = cfg.layer_rope[index]
        self.attn_norm = RMSNorm(src.tensor(p + "input_layernorm.weight"), eps, off, dtype)
        attn = p + "self_attn."
        self.qkv = src.linear([attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"], cfg.qkv_bias)
        self.o = src.linear([attn + "o_proj.weight"], cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(src.tensor(attn + "q_norm.weight"), eps, off, dtype)
            self.k_norm = RMSNorm(src.tensor(attn + "k_norm.weight"), eps, off, dtype)
        if cfg.sandwich_norms:
            self.post_attn_norm = RMSNorm(src.tensor(p + "post_attention_layernorm.weight"), eps, off, dtype)
            self.mlp_norm = RMSNorm(src.tensor(p + "pre_feedforward_layernorm.weight"), eps, off, dtype)
            self.post_mlp_norm = RMSNorm(src.tensor(p + "post_feedforward_layernorm.weight"), eps, off, dtype)
        else:
            self.mlp_norm = RMSNorm(src.tensor(p + "post_attention_layernorm.weight"), eps, off, dtype)
        mlp = p + "mlp."
        self.gate_up = src.linear([mlp + "gate_proj.weight", mlp + "up_proj.weight"], cfg.mlp_bias)
        self.down = src.linear([mlp + "down_proj.weight"], cfg.mlp_bias)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    def forward(self, x: torch.Tensor, plan: AttentionPlan, cache: LayerCache) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        q, k, v = self._qkv(self.attn_norm(x), plan)
        # The cache may be wider than the activations (fp32 cache with bf16 activations: this
        # CPU has no native bf16, and fp32 attention measured ~5x faster than bf16 here), or an
        # fp16 store that attention on a CPU reads back as fp32.
        self._write_cache(k.to(cache.k.dtype), v.to(cache.k.dtype), plan, cache)
        attn_dtype = torch.float32 if cache.k.dtype == torch.float16 and cache.k.device.type == "cpu" else cache.k.dtype
        attn = self._attend(q.transpose(1, 2).to(attn_dtype), plan, cache)  # [B, H, T, D]
        attn = self.o(attn.transpose(1, 2).reshape(B, T, self.q_size).to(x.dtype)).to(x.dtype)
        if cfg.sandwich_norms:
            attn = self.post_attn_norm(attn)
        x = x + attn
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        act = F.silu(gate) if cfg.activation == "silu" else F.gelu(gate, approximate="tanh")
        mlp = self.down(act * up).to(x.dtype)
        if cfg.sandwich_norms:
            mlp = self.post_mlp_norm(mlp)
        return x + mlp

    def _qkv(self, h: torch.Tensor, plan: AttentionPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k rotated (after their norms, if any) and v: [B, T, heads, D] each."""
        cfg = self.cfg
        B, T, _ = h.shape
        qkv = self.qkv(h).to(h.dtype)
        heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos, sin = plan.cos[self.rope], plan.sin[self.rope]  # [B, T, 1, D]
        if cfg.qk_norm:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = _rope(self.q_norm(q.view(B, T, heads, hd)), cos, sin)
            k = _rope(self.k_norm(k.view(B, T, kv_heads, hd)), cos, sin)
        else:
            # q and k rotated together: one set of rope ops per layer instead of two.
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            q, k = _rope(qk.view(B, T, heads + kv_heads, hd), cos, sin).split([heads, kv_heads], dim=2)
        return q, k, v.view(B, T, kv_heads, hd)

    def _write_cache(self, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, cache: LayerCache) -> None:
        """The new tokens' k and v into their cache slots."""
        B, T = k.shape[:2]
        if plan.write_fast is not None:
            seq, start = plan.write_fast
            cache.k[seq, :, start : start + T] = k[0].transpose(0, 1)
            cache.v[seq, :, start : start + T] = v[0].transpose(0, 1)
            return
        valid = plan.valid
        kf = k[valid] if valid is not None else k.reshape(B * T, *k.shape[2:])
        vf = v[valid] if valid is not None else v.reshape(B * T, *v.shape[2:])
        cache.k[plan.write_seq, :, plan.write_slot] = kf
        cache.v[plan.write_seq, :, plan.write_slot] = vf

    def _attend(self, qt: torch.Tensor, plan: AttentionPlan, cache: LayerCache) -> torch.Tensor:
        """Attention of the queries qt [B, H, T, D] over the cache, as the plan lays it out:
        one call per segment (chains, token-by-token trees) or one padded, masked call."""
        scale, gqa = self.cfg.attn_scale, self.cfg.num_heads != self.cfg.num_kv_heads
        if plan.segments is None:
            return F.scaled_dot_product_attention(
                qt,
                cache.k[plan.read_seqs, :, : plan.read_len].to(qt.dtype),
                cache.v[plan.read_seqs, :, : plan.read_len].to(qt.dtype),
                attn_mask=plan.masks[self.window], scale=scale, enable_gqa=gqa,
            )
        attn = None if len(plan.segments) == 1 else qt.new_zeros(qt.shape)
        for seg in plan.segments:
            lo = seg.lo[self.window]
            keys = cache.k[seg.seq : seg.seq + 1, :, lo : seg.hi]
            values = cache.v[seg.seq : seg.seq + 1, :, lo : seg.hi]
            if seg.keys is not None:
                keys = torch.cat([keys, cache.k[seg.seq : seg.seq + 1, :, seg.keys]], dim=2)
                values = torch.cat([values, cache.v[seg.seq : seg.seq + 1, :, seg.keys]], dim=2)
            out = F.scaled_dot_product_attention(
                qt[seg.b : seg.b + 1, :, seg.t0 : seg.t1], keys.to(qt.dtype), values.to(qt.dtype),
                attn_mask=seg.masks[self.window], scale=scale, enable_gqa=gqa,
                is_causal=seg.causal and seg.masks[self.window] is None,
            )
            if attn is None:
                attn = out
            else:
                attn[seg.b, :, seg.t0 : seg.t1] = out[0]
        return attn


class TransformerLM(nn.Module):
    """Embedding -> decoder layers -> final norm -> LM head, on a caller-provided KV cache."""

    def __init__(self, cfg: ModelConfig, src: WeightSource, dtype: torch.dtype, progress=None) -> None:
        """progress: optional wrapper over the layer indices (a progress bar while loading)."""
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        embed = src.tensor("model.embed_tokens.weight")
        self.embed = nn.Parameter(embed.to(dtype), requires_grad=False)
        # HF casts the scale to the embedding dtype before multiplying; do the same for identity.
        self.embed_scale = (
            float(torch.tensor(cfg.embed_scale, dtype=dtype)) if cfg.embed_scale is not None else None
        )
        indices = range(cfg.num_layers) if progress is None else progress(range(cfg.num_layers))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, src, dtype) for i in indices)
        self.norm = RMSNorm(src.tensor("model.norm.weight"), cfg.rms_norm_eps, cfg.norm_offset, dtype)
        head = "lm_head.weight" if not cfg.tie_word_embeddings and src.has("lm_head.weight") else "model.embed_tokens.weight"
        self.lm_head = src.linear([head], False)
        tables = [rope_inv_freq(cfg.head_dim, theta, scaling) for theta, scaling in cfg.rope_tables]
        self.inv_freq = [t.float() for t in tables]

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(token_ids, self.embed)
        return x * self.embed_scale if self.embed_scale is not None else x

    def build_rope_tables(self, max_positions: int) -> None:
        """Precompute cos and sign-folded sin [P, D] per rope table (fp32 math as in HF, then
        cast once; see _rope)."""
        positions = torch.arange(max_positions, dtype=torch.float32)
        self.cos_tables, self.sin_tables = [], []
        for inv in self.inv_freq:
            freqs = positions.unsqueeze(-1) * inv
            emb = torch.cat((freqs, freqs), dim=-1)
            half = emb.shape[-1] // 2
            sin = emb.sin()
            self.cos_tables.append(emb.cos().to(self.dtype))
            self.sin_tables.append(torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(self.dtype))

    def rope(self, positions: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """cos/sin [B, T, 1, D] per rope table for integer positions [B, T] (broadcast over heads)."""
        return [t[positions].unsqueeze(2) for t in self.cos_tables], [t[positions].unsqueeze(2) for t in self.sin_tables]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] final-layer hidden states (before the final norm) -> [N, V] fp32 logits."""
        out = self.lm_head(self.norm(hidden)).float()
        if self.cfg.final_logit_softcap:
            cap = self.cfg.final_logit_softcap
            out = torch.tanh(out / cap) * cap
        return out
