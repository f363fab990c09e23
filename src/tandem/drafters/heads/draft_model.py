"""The `draft_model` method: a small same-tokenizer causal LM distilled from the target.

A few llama-style decoder layers of the target's width, started from evenly spaced target layers,
between the target's own (frozen) embedding and LM head. Loss: KL(target || draft) of the
next-token distributions at answer positions (target logits = lm_head(hidden L)). `export` writes
a Hugging Face llama directory (config.json + model.safetensors + tokenizer files) that the
`draft_model` drafter loads through --speculative-draft-model-path; the embedding (and an untied
LM head) is copied in from the target, since the loader reads whole checkpoints.

`vocab_size` < the target's keeps the file small: the draft model covers the first `vocab_size`
target ids (BPE vocabularies put frequent tokens first). The draft_model drafter already serves
such a model: it never proposes the other ids (q is zero there) and feeds them to the draft as
its unknown token, which training mirrors with `stand_in`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from tandem.drafters.heads.base import (
    LOGIT_CHUNK,
    DraftHead,
    TargetParts,
    TrainBatch,
    chain_rows,
    final_layer,
    masked_mean,
    register_head,
    target_argmax,
    target_logits,
    top1_agrees,
)
from tandem.drafters.heads.block import DraftBlock
from tandem.model.arch import ModelConfig
from tandem.paths import save_safetensors


def spaced_layers(num_target_layers: int, n: int) -> tuple[int, ...]:
    """n target layers evenly spaced from the first to the last (their weights start the draft)."""
    if n == 1:
        return (0,)
    return tuple(round(i * (num_target_layers - 1) / (n - 1)) for i in range(n))


def llama_export_problem(cfg: ModelConfig) -> str | None:
    """Why a draft model for a target of this ModelConfig cannot be exported as the llama model
    the draft_model drafter loads (None: it can). Known from the target's config alone, so `tandem
    train` refuses before any answering."""
    if cfg.activation != "silu" or cfg.embed_scale is not None or cfg.final_logit_softcap:
        return (f"draft_model exports a llama-architecture model; the {cfg.model_type} target's embedding scale, "
                "activation or logit softcap has no llama equivalent (train eagle, eagle3, medusa, mtp, dflash or "
                "dspark for it instead)")
    return None


@register_head("draft_model")
class DraftModelHead(DraftHead):
    def __init__(self, cfg: ModelConfig, num_layers: int = 2, init_layers: Sequence[int] | None = None,
                 vocab_size: int | None = None, stand_in: int = 0) -> None:
        super().__init__()
        self.vocab_size = vocab_size or cfg.vocab_size
        if not 1 <= self.vocab_size <= cfg.vocab_size or not 0 <= stand_in < self.vocab_size:
            raise ValueError(f"draft_model needs 1 <= vocab_size <= {cfg.vocab_size} and 0 <= stand_in < vocab_size, "
                             f"got {vocab_size}, {stand_in}")
        self.stand_in = stand_in
        if not 1 <= num_layers <= cfg.num_layers:
            raise ValueError(f"draft_model needs 1 <= num_layers <= {cfg.num_layers} (the target's), got {num_layers}")
        self.init_layers = tuple(init_layers) if init_layers is not None else spaced_layers(cfg.num_layers, num_layers)
        if len(self.init_layers) != num_layers or not all(0 <= i < cfg.num_layers for i in self.init_layers):
            raise ValueError(f"init_layers must name {num_layers} target layers in [0, {cfg.num_layers}), got {list(self.init_layers)}")
        self.cfg = cfg
        self.num_layers_target = cfg.num_layers
        H = cfg.hidden_size
        self.attn_norms = nn.ModuleList(nn.RMSNorm(H, eps=cfg.rms_norm_eps) for _ in range(num_layers))
        self.layers = nn.ModuleList(DraftBlock(cfg) for _ in range(num_layers))
        self.norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)

    @classmethod
    def build(cls, target: TargetParts, **options) -> "DraftModelHead":
        head = cls(target.config, **options)
        with torch.no_grad():
            head.norm.weight.copy_(target.final_norm(torch.ones(target.config.hidden_size)))
            if target.layer_weights is not None:
                for norm, block, i in zip(head.attn_norms, head.layers, head.init_layers):
                    weights = target.layer_weights(i)
                    block.init_from(weights)
                    norm.weight.copy_(weights["attn_norm"])
        return head

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return (self.num_layers_target,)

    @property
    def serving_layers(self) -> tuple[int, ...]:
        return ()  # served by the draft_model drafter from tokens alone

    def config_dict(self) -> dict:
        return {"num_layers": len(self.layers), "init_layers": list(self.init_layers), "vocab_size": self.vocab_size,
                "stand_in": self.stand_in}

    @property
    def draft_vocab_size(self) -> int | None:
        return self.vocab_size if self.vocab_size < self.cfg.vocab_size else None

    def hidden(self, ids: torch.Tensor, target: TargetParts) -> torch.Tensor:
        """Token ids [B, T] -> the draft's final normed hidden states [B, T, H] (causal); ids
        outside the draft vocabulary enter as the stand-in, as the draft_model drafter feeds them."""
        B, T = ids.shape
        positions = torch.arange(T, device=ids.device).expand(B, T)
        ids = ids.masked_fill(ids >= self.vocab_size, self.stand_in)
        x = target.embed(ids).float()
        for norm, block in zip(self.attn_norms, self.layers):
            x = block(x, norm(x), positions)
        return self.norm(x)

    def logits(self, h: torch.Tensor, target: TargetParts) -> torch.Tensor:
        """Draft hidden [N, H] -> logits over the draft vocabulary [N, vocab_size]."""
        return target.lm_head(h)[..., : self.vocab_size]

    def training_loss(self, batch: TrainBatch, target: TargetParts) -> tuple[torch.Tensor, dict[str, float]]:
        # Position t's logits predict x_{t+1}: distil them where x_{t+1} is an answer token. A
        # reduced vocabulary learns the target's distribution renormalised over it, at positions
        # whose target argmax it holds.
        b, t = batch.loss_mask.nonzero(as_tuple=True)
        h = self.hidden(batch.token_ids, target)[b, t]
        full = target_logits(target, batch.hidden[final_layer(target)][b, t])
        valid = full.argmax(-1) < self.vocab_size
        log_p = torch.log_softmax(full[:, : self.vocab_size], dim=-1)
        kls = []
        for hc, lpc in zip(h.split(LOGIT_CHUNK), log_p.split(LOGIT_CHUNK)):
            log_q = torch.log_softmax(self.logits(hc, target), dim=-1)
            kls.append((lpc.exp() * (lpc - log_q)).sum(-1))
        kl = masked_mean(torch.cat(kls), valid) if kls else h.new_zeros(())
        top1 = float(masked_mean(top1_agrees(self.logits(h.detach(), target), log_p), valid))
        return kl, {"loss": float(kl.detach()), "kl": float(kl.detach()), "top1": top1}

    @torch.no_grad()
    def draft_accuracy(self, batch: TrainBatch, target: TargetParts, k: int) -> torch.Tensor:
        # Teacher forcing equals drafting on its own tokens for as long as the chain is correct:
        # draft position i from start t is the draft's argmax at position t + i.
        greedy = target_argmax(batch, target)
        h = self.hidden(batch.token_ids, target)
        b0, _, _ = chain_rows(batch, 0)
        correct = torch.zeros(len(b0), k, dtype=torch.bool, device=greedy.device)
        for i in range(k):
            b, t, valid = chain_rows(batch, 1 + i)
            draft = torch.cat([self.logits(c, target).argmax(-1) for c in h[b, t].split(LOGIT_CHUNK)]) if len(b) else greedy.new_zeros(0)
            correct[:, i] = valid & (draft == greedy[b, t])
        return correct

    # ---- export: a model directory the draft_model drafter loads ---------------------------------

    def export(self, out_dir, target_name: str, tokenizer, dtype: torch.dtype) -> None:
        """A Hugging Face llama directory (weights, config.json, the target's tokenizer) that
        the draft_model drafter, or transformers, loads."""
        parts = self._check_exportable(tokenizer)
        out = Path(out_dir)
        save_safetensors(self._llama_state(parts, dtype), out / "model.safetensors")
        (out / "config.json").write_text(json.dumps(self._llama_config(target_name, dtype), indent=2) + "\n")
        tokenizer.save_pretrained(str(out))

    def _check_exportable(self, tokenizer):
        cfg = self.cfg
        problem = llama_export_problem(cfg)
        if problem:
            raise ValueError(problem)
        if tokenizer is None or not hasattr(tokenizer, "save_pretrained"):
            raise ValueError(
                "draft_model export needs the target's tokenizer (save_head(..., tokenizer=loaded.tokenizer)): "
                "the draft_model drafter loads it from the exported directory"
            )
        unk = getattr(tokenizer, "unk_token_id", None) or 0
        if self.draft_vocab_size is not None and unk != self.stand_in:
            raise ValueError(
                f"the draft_model drafter feeds ids outside the draft vocabulary as the tokenizer's unknown token "
                f"{unk}; this head was trained with stand_in={self.stand_in}: rebuild it with stand_in={unk}"
            )
        parts = getattr(self, "target_parts", None)
        if parts is None or parts.embed_weight is None or parts.lm_head_weight is None:
            raise ValueError("draft_model export copies the target's embedding: build or load the head with TargetParts.from_loaded")
        return parts

    def _llama_state(self, parts, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        cfg = self.cfg

        def t(x: torch.Tensor) -> torch.Tensor:
            return x.detach().to(dtype).cpu().contiguous()

        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        V = self.vocab_size
        state = {"model.embed_tokens.weight": t(parts.embed_weight[:V]), "model.norm.weight": t(self.norm.weight)}
        if not cfg.tie_word_embeddings:
            state["lm_head.weight"] = t(parts.lm_head_weight[:V])
        for i, (norm, block) in enumerate(zip(self.attn_norms, self.layers)):
            p = f"model.layers.{i}."
            wq, wk, wv = block.qkv.weight.split([q, kv, kv])
            gate, up = block.gate_up.weight.chunk(2)
            state.update({
                p + "input_layernorm.weight": t(norm.weight),
                p + "self_attn.q_proj.weight": t(wq),
                p + "self_attn.k_proj.weight": t(wk),
                p + "self_attn.v_proj.weight": t(wv),
                p + "self_attn.o_proj.weight": t(block.o.weight),
                p + "post_attention_layernorm.weight": t(block.mlp_norm.weight),
                p + "mlp.gate_proj.weight": t(gate),
                p + "mlp.up_proj.weight": t(up),
                p + "mlp.down_proj.weight": t(block.down.weight),
            })
        return state

    def _llama_config(self, target_name: str, dtype: torch.dtype) -> dict:
        cfg = self.cfg
        theta, scaling = cfg.rope_tables[cfg.layer_rope[-1]]
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": self.layers[0].down.in_features,
            "num_hidden_layers": len(self.layers),
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": theta,
            "rope_scaling": scaling,
            "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "attention_bias": False,
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": (list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1
                             else cfg.eos_token_ids[0] if cfg.eos_token_ids else None),
            "torch_dtype": str(dtype).removeprefix("torch."),
            "tandem_draft_model_of": target_name,
        }
