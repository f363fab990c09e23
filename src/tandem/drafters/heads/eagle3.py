"""EAGLE-3 (Li et al. 2025): fused low/mid/high target features, training-time test, reduced vocab.

g_j = fc([h_low; h_mid; h_high] at j) (3H -> H). The draft layer's residual stream is g_j and its
attention input concat(norm(embedding(x_{j+1})), norm(g_j)); the LM head sees norm(output) and
the next chain step feeds the un-normed output back as its feature. Training unrolls the chain
`unroll_steps` times on its own features (step weights decay^s) with soft cross-entropy to the
target's distribution restricted to the draft vocabulary (logits computed over those rows only),
positions whose next token (the target's own, in self-distilled data) falls outside it masked.
The draft vocabulary (draft_ids, a buffer saved with the head) holds the target ids the head can
propose; drafters map back and report q over the full target vocab.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from tandem.drafters.heads.base import (
    TargetParts,
    TrainBatch,
    final_layer,
    masked_mean,
    masked_targets,
    register_head,
    soft_cross_entropy,
    top1_agrees,
)
from tandem.drafters.heads.block import DraftBlock
from tandem.drafters.heads.eagle import FeatureHead, graded_starts, shift_left
from tandem.model.arch import ModelConfig


def default_layers(num_layers: int) -> tuple[int, int, int]:
    """Low / middle / high target layers to fuse: outputs of layers 1, L/2-1 and L-4 as in EAGLE-3
    (its hidden_states 2, L//2, L-3 count the embedding as 0); evenly spread for shallow models."""
    L = num_layers
    if L >= 8:
        return (1, L // 2 - 1, L - 4)
    return (0, (L - 1) // 2, L - 1)


def draft_vocab_from_counts(counts: Sequence[float] | Mapping[int, float] | torch.Tensor, size: int,
                            vocab_size: int) -> list[int]:
    """The `size` most frequent target ids (ties: lower id first), ascending.

    counts: per-id counts over the target vocab (a [V] sequence/tensor) or {id: count}.
    """
    if isinstance(counts, Mapping):
        dense = torch.zeros(vocab_size, dtype=torch.float64)
        for i, c in counts.items():
            dense[int(i)] = float(c)
    else:
        dense = torch.as_tensor(counts, dtype=torch.float64)
    if dense.shape != (vocab_size,):
        raise ValueError(f"token counts must cover the target vocab ({vocab_size} ids), got shape {tuple(dense.shape)}")
    size = min(size, vocab_size)
    # Stable descending sort keeps lower ids first among equal counts.
    order = torch.sort(dense, descending=True, stable=True).indices[:size]
    return sorted(order.tolist())


def draft_vocab_ids(method: str, vocab_size: int, draft_vocab: Sequence[int] | None,
                    token_counts: Sequence[float] | Mapping[int, float] | torch.Tensor | None,
                    draft_vocab_size: int | None) -> list[int]:
    """The ascending target ids a head drafts over: draft_vocab itself, the draft_vocab_size
    most frequent ids of token_counts, or (neither given) the whole vocabulary."""
    if draft_vocab is not None and token_counts is not None:
        raise ValueError(f"give {method} either draft_vocab (ids) or token_counts, not both")
    if token_counts is not None:
        if not draft_vocab_size:
            raise ValueError(f"{method} token_counts need draft_vocab_size (how many of the most frequent ids to keep)")
        draft_vocab = draft_vocab_from_counts(token_counts, draft_vocab_size, vocab_size)
    if draft_vocab is None:
        return list(range(vocab_size))
    ids = sorted({int(i) for i in draft_vocab})
    if not ids or ids[0] < 0 or ids[-1] >= vocab_size:
        raise ValueError(f"draft_vocab ids must lie in [0, {vocab_size}) and be non-empty")
    return ids


class FusedLayersVocab:
    """What EAGLE-3 and DFlash heads share: they read the target's hidden states of `layers`
    (the final layer L too in training, for the target's distributions) and draft over a reduced
    vocabulary `draft_ids` through `lm_head` after `out_norm`."""

    layers: tuple[int, ...]
    num_layers_target: int
    draft_ids: torch.Tensor
    out_norm: nn.RMSNorm
    lm_head: nn.Linear

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.layers))) + (self.num_layers_target,)

    @property
    def serving_layers(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.layers)))

    @property
    def draft_vocab_size(self) -> int | None:
        return len(self.draft_ids)

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Indices into the draft vocabulary -> target token ids."""
        return self.draft_ids.to(ids.device)[ids]

    def add_vocab_head(self, cfg: ModelConfig, draft_vocab_size: int | None) -> None:
        """out_norm, lm_head over draft_vocab_size ids (None: the whole vocabulary) and the
        draft_ids buffer (filled by init_vocab_head)."""
        vocab = draft_vocab_size or cfg.vocab_size
        if not 1 <= vocab <= cfg.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {cfg.vocab_size}], got {draft_vocab_size}")
        self.out_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        self.register_buffer("draft_ids", torch.arange(vocab, dtype=torch.long))

    def init_vocab_head(self, target: TargetParts, ids: list[int]) -> None:
        """Draft over `ids`, the LM head starting as the target's own rows of them with its final
        norm folded into out_norm (rms_norm of a ones vector returns the norm's weight)."""
        with torch.no_grad():
            self.draft_ids.copy_(torch.tensor(ids, dtype=torch.long))
            self.out_norm.weight.copy_(target.final_norm(torch.ones(target.config.hidden_size)))
            if target.lm_head_weight is not None:
                self.lm_head.weight.copy_(target.lm_head_weight[self.draft_ids])


@register_head("eagle3")
class Eagle3Head(FusedLayersVocab, FeatureHead):
    def __init__(self, cfg: ModelConfig, layers: Sequence[int] | None = None, draft_vocab_size: int | None = None,
                 unroll_steps: int = 7, step_decay: float = 0.8, intermediate_size: int | None = None) -> None:
        super().__init__()
        L, H = cfg.num_layers, cfg.hidden_size
        self.layers = tuple(int(i) for i in (layers if layers is not None else default_layers(L)))
        if len(self.layers) != 3 or not all(0 <= i < L for i in self.layers):
            raise ValueError(f"eagle3 fuses 3 target layers in [0, {L}), got {list(self.layers)}")
        if unroll_steps < 1:
            raise ValueError(f"eagle3 needs unroll_steps >= 1, got {unroll_steps}")
        self.num_layers_target = L
        self.unroll_steps, self.step_decay = unroll_steps, step_decay
        self.intermediate_size = intermediate_size or cfg.intermediate_size
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.embed_norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.feature_norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.block = DraftBlock(cfg, attn_in_features=2 * H, intermediate_size=self.intermediate_size)
        self.add_vocab_head(cfg, draft_vocab_size)

    @classmethod
    def build(cls, target: TargetParts, draft_vocab: Sequence[int] | None = None,
              token_counts: Sequence[float] | Mapping[int, float] | torch.Tensor | None = None,
              draft_vocab_size: int | None = None, **options) -> "Eagle3Head":
        """draft_vocab: the target ids to draft over; or token_counts (per target id, e.g. from
        the training answers) + draft_vocab_size: the most frequent ids. Neither: the full vocab."""
        ids = draft_vocab_ids("eagle3", target.config.vocab_size, draft_vocab, token_counts, draft_vocab_size)
        head = cls(target.config, draft_vocab_size=len(ids), **options)
        head.init_vocab_head(target, ids)
        return head

    def config_dict(self) -> dict:
        return {"layers": list(self.layers), "draft_vocab_size": len(self.draft_ids), "unroll_steps": self.unroll_steps,
                "step_decay": self.step_decay, "intermediate_size": self.intermediate_size}

    def fuse(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        return self.fc(torch.cat([hidden[i].float() for i in self.layers], dim=-1))

    input_is_embedding_and_feature = True

    def raw_layer_input(self, emb: torch.Tensor, feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return feat, torch.cat([emb, feat], dim=-1)

    @property
    def input_norms(self) -> tuple[nn.RMSNorm, ...]:
        return (self.embed_norm, self.feature_norm)

    @property
    def vocab_head(self) -> tuple[nn.RMSNorm, nn.Module]:
        return (self.out_norm, self.lm_head)

    def head_logits(self, out: torch.Tensor, target: TargetParts) -> torch.Tensor:
        return self.lm_head(self.out_norm(out))

    def in_draft_vocab(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Bool per target id: whether the head can propose it."""
        return torch.isin(target_ids, self.draft_ids.to(target_ids.device))

    def training_loss(self, batch: TrainBatch, target: TargetParts) -> tuple[torch.Tensor, dict[str, float]]:
        hidden = batch.hidden[final_layer(target)]
        outs = self.unroll(batch, target, self.unroll_steps, starts=graded_starts(batch.loss_mask, self.unroll_steps))
        # The target's logits over the draft vocabulary only (softmax of them = its distribution
        # restricted to the draft vocab); a position counts when the target's next token, the
        # answer token of the self-distilled sequence, is one the head can propose.
        targets = masked_targets(batch, target, columns=self.draft_ids)
        next_in_vocab = self.in_draft_vocab(shift_left(batch.token_ids, 1))
        total, weights, metrics = hidden.new_zeros(()), 0.0, {}
        for s, out in enumerate(outs):
            # Step s of the chain starting at j is graded at position j + 1 + s (see unroll).
            b, j = torch.nonzero(batch.loss_mask[:, 1 + s :], as_tuple=True)
            if not len(b):
                continue
            valid = next_in_vocab[b, j + 1 + s]
            p = torch.softmax(targets.rows(b, j + 1 + s), dim=-1)
            logits = self.head_logits(out[b, j], target)
            step_loss = masked_mean(soft_cross_entropy(logits, p), valid)
            w = self.step_decay**s
            total, weights = total + w * step_loss, weights + w
            metrics[f"loss_step{s}"] = float(step_loss.detach())
            metrics[f"top1_step{s}"] = float(masked_mean(top1_agrees(logits, p), valid))
        loss = total / max(weights, 1e-9)
        metrics["loss"] = float(loss.detach())
        return loss, metrics
