"""DFlash (block-diffusion drafting): a few decoder layers propose a whole block in one forward.

The block's input is [anchor, MASK x (B-1)] at positions a .. a+B-1, where the anchor x_a is the
last committed token and MASK a learned embedding (the tokenizer has no mask token). The head has
no embedding of its own: the anchor is embedded by the target's frozen embedding.

Context: the target's hidden states of `layers` (spread over its depth) at every position before
the anchor are concatenated and turned into one feature per position, c_t = norm(fc([h_l1; h_l2;
h_l3] at t)). Every draft layer projects c_t into extra keys and values with its own k/v
projections (the same c_t for every layer), at position t. Block queries attend to all of that
context and, in both directions, to the keys of their own block; mask position j (offset j from
the anchor) predicts x_{a+j}, so one forward gives B-1 draft tokens. Logits are over a reduced
draft vocabulary (as EAGLE-3: the most frequent ids of the training answers).

Training (training_loss): random anchors per sequence (several blocks per sequence, each anchor
an answer position or the last prompt token), a block-causal mask (a block sees the context
before its anchor plus its own block), soft cross-entropy to the target's distribution over the
draft vocabulary at the position each mask token is graded, weighted exp(-(j-1)/gamma) by
position j. Positions whose target token falls outside the draft vocabulary are masked.

Inference (drafters/dflash.py) keeps, per request and layer, the context keys and values of the
true target features, extends them with the features of newly committed tokens, and drops the
block's own keys after the pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
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
from tandem.drafters.heads.eagle3 import (
    FusedLayersVocab,
    default_layers,
    draft_vocab_ids,
)
from tandem.model.arch import ModelConfig

# Blocks of one sequence evaluated together by draft_accuracy (bounds the attention mask's size).
EVAL_BLOCKS = 32


class DFlashLayer(nn.Module):
    """One draft layer: an input norm and a DraftBlock (attention + gated MLP)."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.block = DraftBlock(cfg, intermediate_size=intermediate_size)

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, hkv, T, D] of context features [B, T, H] at positions [B, T]."""
        _, k, v = self.block.qkv_heads(context, positions)
        return k, v


@register_head("dflash")
class DFlashHead(FusedLayersVocab, DraftHead):
    def __init__(self, cfg: ModelConfig, layers: Sequence[int] | None = None, num_draft_layers: int = 2,
                 block_size: int = 8, draft_vocab_size: int | None = None, gamma: float = 4.0,
                 anchors_per_sequence: int = 12, intermediate_size: int | None = None) -> None:
        super().__init__()
        L, H = cfg.num_layers, cfg.hidden_size
        self.layers = tuple(int(i) for i in (layers if layers is not None else default_layers(L)))
        if not self.layers or not all(0 <= i < L for i in self.layers):
            raise ValueError(f"dflash reads target layers in [0, {L}), got {list(self.layers)}")
        if num_draft_layers < 1:
            raise ValueError(f"dflash needs num_draft_layers >= 1, got {num_draft_layers}")
        if block_size < 2:
            raise ValueError(f"dflash needs block_size >= 2 (an anchor and at least one mask), got {block_size}")
        if not gamma > 0:
            raise ValueError(f"dflash needs gamma > 0, got {gamma}")
        if anchors_per_sequence < 1:
            raise ValueError(f"dflash needs anchors_per_sequence >= 1, got {anchors_per_sequence}")
        self.num_layers_target = L
        self.num_draft_layers, self.block_size, self.gamma = num_draft_layers, block_size, gamma
        self.anchors_per_sequence = anchors_per_sequence
        self.intermediate_size = intermediate_size or cfg.intermediate_size
        self.fc = nn.Linear(len(self.layers) * H, H, bias=False)
        self.context_norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(H))
        self.draft_layers = nn.ModuleList(DFlashLayer(cfg, self.intermediate_size) for _ in range(num_draft_layers))
        self.add_vocab_head(cfg, draft_vocab_size)

    @classmethod
    def build(cls, target: TargetParts, token_counts: Sequence[float] | Mapping[int, float] | torch.Tensor | None = None,
              draft_vocab_size: int | None = None, **options) -> "DFlashHead":
        """A fresh head: draft vocabulary = the draft_vocab_size most frequent ids of token_counts
        (or the full vocabulary); draft layers start as the target's last layers, the LM head as
        the target's rows of the draft vocabulary, fc as a copy of the deepest fused layer."""
        cfg = target.config
        ids = draft_vocab_ids("dflash", cfg.vocab_size, None, token_counts, draft_vocab_size)
        head = cls(cfg, draft_vocab_size=len(ids), **options)
        head.init_vocab_head(target, ids)
        H = cfg.hidden_size
        with torch.no_grad():
            head.fc.weight.zero_()
            head.fc.weight[:, -H:] = torch.eye(H)  # c_t starts as the normed deepest fused layer
            if target.embed_weight is not None:  # MASK starts as the mean token embedding
                head.mask_embedding.copy_(target.embed(torch.arange(min(cfg.vocab_size, 4096))).mean(0))
            if target.layer_weights is not None:
                for i, layer in enumerate(head.draft_layers):
                    weights = target.layer_weights(cfg.num_layers - head.num_draft_layers + i)
                    layer.block.init_from(weights)
                    layer.norm.weight.copy_(weights["attn_norm"])
        return head

    def config_dict(self) -> dict:
        return {"layers": list(self.layers), "num_draft_layers": self.num_draft_layers, "block_size": self.block_size,
                "draft_vocab_size": len(self.draft_ids), "gamma": self.gamma,
                "anchors_per_sequence": self.anchors_per_sequence, "intermediate_size": self.intermediate_size}

    # ---- pieces shared by training and drafting --------------------------------------------------

    def context(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """The target's hidden states of `layers` [..., H] each -> context features [..., H]."""
        return self.context_norm(self.context_projection(hidden))

    def context_projection(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """The context features before context_norm (which the block kernels fuse into the
        draft layers' k/v projections)."""
        return self.fc(torch.cat([hidden[i].float() for i in self.layers], dim=-1))

    def block_input(self, anchor_emb: torch.Tensor, size: int) -> torch.Tensor:
        """[..., H] anchor embeddings -> [..., size, H] block inputs [anchor, MASK x (size-1)]."""
        masks = self.mask_embedding.expand(*anchor_emb.shape[:-1], size - 1, anchor_emb.shape[-1])
        return torch.cat([anchor_emb.unsqueeze(-2), masks.to(anchor_emb.dtype)], dim=-2)

    def head_logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.out_norm(out))

    # ---- training --------------------------------------------------------------------------------

    def block_logits(self, batch: TrainBatch, target: TargetParts, context: torch.Tensor, anchors: torch.Tensor,
                     size: int) -> torch.Tensor:
        """Logits [B, m, size, V'] of blocks of `size` at anchors [B, m] (positions in the batch,
        >= 1), each block seeing the context before its anchor and its own block."""
        return self.head_logits(self.block_states(batch, target, context, anchors, size))

    def block_states(self, batch: TrainBatch, target: TargetParts, context: torch.Tensor, anchors: torch.Tensor,
                     size: int) -> torch.Tensor:
        """The last draft layer's output [B, m, size, H] (before out_norm) of the blocks
        block_logits scores."""
        B, T, _ = context.shape
        m = anchors.shape[1]
        offsets = torch.arange(size, device=anchors.device)
        q_pos = (anchors.unsqueeze(-1) + offsets).reshape(B, m * size)
        anchor_ids = batch.token_ids.gather(1, anchors)
        x = self.block_input(target.embed(anchor_ids).float(), size).reshape(B, m * size, -1)
        ctx_pos = torch.arange(T, device=anchors.device).expand(B, T)
        block_of = torch.arange(m, device=anchors.device).repeat_interleave(size)
        sees_context = ctx_pos.unsqueeze(1) < anchors.repeat_interleave(size, dim=1).unsqueeze(-1)  # [B, Q, T]
        sees_block = (block_of.unsqueeze(-1) == block_of.unsqueeze(0)).expand(B, -1, -1)  # [B, Q, Q]
        mask = torch.cat([sees_context, sees_block], dim=-1).unsqueeze(1)
        for layer in self.draft_layers:
            blk = layer.block
            kc, vc = layer.context_kv(context, ctx_pos)
            q, kb, vb = blk.qkv_heads(layer.norm(x), q_pos)
            k, v = blk._expand(torch.cat([kc, kb], dim=2)), blk._expand(torch.cat([vc, vb], dim=2))
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=blk.scale)
            x = blk.finish(x, attn)
        return x.reshape(B, m, size, -1)

    def sample_anchors(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(anchors [B, m], valid [B, m]): up to anchors_per_sequence distinct random positions a
        per row with a >= 1 and an answer token at a + 1 (loss_mask[a])."""
        mask = batch.loss_mask.clone()
        mask[:, 0] = False
        m = min(self.anchors_per_sequence, mask.shape[1])
        scores = torch.rand(mask.shape, device=mask.device).masked_fill(~mask, -1.0)
        top = scores.topk(m, dim=1)
        return top.indices, top.values >= 0

    def training_loss(self, batch: TrainBatch, target: TargetParts) -> tuple[torch.Tensor, dict[str, float]]:
        context = self.context({layer: batch.hidden[layer] for layer in self.serving_layers})
        anchors, valid_anchor = self.sample_anchors(batch)
        logits = self.block_logits(batch, target, context, anchors, self.block_size)[:, :, 1:]  # [B, m, S-1, V']
        B, T = batch.loss_mask.shape
        j = torch.arange(1, self.block_size, device=anchors.device)
        graded = anchors.unsqueeze(-1) + j - 1  # mask j predicts x_{a+j}: the target's logits at a+j-1
        inside = graded < T
        graded = graded.clamp(max=T - 1)
        rows = torch.arange(B, device=anchors.device)[:, None, None].expand_as(graded)
        next_ids = shift_left(batch.token_ids, 1)[rows, graded]
        valid = (valid_anchor.unsqueeze(-1) & inside & batch.loss_mask[rows, graded]
                 & torch.isin(next_ids, self.draft_ids.to(next_ids.device)))
        targets = masked_targets(batch, target, columns=self.draft_ids)
        b, i, jj = valid.nonzero(as_tuple=True)
        weights = torch.exp(-(j.float() - 1) / self.gamma)[jj]
        if not len(b):
            return logits.sum() * 0.0, {"loss": 0.0}
        p = torch.softmax(targets.rows(b, graded[b, i, jj]), dim=-1)
        picked = logits[b, i, jj]
        ce = soft_cross_entropy(picked, p)
        loss = (weights * ce).sum() / weights.sum()
        metrics = {"loss": float(loss.detach())}
        hits = top1_agrees(picked, p)
        for pos in range(1, min(self.block_size, 5)):
            sel = jj == pos - 1
            if sel.any():
                metrics[f"top1_pos{pos}"] = float(hits[sel].mean())
        return loss, metrics

    @property
    def max_draft_tokens(self) -> int:
        return self.block_size - 1

    @torch.no_grad()
    def draft_accuracy(self, batch: TrainBatch, target: TargetParts, k: int) -> torch.Tensor:
        if k > self.block_size - 1:
            raise ValueError(f"this dflash head drafts blocks of {self.block_size - 1} tokens; k={k} is more")
        greedy = target_argmax(batch, target)
        context = self.context({layer: batch.hidden[layer] for layer in self.serving_layers})
        b0, t0, _ = chain_rows(batch, 0)
        drafts = torch.zeros(len(b0), k, dtype=torch.long, device=greedy.device)
        B = batch.loss_mask.shape[0]
        for b in range(B):
            starts = (b0 == b).nonzero(as_tuple=True)[0]
            for chunk in starts.split(EVAL_BLOCKS):
                anchors = (t0[chunk] + 1).unsqueeze(0)  # the chain from t knows x_{t+1}: the anchor
                one = TrainBatch(batch.token_ids[b : b + 1], batch.lengths[b : b + 1], batch.loss_mask[b : b + 1], {})
                logits = self.block_logits(one, target, context[b : b + 1], anchors, self.block_size)[0, :, 1 : k + 1]
                drafts[chunk] = self.to_target_ids(logits.argmax(-1))
        correct = torch.zeros(len(b0), k, dtype=torch.bool, device=greedy.device)
        for s in range(k):
            b, t, valid = chain_rows(batch, 1 + s)
            correct[:, s] = valid & (drafts[:, s] == greedy[b, t])
        return correct

