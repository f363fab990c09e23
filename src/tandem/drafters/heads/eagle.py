"""EAGLE-1 (Li et al. 2024): draft at the feature level with one decoder layer.

Position j's input is fc([embedding(x_{j+1}); f_j]), f_j the target's final normed hidden state;
one decoder layer predicts f_{j+1}, and the frozen target LM head turns it into the distribution
of x_{j+2}. Drafting continues from the layer's own predicted feature. Loss: smooth L1 to the
true f_{j+1} plus a (0.1-weighted) soft cross-entropy to the target's distribution.

`FeatureHead` holds what EAGLE-1 and EAGLE-3 share: the unrolled chain used in training (the
training-time test of EAGLE-3 / HASS: step s of the chain starting at j runs at position j + s,
sees the true features up to j and its own earlier steps) and in draft_accuracy.
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
    masked_targets,
    register_head,
    soft_cross_entropy,
    target_argmax,
)
from tandem.drafters.heads.block import DraftBlock
from tandem.model.arch import ModelConfig


def shift_left(ids: torch.Tensor, n: int) -> torch.Tensor:
    """[B, T] -> [B, T] with out[:, j] = ids[:, j + n] (0 past the end)."""
    return F.pad(ids[:, n:], (0, n)) if n else ids


def graded_starts(loss_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """bool [B, T]: the chain starts j some step s in 1..steps-1 is graded at (loss_mask[j + 1 + s])."""
    starts = torch.zeros_like(loss_mask)
    for s in range(1, steps):
        starts[:, : -(1 + s)] |= loss_mask[:, 1 + s :]
    return starts


def _start_span(starts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per row of starts [B, T], the positions from its first to its last wanted start: (index
    [B, S] clamped into the row, valid [B, S]); S is the longest span (at least 1). None when every
    start is wanted (starts None)."""
    if starts is None:
        return None
    T = starts.shape[-1]
    any_start = starts.any(-1)
    first = torch.where(any_start, starts.float().argmax(-1), 0)
    last = torch.where(any_start, T - 1 - starts.flip(-1).float().argmax(-1), -1)
    length = last - first + 1
    width = max(int(length.max()), 1)
    offsets = torch.arange(width, device=starts.device)
    index = (first.unsqueeze(-1) + offsets).clamp(max=T - 1)
    return index, offsets < length.unsqueeze(-1)


class FeatureHead(DraftHead):
    """One draft decoder layer fed (token embedding, feature) pairs; see the module docstring."""

    block: DraftBlock

    # ---- what EAGLE-1 and EAGLE-3 define differently ------------------------------------------

    def fuse(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """The target's hidden states of the declared layers [..., H] -> the feature [..., H]."""
        raise NotImplementedError

    def raw_layer_input(self, emb: torch.Tensor, feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, attention input before input_norms) of the draft layer from
        embedding and feature."""
        raise NotImplementedError

    @property
    def input_norms(self) -> tuple[nn.RMSNorm, ...]:
        """The norms the raw attention input passes through, one per equal piece of it."""
        raise NotImplementedError

    def layer_input(self, emb: torch.Tensor, feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, attention input) of the draft layer from embedding and feature."""
        resid, raw = self.raw_layer_input(emb, feat)
        norms = self.input_norms
        pieces = raw.chunk(len(norms), dim=-1)
        return resid, torch.cat([norm(piece) for norm, piece in zip(norms, pieces)], dim=-1)

    def head_logits(self, out: torch.Tensor, target: TargetParts) -> torch.Tensor:
        """Draft layer output [..., H] -> logits over the head's vocabulary."""
        raise NotImplementedError

    #: raw_layer_input is (feature, [embedding | feature]): a draft chain can then be run
    #: without Python between its steps (heads/native.py, NativeBlock.chain).
    input_is_embedding_and_feature = False

    @property
    def vocab_head(self) -> tuple[nn.RMSNorm, nn.Module] | None:
        """(norm, projection) when head_logits is projection(norm(out)), the head's own; None
        when it is the target's LM head (EAGLE-1)."""
        return None

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Indices into head_logits' vocabulary -> target token ids."""
        return ids

    # ---- the unrolled chain --------------------------------------------------------------------

    def unroll(self, batch: TrainBatch, target: TargetParts, steps: int, noise: float = 0.0,
               starts: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Outputs [B, T, H] of chain steps 0..steps-1; step s at index j is the chain starting
        at position j after s own steps (its input token is x_{j+1+s}, the true token: a chain
        only matters while its drafts equal the target's tokens).

        starts: bool [B, T], the chain starts whose steps >= 1 are wanted (None: all). Those
        steps then run only over each row's span from its first to its last wanted start, and
        their outputs are zero elsewhere: training skips the chains of prompt positions, which
        no loss grades. Step 0 always runs everywhere (its keys are every chain's context)."""
        ids = batch.token_ids
        B, T = ids.shape
        feat = self.fuse({layer: batch.hidden[layer].float() for layer in self.serving_layers})
        if noise:
            feat = feat + (torch.rand_like(feat) - 0.5) * 2 * noise
        positions = torch.arange(T, device=ids.device).expand(B, T)
        out, (k, v) = self.block(*self.layer_input(target.embed(shift_left(ids, 1)).float(), feat), positions,
                                 return_kv=True)
        outs, base_kv, chain_kv = [out], (k, v, positions), []
        if steps == 1:
            return outs
        span = _start_span(starts)  # (index [B, S], valid [B, S]) or None: all
        index = positions if span is None else span[0]
        feat = out if span is None else out.gather(1, index.unsqueeze(-1).expand(-1, -1, out.shape[-1]))
        for s in range(1, steps):
            emb = target.embed(shift_left(ids, 1 + s).gather(1, index)).float()
            resid, attn_in = self.layer_input(emb, feat)
            out, kv = self.block.forward_unrolled(resid, attn_in, index + s, base_kv, chain_kv, starts=index)
            chain_kv.append(kv)
            feat = out
            if span is not None:  # back to [B, T, H]: zeros outside the wanted span
                b, i = span[1].nonzero(as_tuple=True)
                out = out.new_zeros(B, T, out.shape[-1]).index_put((b, index[b, i]), out[b, i])
            outs.append(out)
        return outs

    @torch.no_grad()
    def draft_accuracy(self, batch: TrainBatch, target: TargetParts, k: int) -> torch.Tensor:
        greedy = target_argmax(batch, target)
        b0, t0, _ = chain_rows(batch, 0)
        outs = self.unroll(batch, target, k, starts=batch.loss_mask)
        correct = torch.zeros(len(b0), k, dtype=torch.bool, device=greedy.device)
        for s, out in enumerate(outs):
            b, t, valid = chain_rows(batch, 1 + s)
            draft = self.to_target_ids(self.head_logits(out[b0, t0], target).argmax(-1))
            correct[:, s] = valid & (draft == greedy[b, t])
        return correct


@register_head("eagle")
class EagleHead(FeatureHead):
    def __init__(self, cfg: ModelConfig, feature_weight: float = 1.0, token_weight: float = 0.1,
                 feature_noise: float = 0.0, unroll_steps: int = 1, step_decay: float = 0.8) -> None:
        super().__init__()
        if unroll_steps < 1:
            raise ValueError(f"eagle needs unroll_steps >= 1, got {unroll_steps}")
        self.num_layers_target = cfg.num_layers
        self.feature_weight, self.token_weight, self.feature_noise = feature_weight, token_weight, feature_noise
        self.unroll_steps, self.step_decay = unroll_steps, step_decay
        H = cfg.hidden_size
        self.fc = nn.Linear(2 * H, H)
        self.norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.block = DraftBlock(cfg)

    @classmethod
    def build(cls, target: TargetParts, **options) -> "EagleHead":
        head = cls(target.config, **options)
        if target.layer_weights is not None:  # start from the target's last decoder layer
            weights = target.layer_weights(target.config.num_layers - 1)
            head.block.init_from(weights)
            with torch.no_grad():
                head.norm.weight.copy_(weights["attn_norm"])
        return head

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return (self.num_layers_target,)

    def config_dict(self) -> dict:
        return {"feature_weight": self.feature_weight, "token_weight": self.token_weight,
                "feature_noise": self.feature_noise, "unroll_steps": self.unroll_steps, "step_decay": self.step_decay}

    def fuse(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        return hidden[self.num_layers_target].float()

    def raw_layer_input(self, emb: torch.Tensor, feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.fc(torch.cat([emb, feat], dim=-1))
        return z, z

    @property
    def input_norms(self) -> tuple[nn.RMSNorm, ...]:
        return (self.norm,)

    def head_logits(self, out: torch.Tensor, target: TargetParts) -> torch.Tensor:
        return target.lm_head(out)

    def training_loss(self, batch: TrainBatch, target: TargetParts) -> tuple[torch.Tensor, dict[str, float]]:
        L = final_layer(target)
        hidden = batch.hidden[L].float()
        outs = self.unroll(batch, target, self.unroll_steps, self.feature_noise if self.training else 0.0,
                           starts=graded_starts(batch.loss_mask, self.unroll_steps))
        targets = masked_targets(batch, target)
        total, weights, metrics = hidden.new_zeros(()), 0.0, {}
        for s, out in enumerate(outs):
            # Chain j's step s predicts the feature at j + 1 + s and, through it, x_{j+2+s}
            # (an answer token where loss_mask[j + 1 + s]).
            b, j = torch.nonzero(batch.loss_mask[:, 1 + s :], as_tuple=True)
            if not len(b):
                continue
            pred = out[b, j]
            true = hidden[b, j + 1 + s]
            feature_loss = F.smooth_l1_loss(pred, true)
            p = torch.softmax(targets.rows(b, j + 1 + s), dim=-1)
            token_loss = soft_cross_entropy(target.lm_head(pred), p).mean()
            step_loss = self.feature_weight * feature_loss + self.token_weight * token_loss
            w = self.step_decay**s
            total, weights = total + w * step_loss, weights + w
            metrics[f"feature_loss_step{s}"] = float(feature_loss.detach())
            metrics[f"token_loss_step{s}"] = float(token_loss.detach())
        loss = total / max(weights, 1e-9)
        metrics["loss"] = float(loss.detach())
        return loss, metrics

