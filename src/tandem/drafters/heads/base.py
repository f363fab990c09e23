"""The contract between trained draft heads, the trainer and the inference drafters.

One module is both trained and served: `tandem train` builds a `DraftHead`, optimises
`training_loss` on self-distilled batches, and `save_head` writes it; the `medusa` / `eagle` /
`eagle3` / `mtp` drafters `load_head` the same class and draft with it.

Hidden-layer convention (as DrafterNeeds): layer i in [0, L) is the output of decoder layer i,
layer L is the final normed hidden state (the LM head's input).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from tandem.model.arch import ModelConfig


@dataclass
class TargetParts:
    """The frozen pieces of the target a head trains and drafts against (float32, no grad).

    embed: token ids [...] -> embeddings [..., H] (the target's scale applied, as its layer 0 sees).
    lm_head: final normed hidden [..., H] -> logits [..., V] (softcap applied where the target has one).
    final_norm: output of the last decoder layer [..., H] -> final normed hidden [..., H].
    """

    config: ModelConfig
    model_name: str
    embed: Callable[[torch.Tensor], torch.Tensor]
    lm_head: Callable[[torch.Tensor], torch.Tensor]
    final_norm: Callable[[torch.Tensor], torch.Tensor]


@dataclass
class TrainBatch:
    """Self-distilled sequences (prompt + the target's own answer), right-padded.

    token_ids [B, T]; lengths [B] (valid tokens per row); loss_mask [B, T]: True where the token at
    t + 1 is an answer token the drafter should learn to predict from position t.
    hidden {layer: [B, T, H]} float32: the target's hidden states at every position of the layers
    the head declared (`DraftHead.hidden_layers`).
    """

    token_ids: torch.Tensor
    lengths: torch.Tensor
    loss_mask: torch.Tensor
    hidden: dict[int, torch.Tensor]


class DraftHead(nn.Module):
    """Base of every trained drafter module (medusa, eagle, eagle3, mtp heads)."""

    method: str = ""

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """Target layers whose hidden states training batches and drafting inputs must carry."""
        raise NotImplementedError

    def training_loss(self, batch: TrainBatch, target: TargetParts) -> tuple[torch.Tensor, dict[str, float]]:
        """Scalar loss to minimise + named float metrics for logs (e.g. per-term losses)."""
        raise NotImplementedError

    @torch.no_grad()
    def draft_accuracy(self, batch: TrainBatch, target: TargetParts, k: int) -> torch.Tensor:
        """[N, k] bool over the N loss-masked positions of the batch: whether draft position i
        (1-based i+1 tokens ahead) equals the target's own next token, drafting from the true
        prefix as the drafter would at inference (its own earlier draft tokens, autoregressive heads
        included). The trainer turns it into per-position acceptance and expected tau =
        1 + sum_i mean(prod_{j<=i} correct_j)."""
        raise NotImplementedError

    def config_dict(self) -> dict:
        """Everything `from_config` needs to rebuild the module (sizes, layers, draft vocab size)."""
        raise NotImplementedError
