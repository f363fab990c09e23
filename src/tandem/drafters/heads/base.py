"""The contract between trained draft heads, the trainer and the inference drafters.

One module is both trained and served: `tandem train` builds a `DraftHead` (io.build_head),
optimises `training_loss` on self-distilled batches, and io.save_head writes it; the `medusa` /
`eagle` / `eagle3` / `mtp` drafters io.load_head the same class and draft with it.

Hidden-layer convention (as DrafterNeeds): layer i in [0, L) is the output of decoder layer i,
layer L is the final normed hidden state (the LM head's input).

Position convention shared by every head (worked example): in a sequence x_0..x_{T-1}, the
target's hidden state at position t belongs to token x_t, and its logits (lm_head(hidden L at t))
predict x_{t+1}. A chain drafted "from position t" already knows x_{t+1} (the target produced it)
and proposes d_1 = x_{t+2}, d_2 = x_{t+3}, ...: draft position i (1-based) is graded against the
target's argmax at position t + i. With loss_mask[t] True (x_{t+1} is an answer token), a head
trains draft position i on the target's distribution at t + i wherever loss_mask[t + i] holds.

Additions to the original contract (all keep the old names working):
- TargetParts.lm_head_weight / embed_weight / layer_weights (optional), TargetParts.from_loaded
  (float32 copies for training), TargetParts.serving (the target's own modules, for drafting),
  signature().
- DraftHead.serving_layers (layers a drafter needs at inference; defaults to hidden_layers),
  DraftHead.build / from_config / export / draft_vocab_size, and the head registry (register_head).
  Heads made by build_head / load_head carry `target_parts`, `target_config`, `target_signature`.
- Loss helpers shared by the heads: masked_targets, target_logits, target_argmax, soft_cross_entropy,
  masked_mean, chain_rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.drafters import registry
from tandem.model.arch import ModelConfig
from tandem.sampling import row_argmax

# Rows of target logits materialised at once (49k-vocab fp32 logits: 1024 rows = 200 MB).
LOGIT_CHUNK = 1024
# Evenly spaced embedding rows compared by load_head to recognise the target a head was trained on.
SIGNATURE_ROWS = 16


class _Frozen:
    """A float32 tensor kept on the device it is asked for (a per-device copy is cached), so
    training on CUDA needs no explicit `.to()` of the target parts: the device follows the batch."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._copies = {tensor.device: tensor.detach().float()}

    def on(self, device: torch.device) -> torch.Tensor:
        if device not in self._copies:
            self._copies[device] = next(iter(self._copies.values())).to(device)
        return self._copies[device]


@dataclass
class TargetParts:
    """The frozen pieces of the target a head trains and drafts against (no grad).

    embed: token ids [...] -> embeddings [..., H] (the target's scale applied, as its layer 0 sees).
    lm_head: final normed hidden [..., H] -> logits [..., V] (softcap applied where the target has one).
    final_norm: output of the last decoder layer [..., H] -> final normed hidden [..., H].
    All three return float32. `from_loaded` builds float32 copies (training); `serving` wraps the
    target's own (possibly quantized, bf16) modules so drafting costs what the target's head costs.
    lm_head_weight / embed_weight: the float32 [V, H] LM head and (unscaled) embedding weights
    (heads with a reduced vocabulary slice the first; draft_model exports both), None when serving.
    layer_weights(i): float32 weights of decoder layer i by role ("attn_norm", "qkv", "o",
    "mlp_norm", "gate_up", "down"), for heads initialised from target layers.
    embed_table / embed_scale: when serving, the target's own embedding table (no copy) and the
    scale `embed` applies (1.0 where it has none), for native drafting loops that look tokens up
    themselves (heads/native.py).
    """

    config: ModelConfig
    model_name: str
    embed: Callable[[torch.Tensor], torch.Tensor]
    lm_head: Callable[[torch.Tensor], torch.Tensor]
    final_norm: Callable[[torch.Tensor], torch.Tensor]
    lm_head_weight: torch.Tensor | None = None
    layer_weights: Callable[[int], dict[str, torch.Tensor]] | None = None
    embed_weight: torch.Tensor | None = None
    embed_table: torch.Tensor | None = None
    embed_scale: float = 1.0

    @classmethod
    def from_loaded(cls, loaded: Any) -> "TargetParts":
        """Float32 copies of a LoadedModel's embedding, final norm and LM head (dequantised)."""
        model, cfg = loaded.model, loaded.config
        embed_w = _Frozen(model.embed)
        scale = model.embed_scale
        norm_w, eps = _Frozen(model.norm.weight), model.norm.eps
        head = model.lm_head.dequantize(torch.float32)
        head_w = _Frozen(head)
        cap = cfg.final_logit_softcap

        def embed(ids: torch.Tensor) -> torch.Tensor:
            x = F.embedding(ids, embed_w.on(ids.device))
            return x * scale if scale is not None else x

        def final_norm(x: torch.Tensor) -> torch.Tensor:
            w = norm_w.on(x.device)
            return F.rms_norm(x.float(), w.shape, w, eps)

        def lm_head(x: torch.Tensor) -> torch.Tensor:
            return _softcap(F.linear(x.float(), head_w.on(x.device)), cap)

        def layer_weights(i: int) -> dict[str, torch.Tensor]:
            layer = model.layers[i]
            return {
                "attn_norm": layer.attn_norm.weight.detach().float().clone(),
                "qkv": layer.qkv.dequantize(torch.float32),
                "o": layer.o.dequantize(torch.float32),
                "mlp_norm": layer.mlp_norm.weight.detach().float().clone(),
                "gate_up": layer.gate_up.dequantize(torch.float32),
                "down": layer.down.dequantize(torch.float32),
            }

        return cls(cfg, loaded.name, embed, lm_head, final_norm, head, layer_weights, model.embed.detach().float())

    @classmethod
    def serving(cls, loaded: Any) -> "TargetParts":
        """The target's own embedding, final norm and LM head in its serving dtype (no copies);
        inputs are cast to that dtype and outputs returned as float32."""
        model, cfg = loaded.model, loaded.config
        dtype = model.dtype

        def embed(ids: torch.Tensor) -> torch.Tensor:
            return model.embed_tokens(ids.to(model.embed.device)).float()

        def final_norm(x: torch.Tensor) -> torch.Tensor:
            return model.norm(x.to(dtype)).float()

        def lm_head(x: torch.Tensor) -> torch.Tensor:
            return _softcap(model.lm_head(x.to(dtype)).float(), cfg.final_logit_softcap)

        scale = model.embed_scale if model.embed_scale is not None else 1.0
        return cls(cfg, loaded.name, embed, lm_head, final_norm, embed_table=model.embed.detach(), embed_scale=scale)

    def signature(self) -> torch.Tensor:
        """[SIGNATURE_ROWS, H] float32: embeddings of evenly spaced ids, recorded with a head so
        a load against another target (same shapes, other weights) is refused."""
        ids = torch.linspace(0, self.config.vocab_size - 1, SIGNATURE_ROWS).long()
        return self.embed(ids).float().cpu()


def _softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return torch.tanh(logits / cap) * cap if cap else logits


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


def register_head(name: str) -> Callable[[type["DraftHead"]], type["DraftHead"]]:
    """Class decorator: the head class trained and served under method `name`, in the same
    table of methods as the drafters (drafters/registry.py)."""

    def wrap(cls: type[DraftHead]) -> type[DraftHead]:
        registry.add(name, "head", cls)
        cls.method = name
        return cls

    return wrap


def head_class(method: str) -> type["DraftHead"]:
    cls = registry.lookup(method, "head")
    if cls is None:
        raise ValueError(f"unknown draft-head method {method!r}; available: {', '.join(head_methods())}")
    return cls


def head_methods() -> list[str]:
    return registry.names("head")


class DraftHead(nn.Module):
    """Base of every trained drafter module (medusa, eagle, eagle3, mtp, dflash heads, draft_model)."""

    method: str = ""

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """Target layers whose hidden states training batches and drafting inputs must carry."""
        raise NotImplementedError

    @property
    def serving_layers(self) -> tuple[int, ...]:
        """The subset of hidden_layers a drafter reads at inference (training may need more,
        e.g. layer L for the target's distributions)."""
        return self.hidden_layers

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

    def calibrate(self, batches, target: TargetParts) -> dict | None:
        """Fit what a head calibrates after training (DSpark: its confidences) on held-out
        TrainBatches; returns what to record (None: nothing to calibrate)."""
        return None

    def config_dict(self) -> dict:
        """Everything `from_config` needs to rebuild the module (sizes, layers, draft vocab size)."""
        raise NotImplementedError

    @classmethod
    def from_config(cls, config: dict, target: TargetParts) -> "DraftHead":
        """An untrained module of the shape `config` (a config_dict()) describes; load_head then
        fills its state_dict."""
        return cls(target.config, **config)

    @classmethod
    def build(cls, target: TargetParts, **options) -> "DraftHead":
        """A fresh module for `target`, initialised for training (io.build_head calls this)."""
        return cls(target.config, **options)

    def export(self, out_dir, target_name: str, tokenizer, dtype: torch.dtype) -> None:
        """Extra files save_head writes next to head.json (draft_model: a loadable model dir)."""

    @property
    def draft_vocab_size(self) -> int | None:
        """Size of a reduced draft vocabulary, None when the head drafts over the target's."""
        return None

    @property
    def max_draft_tokens(self) -> int | None:
        """The most tokens one draft of this head can hold (medusa's heads, mtp's modules, a
        block's drafts); None when it drafts autoregressively as far as asked."""
        return None


# ---- loss and accuracy helpers shared by the heads -----------------------------------------------


def final_layer(target: TargetParts) -> int:
    return target.config.num_layers


def chain_rows(batch: TrainBatch, offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every loss-masked start (b, t): (b, t + offset, valid) where valid says that position
    t + offset is inside the row and loss-masked (its next token is an answer token).

    Example: loss_mask row [F, T, T, F] (answer tokens x_2, x_3), offset 1: starts t = 1, 2 ->
    positions 2, 3 -> valid [True, False].
    """
    b, t = batch.loss_mask.nonzero(as_tuple=True)
    pos = t + offset
    inside = pos < batch.loss_mask.shape[1]
    clamped = pos.clamp(max=batch.loss_mask.shape[1] - 1)
    valid = inside & batch.loss_mask[b, clamped]
    return b, clamped, valid


@torch.no_grad()
def target_logits(target: TargetParts, hidden: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
    """Target logits [N, V] for final normed hidden rows [N, H], computed in row chunks.

    columns: only these vocabulary ids ([N, len(columns)], in that order), from the matching
    rows of lm_head_weight: a reduced draft vocabulary costs its own size, not the target's.
    Always float32: under a bf16-mixed training step the teacher's logits are not rounded.
    """
    with torch.autocast(hidden.device.type, enabled=False):
        return _target_logits(target, hidden, columns)


def _target_logits(target: TargetParts, hidden: torch.Tensor, columns: torch.Tensor | None) -> torch.Tensor:
    if columns is None:
        if not len(hidden):
            return hidden.new_zeros(0, target.config.vocab_size)
        return torch.cat([target.lm_head(chunk).float() for chunk in hidden.split(LOGIT_CHUNK)])
    if target.lm_head_weight is None:
        raise ValueError("target logits over a column subset need TargetParts.lm_head_weight (TargetParts.from_loaded)")
    weight = target.lm_head_weight.to(hidden.device)[columns.to(hidden.device)]
    cap = target.config.final_logit_softcap
    if not len(hidden):
        return hidden.new_zeros(0, len(columns))
    return torch.cat([_softcap(F.linear(chunk.float(), weight), cap) for chunk in hidden.split(LOGIT_CHUNK)])


@dataclass
class MaskedTargets:
    """The target's logits at every loss-masked position of a batch, computed once per batch
    (every draft position of every head reads some of them: the graded position t + i of a
    chain starting at t is loss-masked exactly when its next token is an answer token).

    row_of [B, T] long: row of `logits` for position (b, t), -1 where not loss-masked.
    logits [N, V] float32.
    """

    row_of: torch.Tensor
    logits: torch.Tensor

    def rows(self, b: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Logits at positions (b, t), which must be loss-masked."""
        return self.logits[self.row_of[b, t]]


@torch.no_grad()
def masked_targets(batch: TrainBatch, target: TargetParts, columns: torch.Tensor | None = None) -> MaskedTargets:
    """columns: as target_logits (logits over a reduced vocabulary only)."""
    b, t = batch.loss_mask.nonzero(as_tuple=True)
    row_of = torch.full(batch.loss_mask.shape, -1, dtype=torch.long, device=batch.loss_mask.device)
    row_of[b, t] = torch.arange(len(b), device=row_of.device)
    return MaskedTargets(row_of, target_logits(target, batch.hidden[final_layer(target)][b, t], columns))


@torch.no_grad()
def target_argmax(batch: TrainBatch, target: TargetParts) -> torch.Tensor:
    """[B, T] long: the target's greedy next token after each position (from hidden L)."""
    h = batch.hidden[final_layer(target)]
    B, T, H = h.shape
    flat = h.reshape(B * T, H)
    out = torch.cat([target.lm_head(c).argmax(-1) for c in flat.split(LOGIT_CHUNK)]) if B * T else flat.new_zeros(0).long()
    return out.reshape(B, T)


def top1_agrees(logits: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """[N] float, 1 where a row of `logits` and the same row of `reference` (logits or
    probabilities) have the same argmax: the head's top-1 is the teacher's (a training metric)."""
    return (row_argmax(logits) == row_argmax(reference)).float()


def soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """[N] cross-entropy of log_softmax(logits) against target probabilities `probs`."""
    return -(probs * torch.log_softmax(logits.float(), dim=-1)).sum(-1)


def masked_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over valid entries; 0 (with a graph) when none is valid."""
    n = valid.sum()
    return (values * valid).sum() / n.clamp(min=1)
