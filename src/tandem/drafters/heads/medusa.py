"""Medusa heads (Cai et al. 2024, Medusa-1): K heads on the target's final hidden state.

Head i reads the final normed hidden state h_t of the last token the target processed (whose own
logits already produced x_{t+1}) and predicts x_{t+2+i}: a residual SiLU block initialised to the
identity, then an LM head (the target's, frozen, unless untied). The heads are not autoregressive,
so one forward gives the whole chain. Loss: soft cross-entropy to the target's distribution at
t+1+i, head weights 0.8^i (Medusa-1's decay).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.drafters.heads.base import (
    DraftHead,
    TargetParts,
    TrainBatch,
    chain_rows,
    final_layer,
    masked_mean,
    masked_targets,
    register_head,
    soft_cross_entropy,
    target_argmax,
    top1_agrees,
)
from tandem.model.arch import ModelConfig

HEAD_DECAY = 0.8


class ResidualSiLU(nn.Module):
    """h + SiLU(W h + b), W and b zero at init: the block starts as the identity."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.silu(self.linear(h))


@register_head("medusa")
class MedusaHead(DraftHead):
    def __init__(self, cfg: ModelConfig, num_heads: int = 4, num_blocks: int = 1, tie_lm_head: bool = True) -> None:
        super().__init__()
        if num_heads < 1 or num_blocks < 1:
            raise ValueError(f"medusa needs num_heads >= 1 and num_blocks >= 1, got {num_heads}, {num_blocks}")
        self.num_layers_target = cfg.num_layers
        self.num_heads, self.num_blocks, self.tie_lm_head = num_heads, num_blocks, tie_lm_head
        H = cfg.hidden_size
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResidualSiLU(H) for _ in range(num_blocks)]) for _ in range(num_heads)
        )
        # Untied: one trainable LM head per Medusa head (V x H parameters each; large files).
        self.lm_heads = None if tie_lm_head else nn.ModuleList(nn.Linear(H, cfg.vocab_size, bias=False) for _ in range(num_heads))

    @classmethod
    def build(cls, target: TargetParts, **options) -> "MedusaHead":
        head = cls(target.config, **options)
        if head.lm_heads is not None:
            if target.lm_head_weight is None:
                raise ValueError("an untied medusa head is initialised from the target's LM head: build it from TargetParts.from_loaded")
            with torch.no_grad():
                for lm in head.lm_heads:
                    lm.weight.copy_(target.lm_head_weight)
        return head

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return (self.num_layers_target,)

    def config_dict(self) -> dict:
        return {"num_heads": self.num_heads, "num_blocks": self.num_blocks, "tie_lm_head": self.tie_lm_head}

    def logits(self, h: torch.Tensor, target: TargetParts, heads: int | None = None) -> torch.Tensor:
        """Final normed hidden [N, H] -> [N, heads, V] logits of the first `heads` heads."""
        h = h.float()
        n = heads or self.num_heads
        z = torch.stack([self.blocks[i](h) for i in range(n)], dim=1)  # [N, n, H]
        if self.lm_heads is None:  # one call of the shared head for every head's rows
            return target.lm_head(z.reshape(-1, z.shape[-1])).reshape(*z.shape[:2], -1)
        return torch.stack([self.lm_heads[i](z[:, i]) for i in range(n)], dim=1)

    def training_loss(self, batch: TrainBatch, target: TargetParts) -> tuple[torch.Tensor, dict[str, float]]:
        hidden = batch.hidden[final_layer(target)]
        targets = masked_targets(batch, target)
        b0, t0, _ = chain_rows(batch, 0)
        h = hidden[b0, t0].float()  # [N, H]
        total, weights, metrics = h.new_zeros(()), 0.0, {}
        for i in range(self.num_heads):
            b, t, valid = chain_rows(batch, 1 + i)
            z = self.blocks[i](h)
            logits = target.lm_head(z) if self.lm_heads is None else self.lm_heads[i](z)
            # Invalid rows (graded position not loss-masked) read row 0 and are masked out.
            p = torch.softmax(targets.logits[targets.row_of[b, t].clamp(min=0)], dim=-1)
            loss_i = masked_mean(soft_cross_entropy(logits, p), valid)
            w = HEAD_DECAY**i
            total, weights = total + w * loss_i, weights + w
            metrics[f"loss_head{i}"] = float(loss_i.detach())
            metrics[f"top1_head{i}"] = float(masked_mean(top1_agrees(logits, p), valid))
        loss = total / weights
        metrics["loss"] = float(loss.detach())
        return loss, metrics

    @property
    def max_draft_tokens(self) -> int:
        return self.num_heads

    @torch.no_grad()
    def draft_accuracy(self, batch: TrainBatch, target: TargetParts, k: int) -> torch.Tensor:
        greedy = target_argmax(batch, target)
        b0, t0, _ = chain_rows(batch, 0)
        k_eff = min(k, self.num_heads)
        drafts = self.logits(batch.hidden[final_layer(target)][b0, t0], target, k_eff).argmax(-1)  # [N, k_eff]
        correct = torch.zeros(len(b0), k, dtype=torch.bool, device=drafts.device)
        for i in range(k_eff):
            b, t, valid = chain_rows(batch, 1 + i)
            correct[:, i] = valid & (drafts[:, i] == greedy[b, t])
        return correct
