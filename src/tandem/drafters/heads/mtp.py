"""MTP modules (DeepSeek-V3 multi-token prediction) added to a finished target.

Module k (1..depth) at position i: proj([norm(embedding(x_{i+k})); norm(h^{(k-1)}_i)]) -> one
decoder layer -> h^{(k)}_i -> the target's final norm + LM head -> x_{i+k+1}; h^{(0)} is the
output of the target's last decoder layer (layer L-1, before the final norm). Every module works
at the position of the last true token, so a chain of `depth` drafts is one query per module.

Visibility: module k at position i needs x_{i+k}, known at drafting time only for i <= m - k
(x_m is the token the next target forward starts from). Its attention therefore sees keys at
positions <= i - (k - 1) plus its own (block.visible with gap k - 1), in training as in drafting,
so the keys a drafter caches are exactly the ones training used. Modules 1 and 2 are causal.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.drafters.heads.base import (
    DraftHead,
    TargetParts,
    TrainBatch,
    chain_rows,
    masked_targets,
    register_head,
    soft_cross_entropy,
    target_argmax,
    top1_agrees,
)
from tandem.drafters.heads.block import DraftBlock
from tandem.drafters.heads.eagle import shift_left
from tandem.model.arch import ModelConfig


class MTPModule(nn.Module):
    def __init__(self, cfg: ModelConfig, depth: int) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.depth = depth  # k: this module reads x_{i+k}
        self.embed_norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.proj = nn.Linear(2 * H, H, bias=False)
        self.attn_norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.block = DraftBlock(cfg)

    @property
    def gap(self) -> int:
        return self.depth - 1

    def inputs(self, emb: torch.Tensor, h_prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.proj(torch.cat([self.embed_norm(emb), self.hidden_norm(h_prev)], dim=-1))
        return x, self.attn_norm(x)


@register_head("mtp")
class MTPHead(DraftHead):
    def __init__(self, cfg: ModelConfig, depth: int = 2, module_decay: float = 0.8) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"mtp needs depth >= 1 (modules), got {depth}")
        self.num_layers_target = cfg.num_layers
        self.depth, self.module_decay = depth, module_decay
        self.mtp = nn.ModuleList(MTPModule(cfg, k + 1) for k in range(depth))

    @classmethod
    def build(cls, target: TargetParts, **options) -> "MTPHead":
        head = cls(target.config, **options)
        if target.layer_weights is not None:  # each block starts as the target's last layer
            weights = target.layer_weights(target.config.num_layers - 1)
            for module in head.mtp:
                module.block.init_from(weights)
                with torch.no_grad():
                    module.attn_norm.weight.copy_(weights["attn_norm"])
        return head

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return (self.num_layers_target - 1, self.num_layers_target)

    @property
    def serving_layers(self) -> tuple[int, ...]:
        return (self.num_layers_target - 1,)

    def config_dict(self) -> dict:
        return {"depth": self.depth, "module_decay": self.module_decay}

    def logits(self, h: torch.Tensor, target: TargetParts) -> torch.Tensor:
        """Module output [..., H] -> target-vocab logits through the target's final norm and head."""
        return target.lm_head(target.final_norm(h))

    def run_all(self, batch: TrainBatch, target: TargetParts, depth: int | None = None) -> list[torch.Tensor]:
        """h^{(k)} [B, T, H] for k = 1..depth over whole sequences."""
        ids = batch.token_ids
        B, T = ids.shape
        positions = torch.arange(T, device=ids.device).expand(B, T)
        h = batch.hidden[self.num_layers_target - 1].float()
        outs = []
        for module in self.mtp[: depth or self.depth]:
            x, attn_in = module.inputs(target.embed(shift_left(ids, module.depth)).float(), h)
            h = module.block(x, attn_in, positions, gap=module.gap)
            outs.append(h)
        return outs

    def training_loss(self, batch: TrainBatch, target: TargetParts) -> tuple[torch.Tensor, dict[str, float]]:
        final = batch.hidden[self.num_layers_target]
        targets = masked_targets(batch, target)
        outs = self.run_all(batch, target)
        total, weights, metrics = final.new_zeros(()), 0.0, {}
        for k, h in enumerate(outs, start=1):
            # Module k at position i predicts x_{i+k+1}: the target's distribution at i + k.
            b, i = torch.nonzero(batch.loss_mask[:, k:], as_tuple=True)
            if not len(b):
                continue
            logits = self.logits(h[b, i], target)
            p = torch.softmax(targets.rows(b, i + k), dim=-1)
            loss_k = soft_cross_entropy(logits, p).mean()
            w = self.module_decay ** (k - 1)
            total, weights = total + w * loss_k, weights + w
            metrics[f"loss_module{k}"] = float(loss_k.detach())
            metrics[f"top1_module{k}"] = float(top1_agrees(logits, p).mean())
        loss = total / max(weights, 1e-9)
        metrics["loss"] = float(loss.detach())
        return loss, metrics

    @property
    def max_draft_tokens(self) -> int:
        return self.depth

    @torch.no_grad()
    def draft_accuracy(self, batch: TrainBatch, target: TargetParts, k: int) -> torch.Tensor:
        greedy = target_argmax(batch, target)
        b0, t0, _ = chain_rows(batch, 0)
        outs = self.run_all(batch, target, min(k, self.depth))
        correct = torch.zeros(len(b0), k, dtype=torch.bool, device=greedy.device)
        for s, h in enumerate(outs):
            b, t, valid = chain_rows(batch, 1 + s)
            correct[:, s] = valid & (self.logits(h[b0, t0], target).argmax(-1) == greedy[b, t])
        return correct

