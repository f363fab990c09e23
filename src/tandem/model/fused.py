"""The lean decode path: chains of Llama-family layers through tandem's fused CPU kernels.

Each decoder layer is five native calls on flat [tokens, H] float32 rows (no padding, no
framework ops in between):

    qkv  = rms_norm(x) @ Wqkv          (norm fused into the linear's input)
    attn = attend(qkv)                 (RoPE, KV-cache write, attention per token)
    x    = x + attn @ Wo               (residual fused into the output)
    gu   = rms_norm(x) @ Wgate_up
    x    = x + swiglu(gu) @ Wdown

Every token's numbers are computed in a fixed order that does not depend on how many tokens or
sequences share the call, so verifying k drafted tokens reproduces k one-token decoding steps bit
for bit. Used for every verification forward (chains and trees, whatever their length) and
other chains of up to FUSED_MAX_TOKENS new tokens per sequence (longer ones and prefills take the
general path) when every linear of the model runs on
the block kernels and the architecture has no q/k norms or sandwich norms (Llama, SmolLM2,
Mistral, Qwen2).
"""

from __future__ import annotations

import torch

from tandem.model.kernels import RMS_NORM, SWIGLU, GEGLU, BlockKernels, TreeKeys, block_kernels
from tandem.model.quant import BlockQ4Linear, BlockQ8Linear
from tandem.model.transformer import TransformerLM

FUSED_MAX_TOKENS = 32


def _weights(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    return layer.qs, layer.d, getattr(layer, "m", None), layer.bias


def fused_eligible(model: TransformerLM) -> bool:
    cfg = model.cfg
    if cfg.qk_norm or cfg.sandwich_norms or len(cfg.rope_tables) != 1 or model.dtype != torch.float32:
        return False
    block = (BlockQ4Linear, BlockQ8Linear)
    return all(
        isinstance(mod, block) for layer in model.layers for mod in (layer.qkv, layer.o, layer.gate_up, layer.down)
    )


class FusedDecoder:
    def __init__(self, model: TransformerLM, kernels: BlockKernels) -> None:
        self.model = model
        self.kernels = kernels
        cfg = model.cfg
        self.activation = SWIGLU if cfg.activation == "silu" else GEGLU
        self.layers = [
            (_weights(layer.qkv), _weights(layer.o), _weights(layer.gate_up), _weights(layer.down),
             layer.attn_norm.weight, layer.mlp_norm.weight, layer.window)
            for layer in model.layers
        ]

    @classmethod
    def for_model(cls, model: TransformerLM) -> "FusedDecoder | None":
        if not fused_eligible(model):
            return None
        kernels = block_kernels()
        return cls(model, kernels) if kernels is not None else None

    def forward(self, tokens: torch.Tensor, seq: torch.Tensor, slot: torch.Tensor, cache,
                hidden_layers: tuple[int, ...], tree: TreeKeys | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """tokens, seq, slot: int64 [N] (token t goes to cache row seq[t] at slot[t]; a sequence's
        tokens are consecutive and in order); tree: what tree nodes attend to (kernels.TreeKeys).
        Returns the last layer's output [N, H] (before the final norm) and the requested layers'
        outputs."""
        model, k, cfg = self.model, self.kernels, self.model.cfg
        eps = cfg.rms_norm_eps
        x = model.embed_tokens(tokens).float().contiguous()
        cos, sin = model.cos_tables[0], model.sin_tables[0]
        hidden: dict[int, torch.Tensor] = {}
        for li, (qkv_w, o_w, gu_w, down_w, attn_norm, mlp_norm, window) in enumerate(self.layers):
            qkv = k.linear(x, *qkv_w, transform=RMS_NORM, norm_weight=attn_norm, eps=eps)
            attn = k.attend(qkv, seq, slot, cos, sin, cache.k[li], cache.v[li], cfg.num_heads,
                            cfg.num_kv_heads, window, cfg.attn_scale, tree)
            k.linear(attn, *o_w, residual=x, out=x)
            gate_up = k.linear(x, *gu_w, transform=RMS_NORM, norm_weight=mlp_norm, eps=eps)
            k.linear(gate_up, *down_w, transform=self.activation, residual=x, out=x)
            if li in hidden_layers:
                hidden[li] = x.clone()
        return x, hidden
