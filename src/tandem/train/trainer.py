"""The training loop for draft heads: AdamW, warmup + cosine LR, clipping, checkpoints, held-out eval.

Deterministic: the head's initial weights come from `seed`, the batch order from (seed, step), and a
checkpoint carries the optimiser, schedule position and RNG states, so `resume` continues exactly
where an uninterrupted run would be.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pickle
import random
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tandem.drafters.heads.base import DraftHead, TargetParts
from tandem.drafters.heads.io import shape_differences, target_record, with_article
from tandem.model.kernels import cpu_flags
from tandem.progress import progress
from tandem.train.capture import CapturedData

log = logging.getLogger("tandem.train")

CHECKPOINT = "checkpoint.pt"
# What the checkpoint holds, readable without loading it: method, head options and target, so a
# --resume that cannot work is refused before the target answers any prompt (cli.py).
CHECKPOINT_INFO = "checkpoint.json"
METRICS = "metrics.json"
PRECISIONS = ("float32", "bf16-mixed")


def auto_precision(device: str) -> str:
    """The precision `--precision auto` trains in: bf16-mixed on a CPU with AMX bf16 tiles, where
    torch's oneDNN matmuls run on them (a DFlash step about 1.6x faster on one or two threads of a
    Xeon, see docs/training.md), float32 elsewhere (not measured to pay, so not chosen for the user)."""
    return "bf16-mixed" if device == "cpu" and "amx_bf16" in cpu_flags() else "float32"


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings. warmup_steps None = 5% of `steps`; max_minutes bounds this run's
    wall time (a checkpoint is written when it runs out; `resume` continues). precision:
    "float32", or "bf16-mixed" (the loss computed under bfloat16 autocast, the weights, gradients
    and optimiser state kept in float32; held-out evaluation always runs in float32)."""

    steps: int = 1000
    batch_size: int = 8
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int | None = None
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    checkpoint_every: int = 100
    eval_k: int = 5
    max_minutes: float | None = None
    seed: int = 0
    device: str = "cpu"
    precision: str = "float32"

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr}")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps={self.steps}], got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip <= 0:
            raise ValueError(f"grad_clip must be > 0, got {self.grad_clip}")
        if self.eval_every < 1 or self.checkpoint_every < 1 or self.eval_k < 1:
            raise ValueError("eval_every, checkpoint_every and eval_k must be >= 1")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ValueError(f"max_minutes must be > 0, got {self.max_minutes}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible to torch; train with --device cpu")

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else max(1, self.steps // 20)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr for optimiser step `step` (0-based): linear warmup, then cosine
    decay to min_lr_ratio at the last step."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class EvalResult:
    """Held-out drafting quality, drafting k tokens from every answer position.

    accuracy[i]: P(draft i correct); cumulative[i]: P(drafts 1..i all correct);
    acceptance[i]: P(draft i correct | drafts before it correct), the per-position acceptance the
    engine reports; tau = 1 + sum_i cumulative[i] (tokens per target forward, bonus included) over
    every answer position as a chain start.
    chain_tau: the tau an engine run would see on the same answers: chains start only where the
    last round ended (after its accepted drafts and the bonus token), and those positions are
    harder than average (a rejection marks a hard spot, and the next chain starts right after
    it), so chain_tau < tau. Measured on SmolLM2's eagle3 head: tau 2.47 offline, chain_tau 1.98,
    an engine run 2.0 on the same prompts.
    """

    positions: int
    accuracy: list[float]
    cumulative: list[float]
    acceptance: list[float]
    tau: float
    chain_tau: float | None = None

    @classmethod
    def from_correct(cls, correct: torch.Tensor, lengths: list[int] | None = None) -> "EvalResult":
        """correct: [N, k] bool from DraftHead.draft_accuracy. lengths: how many of its rows (in
        order) belong to each sequence, where the rows run along each sequence's answer
        positions; gives chain_tau."""
        if correct.shape[0] == 0:
            raise ValueError("held-out evaluation found no answer positions")
        c = correct.float()
        cum = torch.cumprod(c, dim=1).mean(0)
        acc = c.mean(0)
        prev = torch.cat([torch.ones(1), cum[:-1]])
        accept = torch.where(prev > 0, cum / prev.clamp(min=1e-12), torch.zeros_like(cum))
        r = lambda t: [round(float(x), 4) for x in t]  # noqa: E731
        chain = None
        if lengths is not None:
            if sum(lengths) != correct.shape[0]:
                raise ValueError(f"lengths cover {sum(lengths)} rows, correct has {correct.shape[0]}")
            chain = round(simulated_chain_tau(correct.split(list(lengths))), 4)
        return cls(int(correct.shape[0]), r(acc), r(cum), r(accept), round(1 + float(cum.sum()), 4), chain)


def simulated_chain_tau(per_sequence: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> float:
    """Tokens per round of chains drafted along each sequence as the engine drafts them: a round
    at position t accepts the leading correct drafts a (of k) and commits a + 1 tokens (the bonus
    included); the next round starts at t + a + 1."""
    rounds = committed = 0
    for correct in per_sequence:
        # Leading run of correct drafts from every start: the first False column (k if none).
        wrong = ~correct.bool()
        wrong = torch.cat([wrong, torch.ones(len(correct), 1, dtype=torch.bool)], dim=1)
        accepted = wrong.float().argmax(dim=1).tolist()
        t = 0
        while t < len(accepted):
            rounds += 1
            committed += accepted[t] + 1
            t += accepted[t] + 1
    return committed / max(rounds, 1)


@torch.no_grad()
def evaluate(head: DraftHead, target: TargetParts, data: CapturedData, k: int, device: str, batch_size: int = 8) -> EvalResult:
    """Held-out acceptance at the first k draft positions, or at as many as the head's drafts hold."""
    k = min(k, head.max_draft_tokens or k)
    was_training = head.training
    head.eval()
    parts, lengths = [], []
    for s, idx in data.in_order(batch_size):
        batch = data.batch(s, idx, device)
        parts.append(head.draft_accuracy(batch, target, k).cpu())  # rows: loss-masked (b, t) in order
        lengths.extend(batch.loss_mask.sum(1).tolist())
    head.train(was_training)
    return EvalResult.from_correct(torch.cat(parts), lengths)


@torch.no_grad()
def calibrate(head: DraftHead, target: TargetParts, data: CapturedData | None, device: str, batch_size: int = 8) -> dict | None:
    """The head's own calibration (DraftHead.calibrate) on the held-out data, in eval mode."""
    if data is None:
        return None
    was_training = head.training
    head.eval()
    report = head.calibrate((data.batch(s, idx, device) for s, idx in data.in_order(batch_size)), target)
    head.train(was_training)
    if report:
        log.info("calibration on held-out answers: %s", report)
    return report


@dataclass
class TrainResult:
    step: int
    finished: bool
    seconds: float
    last_loss: float | None
    eval: EvalResult | None
    history: list[dict] = field(default_factory=list)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"].cpu())  # map_location may have moved it
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def _save(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def fit_eval_k(cfg: TrainConfig, head: DraftHead) -> TrainConfig:
    """cfg with eval_k no larger than what the head drafts, so records name the positions scored."""
    if head.max_draft_tokens is None or cfg.eval_k <= head.max_draft_tokens:
        return cfg
    log.info("evaluating %d draft positions, all that a %s head drafts (asked: %d)", head.max_draft_tokens,
             head.method, cfg.eval_k)
    return dataclasses.replace(cfg, eval_k=head.max_draft_tokens)


def train(
    head: DraftHead,
    target: TargetParts,
    data: CapturedData,
    held_out: CapturedData | None,
    cfg: TrainConfig,
    out_dir: str | Path,
    resume: bool = False,
    eval_first: bool = False,
) -> TrainResult:
    """Optimise head.training_loss for cfg.steps steps (or until max_minutes), checkpointing into
    out_dir/checkpoint.pt and logging held-out evaluations into out_dir/metrics.json.
    eval_first: evaluate the head before the first step too (a head that starts trained)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = fit_eval_k(cfg, head)
    device = torch.device(cfg.device)
    target, params, optim, sched = _prepare(head, target, cfg, device)
    ckpt_path = out / CHECKPOINT
    step, seconds_before, history = _resume(ckpt_path, head, target, optim, sched, device) if resume else (0, 0.0, [])

    def checkpoint() -> None:
        seconds = seconds_before + (time.perf_counter() - t0)
        state = _checkpoint_state(head, target, optim, sched, cfg, step, seconds, history)
        _save(ckpt_path, state)
        info = {k: state[k] for k in ("method", "head_config", "target", "step")}
        (out / CHECKPOINT_INFO).write_text(json.dumps(info, indent=1) + "\n")

    def run_eval() -> EvalResult | None:
        return _run_eval(head, target, held_out, cfg, step, history, out)

    t0, first_step = time.perf_counter(), step
    deadline = None if cfg.max_minutes is None else t0 + 60 * cfg.max_minutes
    plans: dict[int, list] = {}
    steps_per_epoch = len(data.epoch_plan(0, cfg.batch_size, cfg.seed))
    bar = progress(total=cfg.steps, initial=step, desc=f"training {head.method}", unit="step")
    last_loss, last_eval = None, None
    if eval_first and step == 0:
        run_eval()
    while step < cfg.steps:
        if deadline is not None and time.perf_counter() > deadline:
            log.info("time budget of %.1f min reached at step %d; checkpointed (continue with --resume)", cfg.max_minutes, step)
            break
        epoch, pos = divmod(step, steps_per_epoch)
        if epoch not in plans:
            plans = {epoch: data.epoch_plan(epoch, cfg.batch_size, cfg.seed)}
        shard, idx = plans[epoch][pos]
        last_loss, metrics, grad_norm = _optimiser_step(head, target, data.batch(shard, idx, device), params, optim,
                                                        sched, cfg, step)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{last_loss:.3f}", epoch=epoch, refresh=False)  # drawn at the bar's own pace
        if step % 10 == 0 or step == cfg.steps:
            _log_step(history, step, cfg, last_loss, sched.get_last_lr()[0], grad_norm, metrics,
                      (time.perf_counter() - t0) / max(1, step - first_step))
        if step % cfg.eval_every == 0 or step == cfg.steps:
            last_eval = run_eval()
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            checkpoint()
    bar.close()
    last_eval = _wrap_up(step, cfg, last_eval, run_eval, checkpoint)
    seconds = seconds_before + time.perf_counter() - t0
    return TrainResult(step, step >= cfg.steps, seconds, last_loss, last_eval, history)


def _wrap_up(step: int, cfg: TrainConfig, last_eval: EvalResult | None, run_eval, checkpoint) -> EvalResult | None:
    """After the loop; returns the last evaluation."""
    if step < cfg.steps:  # stopped by the time budget: evaluate where it stands, then checkpoint
        if step % cfg.eval_every:
            last_eval = run_eval()
        checkpoint()
    elif last_eval is None:  # resumed after the last step: report the final state
        last_eval = run_eval()
    return last_eval


def _prepare(head: DraftHead, target: TargetParts, cfg: TrainConfig, device: torch.device):
    """The head on `device` in training mode; (target, trainable parameters, AdamW, LR schedule)."""
    head.to(device).train()
    if target.lm_head_weight is not None and target.lm_head_weight.device != device:
        # Heads with a reduced vocabulary slice it every step: one copy on the device, not one per step.
        target = dataclasses.replace(target, lm_head_weight=target.lm_head_weight.to(device))
    params = [p for p in head.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"the {head.method} head has no trainable parameters")
    # Fused (torch has the kernel for both devices TrainConfig allows): one pass over every tensor; on a CPU
    # the loop over tensors cost a dflash step (12.8M parameters, one thread) about 7% of its time.
    optim = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: lr_factor(s, cfg))
    return target, params, optim, sched


def _resume(ckpt_path: Path, head: DraftHead, target: TargetParts, optim, sched,
            device: torch.device) -> tuple[int, float, list[dict]]:
    """Restore head, optimiser, schedule and RNG states from the checkpoint; (step, seconds, history)."""
    if not ckpt_path.exists():
        raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path}; start without --resume")
    try:
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as err:  # damaged, or not torch's
        raise _damaged(ckpt_path, str(err).splitlines()[0] if str(err) else None) from None
    if not isinstance(ckpt, dict) or not CHECKPOINT_KEYS <= set(ckpt):
        raise _damaged(ckpt_path, "not a tandem training checkpoint")
    trained_for = ckpt.get("target")  # checkpoints before 2026-12-07 do not say
    if trained_for is not None and shape_differences(trained_for, target.config):
        raise ValueError(f"--resume: {ckpt_path} trains a head for {trained_for['model_name']!r}, whose shapes are "
                         f"not {target.model_name!r}'s; resume with that target, or train into another --out")
    if trained_for is not None and trained_for["model_name"] != target.model_name:  # a moved or renamed copy?
        log.warning("resuming a head trained for %r on %r, which has the same shapes", trained_for["model_name"],
                    target.model_name)
    if ckpt["method"] != head.method or ckpt["head_config"] != head.config_dict():
        raise ValueError(
            f"{ckpt_path} holds {with_article(ckpt['method'])} head {ckpt['head_config']}, not {head.method} "
            f"{head.config_dict()}; use the same method options or another --out"
        )
    head.load_state_dict(ckpt["head"])
    optim.load_state_dict(ckpt["optim"])
    sched.load_state_dict(ckpt["sched"])
    _set_rng_state(ckpt["rng"])
    log.info("resuming %s from step %d of %s (%.1f min trained)", head.method, ckpt["step"], ckpt_path,
             ckpt["seconds"] / 60)
    return ckpt["step"], ckpt["seconds"], ckpt["history"]


CHECKPOINT_KEYS = {"method", "head_config", "head", "optim", "sched", "step", "seconds", "history", "rng"}


def _damaged(ckpt_path: Path, why: str | None) -> ValueError:
    return ValueError(f"--resume: {ckpt_path} cannot be read{f' ({why})' if why else ''}: the checkpoint is "
                      "damaged; start again without --resume into another --out")


def _checkpoint_state(head: DraftHead, target: TargetParts, optim, sched, cfg: TrainConfig, step: int,
                      seconds: float, history: list[dict]) -> dict:
    return {
        "method": head.method, "head_config": head.config_dict(),
        "target": target_record(target.config, target.model_name),
        "head": head.state_dict(),
        "optim": optim.state_dict(), "sched": sched.state_dict(), "step": step,
        "seconds": seconds, "history": history, "rng": _rng_state(),
        "train_config": asdict(cfg),
    }


def _run_eval(head: DraftHead, target: TargetParts, held_out: CapturedData | None, cfg: TrainConfig, step: int,
              history: list[dict], out: Path) -> EvalResult | None:
    """Evaluate on the held-out data (if any), append it to `history` and rewrite metrics.json."""
    if held_out is None:
        return None
    result = evaluate(head, target, held_out, cfg.eval_k, cfg.device, cfg.batch_size)
    history.append({"step": step, "eval": asdict(result)})
    log.info("step %d: held-out tau %.3f (engine-like chain tau %.3f), acceptance per position %s", step,
             result.tau, result.chain_tau, result.acceptance)
    (out / METRICS).write_text(json.dumps({"history": history}, indent=1))
    return result


def _optimiser_step(head: DraftHead, target: TargetParts, batch, params: list, optim, sched, cfg: TrainConfig,
                    step: int) -> tuple[float, dict, torch.Tensor]:
    """One clipped AdamW step on `batch`; (loss, the head's metrics, gradient norm before clipping)."""
    with torch.autocast(cfg.device, dtype=torch.bfloat16, enabled=cfg.precision == "bf16-mixed"), \
            warnings.catch_warnings():
        # nn.RMSNorm over an autocast (bf16) input with its float32 weight takes torch's unfused path and says so
        warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
        loss, metrics = head.training_loss(batch, target)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"{head.method} loss became {float(loss)} at step {step}; lower --lr")
    optim.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    optim.step()
    sched.step()
    return float(loss.detach()), metrics, grad_norm


def _log_step(history: list[dict], step: int, cfg: TrainConfig, loss: float, lr: float, grad_norm: torch.Tensor,
              metrics: dict, seconds_per_step: float) -> None:
    history.append({"step": step, "loss": round(loss, 5), "lr": lr,
                    "grad_norm": round(float(grad_norm), 4),
                    **{k: round(v, 5) for k, v in metrics.items() if k != "loss"}})
    log.info("step %d/%d: loss %.4f (%.3f s/step)", step, cfg.steps, loss, seconds_per_step)
