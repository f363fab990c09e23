"""The lean decode path: the decoder stack on tandem's block kernels in one native call
(kernels.BlockKernels.decoder). Each layer is, on flat [tokens, H] float32 rows (no padding, no
framework ops in between):

    qkv  = rms_norm(x) @ Wqkv          (norm fused into the linear's input)
    attn = attend(qkv)                 (q/k norms if any, RoPE, KV-cache write, attention per token)
    x    = x + post(attn @ Wo)         (residual fused into the output; post: a sandwich norm)
    gu   = rms_norm(x) @ Wgate_up
    x    = x + post(act(gu) @ Wdown)   (SwiGLU or GeGLU fused into the input)

Llama, SmolLM2, Mistral and Qwen2 have neither q/k norms nor sandwich norms; Qwen3 has q/k norms;
Gemma 3 has both, GeGLU, and a local and a global rope table. Every token's numbers are computed
in a fixed order that does not depend on how many tokens or sequences share the call, so
verifying k drafted tokens reproduces k one-token decoding steps bit for bit. Used for every
forward (prompts, decoding, chain and tree verification) when every linear of the model runs on
the block kernels, at most FUSED_ROW_BUDGET rows per call (the runner splits longer prompts).
"""

from __future__ import annotations

import torch

from tandem.model.block_linear import BlockQ4Linear, BlockQ8Linear
from tandem.model.kernels import (
    GEGLU,
    RMS_NORM,
    SWIGLU,
    BlockKernels,
    DecoderShape,
    LayerParts,
    TreeKeys,
    block_kernels,
    decoder_layers,
)
from tandem.model.kernels.arena import place_contiguously
from tandem.model.transformer import TransformerLM
from tandem.types import GreedyRows

# Rows per native call: the scratch rows of a call stay a few MB, and a weight read from memory
# still serves hundreds of rows (a 700-token prompt: 0.59-0.66 s in one call or in 256-row
# pieces, 0.60-0.64 s in 64-row pieces, against 0.73-0.79 s on the general path; SmolLM2, avx512).
FUSED_ROW_BUDGET = 256


def fused_eligible(model: TransformerLM) -> bool:
    if model.dtype != torch.float32:
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
        self._parts = [self._layer_parts(layer) for layer in model.layers]
        # The final norm fused into the LM head's input, one native call, where the head runs on
        # the block kernels and no softcap follows it (else the model's own norm and head).
        head_on_blocks = isinstance(model.lm_head, (BlockQ4Linear, BlockQ8Linear)) and not cfg.final_logit_softcap
        self._head = model.lm_head.blocks(kernels) if head_on_blocks else None
        self._final_norm = model.norm.weight.detach().float().contiguous()
        # Every weight a forward streams, back to back in the order it reads them (arena.py).
        streamed = [w for p in self._parts for w in p.linears]
        place_contiguously(streamed + ([self._head] if self._head is not None else []))
        self._layers = decoder_layers(self._parts)

    def _layer_parts(self, layer) -> LayerParts:
        k, model = self.kernels, self.model

        def norm(name: str) -> torch.Tensor | None:
            mod = getattr(layer, name, None)
            return None if mod is None else mod.weight.detach().float().contiguous()

        return LayerParts(
            layer.qkv.blocks(k), layer.o.blocks(k), layer.gate_up.blocks(k), layer.down.blocks(k),
            norm("attn_norm"), norm("mlp_norm"), layer.window,
            model.cos_tables[layer.rope].float().contiguous(), model.sin_tables[layer.rope].float().contiguous(),
            norm("q_norm"), norm("k_norm"), norm("post_attn_norm"), norm("post_mlp_norm"),
        )

    @classmethod
    def for_model(cls, model: TransformerLM) -> "FusedDecoder | None":
        if not fused_eligible(model):
            return None
        kernels = block_kernels()
        return cls(model, kernels) if kernels is not None else None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] last-layer rows (before the final norm) -> [N, V] float32 logits. Every
        forward's logits come from here, so plain decoding and verification share them bit for
        bit."""
        if self._head is None:
            return self.model.logits(hidden)
        return self.kernels.linear(hidden.contiguous(), self._head, transform=RMS_NORM,
                                   norm_weight=self._final_norm, eps=self.shape.eps)

    def logits_and_argmax(self, hidden: torch.Tensor) -> tuple[torch.Tensor, GreedyRows | None]:
        """`logits`, and where the head runs on the block kernels each row's argmax and
        finiteness from the same call (GreedyRows; None elsewhere)."""
        if self._head is None:
            return self.model.logits(hidden), None
        logits, best, finite = self.kernels.linear_argmax(hidden.contiguous(), self._head, transform=RMS_NORM,
                                                          norm_weight=self._final_norm, eps=self.shape.eps)
        return logits, GreedyRows(best.tolist(), finite.tolist())

    def forward(self, tokens: torch.Tensor, seq: torch.Tensor, slot: torch.Tensor, cache,
                hidden_layers: tuple[int, ...], tree: TreeKeys | None = None
                ) -> tuple[torch.Tensor, tuple[int, ...], torch.Tensor | None]:
        """tokens, seq, slot: int64 [N] (token t goes to cache row seq[t] at slot[t]; a sequence's
        tokens are consecutive and in order); tree: what tree nodes attend to (kernels.TreeKeys).
        Returns the last layer's output [N, H] (before the final norm), the requested layers in
        order and their outputs as one [layers, N, H] tensor (None when none was requested). The
        final layer's slot (layer L) is left for the caller, who norms x into it."""
        model = self.model
        x = model.embed_tokens(tokens).float().contiguous()
        L = model.cfg.num_layers
        layers = tuple(sorted(set(li for li in hidden_layers if li <= L)))
        stacked = x.new_empty((len(layers), *x.shape)) if layers else None
        inner = {li: stacked[i] for i, li in enumerate(layers) if li < L}
        self.kernels.decoder(self._layers, x, seq, slot, tree, cache.k, cache.v, self.shape, inner, cache.keys_blocked)
        return x, layers, stacked
