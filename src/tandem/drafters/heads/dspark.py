"""DSpark: a DFlash block backbone, a sequential low-rank head and a calibrated confidence head.

Backbone. As DFlash (heads/dflash.py): one forward over [anchor, MASK x (S-1)] at positions
a .. a+S-1, attending to the target's fused context features before the anchor and, in both
directions, to its own block. Unlike DFlash the anchor's own output is used: output j predicts
x_{a+j+1}, so S inputs give S draft logits z_j (over the draft vocabulary).

Sequential head. A rank-r "Markov" bias from the previous draft token, e = M_in[x_{j-1}] (an
embedding over the draft vocabulary plus one row for any id outside it), bias = M_out e, is added
to z_j; tokens are drawn left to right, x_{j-1} before x_j (for j = 0 the previous token is the anchor). Each
token's q is then exactly the distribution it was drawn from given the tokens before it, and the
backbone never sees a drawn token: what decides about x_j is fixed before x_j is drawn.

Confidence head. l_j = w . [h_j ; e_j] + b, with h_j the normed backbone output at j, and
c_j = sigmoid(l_j / T_j + b_j): an estimate of P(x_j is accepted | x_0..x_{j-1} were). It reads
h_j and x_{j-1} only. Trained with binary cross-entropy against 1 - TV(q_j, p_j) at that position
(the probability a sampled token passes the q-ratio test), on detached inputs, so the confidence
is a probe that costs the drafts nothing. After training, `calibrate` fits a temperature T_j and
an offset b_j per position, separately for greedy and sampled requests, on held-out answers so
that the survival products a_j = prod_{i<=j} c_i match how often the first j tokens pass
(docs/algorithms.md, section 6). The temperature alone cannot lower a level learnt on training
answers, which the backbone drafts better than new ones; the offset can. The expected calibration
error uncalibrated, with the temperatures alone and with both goes into the training record.

Training loss per graded block position j (weights exp(-j/gamma)): soft cross-entropy to the
target's distribution (restricted to the draft vocabulary), plus tv_loss_weight x TV(q_j, p_j),
plus confidence_loss_weight x the confidence BCE. The previous token fed to the sequential head is
the true one (teacher forcing): at inference, when the tokens before j were accepted, they are the
target's own, which is what the self-distilled answers hold.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tandem.drafters.heads.base import (
    TargetParts,
    TrainBatch,
    chain_rows,
    masked_targets,
    register_head,
    soft_cross_entropy,
    target_argmax,
    top1_agrees,
)
from tandem.drafters.heads.dflash import EVAL_BLOCKS, DFlashHead
from tandem.drafters.heads.eagle import shift_left
from tandem.model.arch import ModelConfig

GREEDY, SAMPLED = 0, 1  # rows of confidence_temperature and confidence_offset
# Temperatures a calibration tries per position (log-spaced: sharper and flatter than trained),
# and offsets added to the tempered logit.
TEMPERATURE_GRID = torch.logspace(-1.2, 1.2, 97).tolist()
OFFSET_GRID = torch.linspace(-4.0, 4.0, 81).tolist()
ECE_BINS = 10


@register_head("dspark")
class DSparkHead(DFlashHead):
    def __init__(self, cfg: ModelConfig, layers: Sequence[int] | None = None, num_draft_layers: int = 2,
                 block_size: int = 8, draft_vocab_size: int | None = None, gamma: float = 4.0,
                 anchors_per_sequence: int = 12, intermediate_size: int | None = None, rank: int = 256,
                 tv_loss_weight: float = 1.0, confidence_loss_weight: float = 1.0) -> None:
        if block_size < 1:
            raise ValueError(f"dspark needs block_size >= 1, got {block_size}")
        if rank < 1:
            raise ValueError(f"dspark needs rank >= 1, got {rank}")
        if tv_loss_weight < 0 or confidence_loss_weight < 0:
            raise ValueError("dspark loss weights must be >= 0")
        # The DFlash backbone checks block_size >= 2 (an anchor and a mask); a DSpark block of
        # one is the anchor alone, so it is built with room for one mask it never uses.
        super().__init__(cfg, layers, num_draft_layers, max(block_size, 2), draft_vocab_size, gamma,
                         anchors_per_sequence, intermediate_size)
        self.block_size = block_size
        self.rank, self.tv_loss_weight, self.confidence_loss_weight = rank, tv_loss_weight, confidence_loss_weight
        vocab = len(self.draft_ids)
        self.markov_in = nn.Embedding(vocab + 1, rank)  # row `vocab`: a previous id outside the draft vocabulary
        nn.init.normal_(self.markov_in.weight, std=0.02)
        self.markov_out = nn.Linear(rank, vocab, bias=False)
        nn.init.zeros_(self.markov_out.weight)  # a fresh head drafts as its backbone does
        self.confidence_weight = nn.Parameter(torch.zeros(cfg.hidden_size + rank))
        self.confidence_bias = nn.Parameter(torch.zeros(()))
        self.register_buffer("confidence_temperature", torch.ones(2, block_size))
        self.register_buffer("confidence_offset", torch.zeros(2, block_size))

    def config_dict(self) -> dict:
        return {**super().config_dict(), "block_size": self.block_size, "rank": self.rank,
                "tv_loss_weight": self.tv_loss_weight, "confidence_loss_weight": self.confidence_loss_weight}

    # ---- pieces shared by training and drafting --------------------------------------------------

    def draft_index(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> indices into the draft vocabulary (len(draft_ids) for ids outside it)."""
        ids = ids.to(self.draft_ids.device)
        at = torch.searchsorted(self.draft_ids, ids).clamp(max=len(self.draft_ids) - 1)
        return torch.where(self.draft_ids[at] == ids, at, len(self.draft_ids))

    def sequential(self, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft indices of the previous tokens [...] -> (their low-rank codes [..., r], the
        bias [..., V'] they add to the next position's logits)."""
        code = self.markov_in(previous)
        return code, self.markov_out(code)

    def confidence_logit(self, h: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        """Uncalibrated confidence logits [...] from normed backbone outputs [..., H] and codes [..., r]."""
        return torch.cat([h.float(), code.float()], dim=-1) @ self.confidence_weight + self.confidence_bias

    def calibration(self, greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per request (greedy: a bool per request) and block position, the temperature T_j and
        offset b_j of its kind [R, S] each: c_j = sigmoid(logit_j / T_j + b_j)."""
        row = torch.where(greedy.to(self.confidence_temperature.device), GREEDY, SAMPLED)
        return self.confidence_temperature[row], self.confidence_offset[row]

    # ---- training --------------------------------------------------------------------------------

    def training_loss(self, batch: TrainBatch, target: TargetParts) -> tuple[torch.Tensor, dict[str, float]]:
        S = self.block_size
        context = self.context({layer: batch.hidden[layer] for layer in self.serving_layers})
        anchors, valid_anchor = self.sample_anchors(batch)
        h = self.out_norm(self.block_states(batch, target, context, anchors, S))  # [B, m, S, H]
        B, T = batch.loss_mask.shape
        j = torch.arange(S, device=anchors.device)
        graded = anchors.unsqueeze(-1) + j  # output j predicts x_{a+j+1}: the target's logits at a+j
        inside = graded < T
        graded = graded.clamp(max=T - 1)
        rows = torch.arange(B, device=anchors.device)[:, None, None].expand_as(graded)
        next_ids = shift_left(batch.token_ids, 1)[rows, graded]
        valid = (valid_anchor.unsqueeze(-1) & inside & batch.loss_mask[rows, graded]
                 & torch.isin(next_ids, self.draft_ids.to(next_ids.device)))
        b, i, jj = valid.nonzero(as_tuple=True)
        if not len(b):
            return h.sum() * 0.0, {"loss": 0.0}
        targets = masked_targets(batch, target, columns=self.draft_ids)
        p = torch.softmax(targets.rows(b, graded[b, i, jj]), dim=-1)
        code, bias = self.sequential(self.draft_index(batch.token_ids[b, graded[b, i, jj]]))  # x_{a+j}: teacher forcing
        hb = h[b, i, jj]
        logits = self.lm_head(hb) + bias
        ce = soft_cross_entropy(logits, p)
        tv = 0.5 * (torch.softmax(logits.float(), dim=-1) - p).abs().sum(-1)
        conf = self.confidence_logit(hb.detach(), code.detach())
        bce = F.binary_cross_entropy_with_logits(conf, (1.0 - tv.detach()).clamp(0.0, 1.0), reduction="none")
        weights = torch.exp(-j.float() / self.gamma)[jj]
        per = ce + self.tv_loss_weight * tv + self.confidence_loss_weight * bce
        loss = (weights * per).sum() / weights.sum()
        metrics = {"loss": float(loss.detach()), "ce": float(ce.detach().mean()),
                   "tv": float(tv.detach().mean()), "bce": float(bce.detach().mean())}
        hits = top1_agrees(logits, p)
        for pos in range(min(S, 4)):
            sel = jj == pos
            if sel.any():
                metrics[f"top1_pos{pos + 1}"] = float(hits[sel].mean())
        return loss, metrics

    # ---- evaluation and calibration ---------------------------------------------------------------

    def _start_blocks(self, batch: TrainBatch, target: TargetParts, size: int):
        """Blocks from every loss-masked start (b, t) of the batch, in chain_rows order: the chain
        from t knows x_{t+1}, its anchor. Yields (rows of those starts, anchors [n], normed
        outputs [n, size, H]) for up to EVAL_BLOCKS starts of one sequence at a time."""
        context = self.context({layer: batch.hidden[layer] for layer in self.serving_layers})
        b0, t0, _ = chain_rows(batch, 0)
        for b in range(batch.loss_mask.shape[0]):
            one = TrainBatch(batch.token_ids[b : b + 1], batch.lengths[b : b + 1], batch.loss_mask[b : b + 1], {})
            for chunk in (b0 == b).nonzero(as_tuple=True)[0].split(EVAL_BLOCKS):
                anchors = t0[chunk] + 1
                states = self.block_states(one, target, context[b : b + 1], anchors.unsqueeze(0), size)[0]
                yield chunk, anchors, self.out_norm(states)

    @torch.no_grad()
    def greedy_chains(self, batch: TrainBatch, target: TargetParts, k: int):
        """Greedy drafts of k tokens from every loss-masked start of the batch, drafted as the
        drafter drafts them (each token's bias and confidence read the head's own previous
        token), with every position's uncalibrated confidence logit and whether the token equals
        the target's greedy one: (correct [N, k] bool, logits [N, k], inside [N, k] bool)."""
        if k > self.block_size:
            raise ValueError(f"this dspark head drafts blocks of {self.block_size} tokens; k={k} is more")
        greedy = target_argmax(batch, target)
        n = int(batch.loss_mask.sum())
        drafts = torch.zeros(n, k, dtype=torch.long, device=greedy.device)
        conf = torch.zeros(n, k, device=greedy.device)
        for chunk, anchors, h in self._start_blocks(batch, target, self.block_size):
            h = h[:, :k]
            logits = self.lm_head(h)
            previous = self.draft_index(batch.token_ids[chain_rows(batch, 0)[0][chunk], anchors])
            for s in range(k):
                code, bias = self.sequential(previous)
                conf[chunk, s] = self.confidence_logit(h[:, s], code).to(conf.device)
                previous = (logits[:, s] + bias).argmax(-1)
                drafts[chunk, s] = self.to_target_ids(previous).to(drafts.device)
        correct = torch.zeros(n, k, dtype=torch.bool, device=greedy.device)
        inside = torch.zeros(n, k, dtype=torch.bool, device=greedy.device)
        for s in range(k):
            b, t, valid = chain_rows(batch, 1 + s)
            correct[:, s] = valid & (drafts[:, s] == greedy[b, t])
            inside[:, s] = valid
        return correct, conf, inside

    @property
    def max_draft_tokens(self) -> int:
        return self.block_size

    @torch.no_grad()
    def draft_accuracy(self, batch: TrainBatch, target: TargetParts, k: int) -> torch.Tensor:
        """As DraftHead's; positions past the block are never drafted, so they count as misses."""
        correct = self.greedy_chains(batch, target, min(k, self.block_size))[0]
        return F.pad(correct, (0, max(0, k - self.block_size)), value=False)

    @torch.no_grad()
    def sampled_acceptance(self, batch: TrainBatch, target: TargetParts):
        """Along the answers (teacher forcing), every block position's uncalibrated confidence
        logit and 1 - TV(q_j, p_j), the chance a sampled token passes at temperature 1:
        (acceptance [N, S], logits [N, S], inside [N, S]) over the loss-masked starts."""
        S, T = self.block_size, batch.loss_mask.shape[1]
        targets = masked_targets(batch, target, columns=self.draft_ids)
        rows = chain_rows(batch, 0)[0]
        n = len(rows)
        accept = torch.zeros(n, S, device=batch.token_ids.device)
        conf = torch.zeros(n, S, device=batch.token_ids.device)
        inside = torch.stack([chain_rows(batch, 1 + s)[2] for s in range(S)], dim=1)
        for chunk, anchors, h in self._start_blocks(batch, target, S):
            b = rows[chunk][:, None].expand(-1, S)
            graded = (anchors[:, None] + torch.arange(S, device=anchors.device)).clamp(max=T - 1)  # output j: x_{a+j+1}
            code, bias = self.sequential(self.draft_index(batch.token_ids[b, graded]))  # x_{a+j}: teacher forcing
            q = torch.softmax((self.lm_head(h) + bias).float(), dim=-1)
            ok = inside[chunk]
            p = torch.zeros_like(q)
            p[ok] = torch.softmax(targets.rows(b[ok], graded[ok]), dim=-1)
            accept[chunk] = torch.where(ok, 1.0 - 0.5 * (q - p).abs().sum(-1), 0.0)
            conf[chunk] = self.confidence_logit(h, code)
        return accept, conf, inside

    @torch.no_grad()
    def calibrate(self, batches: Iterable[TrainBatch], target: TargetParts) -> dict:
        """Fit the per-position calibration on held-out batches (greedy: the survival against
        whether the first j greedy drafts all equal the target's; sampled: against the product
        of the positions' 1 - TV). Returns per kind the expected calibration error of the
        survival products uncalibrated, with a temperature per position alone, and with the
        temperature and an offset per position (what the head keeps), and those parameters."""
        greedy_parts, sampled_parts = [], []
        for batch in batches:
            greedy_parts.append(self.greedy_chains(batch, target, self.block_size))
            sampled_parts.append(self.sampled_acceptance(batch, target))
        report = {}
        for kind, row, parts in (("greedy", GREEDY, greedy_parts), ("sampled", SAMPLED, sampled_parts)):
            outcome, logits, inside = (torch.cat([p[i] for p in parts]).cpu() for i in range(3))
            outcome = torch.cumprod(outcome.float(), dim=1)  # all of 1..j pass (greedy), or its chance
            S = logits.shape[1]
            before = expected_calibration_error(survival(logits, torch.ones(S), torch.zeros(S)), outcome, inside)
            temps_only, _ = fit_survival_calibration(logits, outcome, inside, offsets=(0.0,))
            tempered = expected_calibration_error(survival(logits, torch.tensor(temps_only), torch.zeros(S)), outcome, inside)
            temps, offsets = fit_survival_calibration(logits, outcome, inside)
            after = expected_calibration_error(survival(logits, torch.tensor(temps), torch.tensor(offsets)), outcome, inside)
            self.confidence_temperature[row] = torch.tensor(temps, device=self.confidence_temperature.device)
            self.confidence_offset[row] = torch.tensor(offsets, device=self.confidence_offset.device)
            report[kind] = {"positions": int(inside[:, 0].sum()), "ece_before": round(before, 4),
                            "ece_temperature_only": round(tempered, 4), "ece_after": round(after, 4),
                            "temperatures": [round(t, 4) for t in temps], "offsets": [round(b, 4) for b in offsets],
                            "mean_outcome": [round(float(outcome[inside[:, s], s].mean()), 4) if inside[:, s].any() else None
                                             for s in range(S)]}
        return report


def survival(logits: torch.Tensor, temperatures: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Confidence logits [N, S], per-position temperatures and offsets [S] -> survival products [N, S]."""
    return torch.cumprod(torch.sigmoid(logits.float() / temperatures.float() + offsets.float()), dim=1)


def expected_calibration_error(predicted: torch.Tensor, outcome: torch.Tensor, valid: torch.Tensor,
                               bins: int = ECE_BINS) -> float:
    """Pooled over positions: sum over equal-width bins of predicted survival of
    (share of entries) x |mean predicted - mean outcome|. outcome may be soft (a probability)."""
    pred, out = predicted[valid].double(), outcome[valid].double()
    if not len(pred):
        return 0.0
    index = (pred * bins).long().clamp(max=bins - 1)
    total = 0.0
    for k in range(bins):
        sel = index == k
        if sel.any():
            total += float(sel.double().mean()) * abs(float(pred[sel].mean() - out[sel].mean()))
    return total


def fit_survival_calibration(logits: torch.Tensor, outcome: torch.Tensor, valid: torch.Tensor,
                             offsets: Sequence[float] = tuple(OFFSET_GRID)) -> tuple[list[float], list[float]]:
    """Per position j in order, the temperature T_j (TEMPERATURE_GRID) and offset b_j (`offsets`)
    minimising the binary cross-entropy of the survival a_j = a_{j-1} sigmoid(l_j / T_j + b_j)
    against the outcome of the first j positions, the earlier positions' fixed. A temperature
    alone (offsets=(0,)) can sharpen or flatten the confidences but not move their level: a
    confidence head fitted on training answers, which the backbone drafts better than held-out
    ones, needs the offset too."""
    S = logits.shape[1]
    prior = torch.ones(len(logits), dtype=torch.float64)
    grid_b = torch.tensor(list(offsets), dtype=torch.float64)
    temps, shifts = [], []
    for s in range(S):
        sel = valid[:, s]
        if not sel.any():
            temps.append(1.0)
            shifts.append(0.0)
            continue
        l, y, a0 = logits[sel, s].double(), outcome[sel, s].double().clamp(0.0, 1.0), prior[sel]
        best, best_t, best_b = None, 1.0, 0.0
        for t in TEMPERATURE_GRID:
            a = (a0[:, None] * torch.sigmoid(l[:, None] / t + grid_b)).clamp(1e-6, 1 - 1e-6)  # [n, offsets]
            loss = -(y[:, None] * a.log() + (1 - y[:, None]) * (1 - a).log()).mean(0)
            i = int(loss.argmin())
            if best is None or float(loss[i]) < best:
                best, best_t, best_b = float(loss[i]), t, float(grid_b[i])
        temps.append(best_t)
        shifts.append(best_b)
        prior = prior * torch.sigmoid(logits[:, s].double() / best_t + best_b)
    return temps, shifts
