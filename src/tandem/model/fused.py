"""The lean decode path: chains of Llama-family layers through tandem's block kernels, the whole
decoder stack in one native call (kernels.BlockKernels.decoder). Each layer is, on flat
[tokens, H] float32 rows (no padding, no framework ops in between):

    qkv  = rms_norm(x) @ Wqkv          (norm fused into the linear's input)
    attn = attend(qkv)                 (RoPE, KV-cache write, attention per token)
    x    = x + attn @ Wo               (residual fused into the output)
    gu   = rms_norm(x) @ Wgate_up
    x    = x + act(gu) @ Wdown         (SwiGLU or GeGLU fused into the input)

Every token's numbers are computed in a fixed order that does not depend on how many tokens or
sequences share the call, so verifying k drafted tokens reproduces k one-token decoding steps bit
for bit. Used for every verification forward (chains and trees, whatever their length) and
other chains of up to FUSED_MAX_TOKENS new tokens per sequence (longer ones and prefills take the
general path) when every linear of the model runs on the block kernels and the architecture has
no q/k norms or sandwich norms (Llama, SmolLM2, Mistral, Qwen2).
"""

from __future__ import annotations

import torch

from tandem.model.kernels import GEGLU, SWIGLU, BlockKernels, DecoderShape, TreeKeys, block_kernels, decoder_layers
from tandem.model.quant import BlockQ4Linear, BlockQ8Linear
from tandem.model.transformer import TransformerLM

FUSED_MAX_TOKENS = 32


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
        self.shape = DecoderShape(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                                  cfg.attn_scale, SWIGLU if cfg.activation == "silu" else GEGLU)
        # The native layer records point into these: they live as long as the decoder.
        self._parts = [
            (layer.qkv.blocks(kernels), layer.o.blocks(kernels), layer.gate_up.blocks(kernels),
             layer.down.blocks(kernels), layer.attn_norm.weight.detach().float().contiguous(),
             layer.mlp_norm.weight.detach().float().contiguous(), layer.window)
            for layer in model.layers
        ]
        self._layers = decoder_layers(self._parts)

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
        model = self.model
        x = model.embed_tokens(tokens).float().contiguous()
        L = model.cfg.num_layers
        hidden = {li: torch.empty_like(x) for li in hidden_layers if li < L}
        self.kernels.decoder(self._layers, x, seq, slot, tree, model.cos_tables[0], model.sin_tables[0],
                             cache.k, cache.v, self.shape, hidden)
        return x, hidden
