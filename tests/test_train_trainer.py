"""The training loop: loss falls, resume is exact, evaluation arithmetic, schedule, budgets."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from conftest import tiny_loaded
from tandem.config import EngineConfig
from tandem.drafters.heads.base import DraftHead, TargetParts, TrainBatch, target_logits, top1_agrees
from tandem.llm import LLM
from tandem.train.capture import CapturedData, capture, sequences
from tandem.train.data import DistillConfig, distill
from tandem.train import trainer
from tandem.train.trainer import EvalResult, TrainConfig, auto_precision, lr_factor, simulated_chain_tau, train

pytestmark = pytest.mark.usefixtures("one_thread")


class NextNextHead(DraftHead):
    """Test head: a linear map of the final hidden state at t predicting token t + 2 (one draft
    position), with dropout so RNG state matters for exact resumption."""

    method = "next_next"

    def __init__(self, cfg) -> None:
        super().__init__()
        self.L = cfg.num_layers
        self.proj = nn.Linear(cfg.hidden_size, cfg.vocab_size)
        self.drop = nn.Dropout(0.1)
        self.logits_dtypes: set[torch.dtype] = set()  # what training_loss computed in

    @property
    def hidden_layers(self):
        return (self.L,)

    def _logits(self, batch: TrainBatch):
        return self.proj(self.drop(batch.hidden[self.L]))  # [B, T, V]

    def training_loss(self, batch, target):
        logits = self._logits(batch)[:, :-1]
        self.logits_dtypes.add(logits.dtype)
        mask = batch.loss_mask[:, 1:]  # position t + 1's next token (t + 2) is an answer token
        labels = batch.token_ids[:, 2:]
        loss = nn.functional.cross_entropy(logits[:, :-1][mask[:, :-1]], labels[mask[:, :-1]])
        return loss, {"loss": float(loss.detach())}

    @torch.no_grad()
    def draft_accuracy(self, batch, target, k):
        b, t = batch.loss_mask.nonzero(as_tuple=True)
        greedy = target.lm_head(batch.hidden[self.L]).argmax(-1)  # target's next token after each position
        ok = (t + 1 < batch.lengths[b]) & batch.loss_mask[b, (t + 1).clamp(max=batch.loss_mask.shape[1] - 1)]
        pred = self._logits(batch).argmax(-1)[b, t]
        correct = torch.zeros(len(b), k, dtype=torch.bool)
        correct[:, 0] = ok & (pred == greedy[b, (t + 1).clamp(max=greedy.shape[1] - 1)])
        return correct

    def config_dict(self):
        return {}


def _target(loaded) -> TargetParts:
    m = loaded.model
    return TargetParts(loaded.config, loaded.name, m.embed_tokens, lambda h: m.lm_head(h).float(), m.norm)


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    _, loaded = tiny_loaded("llama")
    llm = LLM.from_loaded(loaded, EngineConfig(model="tiny", max_model_len=64, max_num_seqs=8))
    root = tmp_path_factory.mktemp("cap")
    prompts = [" ".join(str(3 + (i * 11 + j) % 90) for j in range(4)) for i in range(12)]
    seqs = sequences(distill(llm, prompts, root / "answers", DistillConfig("tiny", max_new_tokens=10)))
    L = loaded.config.num_layers
    train_paths = capture(loaded, seqs[:8], root / "train", (L,), shard_size=4, store_dtype=torch.float32)
    held_paths = capture(loaded, seqs[8:], root / "held", (L,), shard_size=4, store_dtype=torch.float32)
    return loaded, CapturedData(train_paths, (L,)), CapturedData(held_paths, (L,))


def _head(loaded, seed=0):
    torch.manual_seed(seed)
    return NextNextHead(loaded.config)


@pytest.mark.parametrize("precision", ["float32", "bf16-mixed"])
def test_overfits_a_tiny_set(captured, tmp_path, precision):
    loaded, data, held = captured
    head = _head(loaded)
    cfg = TrainConfig(steps=60, batch_size=4, lr=3e-2, eval_every=30, checkpoint_every=1000, precision=precision)
    batch = data.batch(*data.in_order(8)[0])
    first = float(head.training_loss(batch, _target(loaded))[0].detach())
    head.logits_dtypes.clear()
    result = train(head, _target(loaded), data, held, cfg, tmp_path)
    trained_in = set(head.logits_dtypes)
    head.eval()
    last = float(head.training_loss(batch, _target(loaded))[0].detach())
    assert result.finished and result.step == 60
    assert last < first / 4, (first, last)
    # bf16-mixed: the loss was computed in bfloat16, the weights stayed float32
    assert trained_in == {torch.bfloat16 if precision == "bf16-mixed" else torch.float32}
    assert all(p.dtype == torch.float32 for p in head.parameters())
    metrics = json.loads((tmp_path / "metrics.json").read_text())["history"]
    evals = [h for h in metrics if "eval" in h]
    assert [h["step"] for h in evals] == [30, 60]
    assert 1.0 <= result.eval.tau <= 2.0 and len(result.eval.acceptance) == cfg.eval_k
    losses = [h["loss"] for h in metrics if "loss" in h]
    assert losses[-1] < losses[0]


def test_records_name_the_positions_a_head_drafts(captured, tmp_path):
    """eval_k beyond what a head drafts scores the head's positions, and says so in the records."""
    loaded, data, held = captured

    class TwoPositions(NextNextHead):
        max_draft_tokens = 2

    torch.manual_seed(0)
    head = TwoPositions(loaded.config)
    cfg = TrainConfig(steps=2, batch_size=4, eval_every=2, checkpoint_every=2, eval_k=5)
    result = train(head, _target(loaded), data, held, cfg, tmp_path)
    assert len(result.eval.acceptance) == 2
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["train_config"]["eval_k"] == 2


@pytest.mark.parametrize("precision", ["float32", "bf16-mixed"])
def test_resume_equals_an_uninterrupted_run(captured, tmp_path, precision):
    loaded, data, held = captured
    cfg = TrainConfig(steps=8, batch_size=3, lr=1e-2, eval_every=100, checkpoint_every=3, precision=precision)
    whole = _head(loaded)
    train(whole, _target(loaded), data, None, cfg, tmp_path / "whole")

    class Stop(Exception):
        pass

    part = _head(loaded)
    calls = {"n": 0}
    original = part.training_loss

    def crash_on_sixth(batch, target):
        calls["n"] += 1
        if calls["n"] == 6:  # steps 1-5 done, checkpoint at step 3: steps 4-5 are lost
            raise Stop
        return original(batch, target)

    part.training_loss = crash_on_sixth
    with pytest.raises(Stop):
        train(part, _target(loaded), data, None, cfg, tmp_path / "part")
    torch.manual_seed(123)  # the checkpoint's RNG state, not the ambient one, must drive the rest
    resumed = _head(loaded, seed=99)  # weights come from the checkpoint
    result = train(resumed, _target(loaded), data, None, cfg, tmp_path / "part", resume=True)
    assert result.step == 8
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_resume_needs_a_matching_checkpoint(captured, tmp_path):
    loaded, data, _ = captured
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(_head(loaded), _target(loaded), data, None, TrainConfig(steps=2), tmp_path, resume=True)
    train(_head(loaded), _target(loaded), data, None, TrainConfig(steps=2, batch_size=4), tmp_path)
    other = _head(loaded)
    other.config_dict = lambda: {"width": 3}
    with pytest.raises(ValueError, match="use the same method options"):
        train(other, _target(loaded), data, None, TrainConfig(steps=4), tmp_path, resume=True)


def test_time_budget_stops_with_a_checkpoint(captured, tmp_path):
    loaded, data, held = captured
    cfg = TrainConfig(steps=10_000, batch_size=4, max_minutes=0.02, eval_every=10_000)
    result = train(_head(loaded), _target(loaded), data, held, cfg, tmp_path)
    assert not result.finished and 0 < result.step < 10_000
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["step"] == result.step
    assert result.eval is not None


def test_eval_result_arithmetic():
    correct = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    r = EvalResult.from_correct(correct)
    assert r.accuracy == [0.75, 0.75, 0.75]
    assert r.cumulative == [0.75, 0.5, 0.25]  # all-correct prefixes of length 1, 2, 3
    assert r.acceptance == [0.75, round(0.5 / 0.75, 4), 0.5]
    assert r.tau == 2.5
    with pytest.raises(ValueError, match="no answer positions"):
        EvalResult.from_correct(torch.zeros(0, 3, dtype=torch.bool))


def test_chain_tau_follows_the_engines_rounds():
    # One sequence of 6 answer positions, k = 2. Round at 0 accepts 1 (commits 2) -> round at 2
    # accepts 2 (commits 3) -> round at 5 accepts 0 (commits 1): 6 tokens in 3 rounds.
    correct = torch.tensor([[1, 0], [1, 1], [1, 1], [0, 0], [1, 1], [0, 1]], dtype=torch.bool)
    assert simulated_chain_tau([correct]) == 2.0
    # Sequences are simulated separately: a second one restarts at its own first position.
    r = EvalResult.from_correct(torch.cat([correct, torch.tensor([[1, 1]], dtype=torch.bool)]), [6, 1])
    assert r.chain_tau == round(9 / 4, 4)
    assert r.tau == round(1 + 5 / 7 + 4 / 7, 4)  # every position a start: more optimistic here
    with pytest.raises(ValueError, match="lengths cover"):
        EvalResult.from_correct(correct, [2, 2])


def test_lr_schedule_and_config_validation():
    cfg = TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    factors = [lr_factor(s, cfg) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))
    assert factors[-1] == pytest.approx(0.1, abs=1e-3)
    for bad in (dict(steps=0), dict(lr=-1.0), dict(batch_size=0), dict(warmup_steps=2000), dict(device="tpu"),
                dict(max_minutes=0.0), dict(precision="fp16")):
        with pytest.raises(ValueError):
            TrainConfig(**bad)


def test_auto_precision_is_bf16_mixed_only_on_a_cpu_with_amx_bf16(monkeypatch):
    monkeypatch.setattr(trainer, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16", "amx_bf16"}))
    assert auto_precision("cpu") == "bf16-mixed"
    assert auto_precision("cuda") == "float32"
    monkeypatch.setattr(trainer, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert auto_precision("cpu") == "float32"


def test_the_teachers_logits_stay_float32_under_bf16_autocast(captured):
    loaded, data, _ = captured
    target = TargetParts.from_loaded(loaded)
    hidden = data.batch(*data.in_order(4)[0]).hidden[loaded.config.num_layers][0]
    columns = torch.tensor([5, 1, 17, 40])
    plain = target_logits(target, hidden, columns)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = target_logits(target, hidden, columns)
        assert F.linear(hidden, target.lm_head_weight[columns]).dtype == torch.bfloat16  # autocast is on here
    assert mixed.dtype == torch.float32 and torch.equal(plain, mixed)


def test_top1_agreement_is_argmax_agreement_ties_included():
    torch.manual_seed(0)
    logits = torch.randn(64, 300).bfloat16()
    logits[:8] = 0.0  # every index ties: argmax takes the first
    logits[8:16, 40:50] = 9.0  # a tie at the top of each row
    reference = torch.softmax(torch.randn(64, 300), dim=-1)
    reference[:4, 0] = 1.0  # agrees with the all-tied rows' first index
    reference[8:12, 40] = 2.0
    reference[12:16, 45] = 2.0  # ties with the head at 45, but the head's argmax is 40
    expected = (logits.argmax(-1) == reference.argmax(-1)).float()
    assert torch.equal(top1_agrees(logits, reference), expected)
    assert expected[:4].all() and expected[8:12].all() and not expected[12:16].any()


def test_the_optimiser_is_fused_on_a_cpu(captured):
    loaded, _, _ = captured
    head = NextNextHead(loaded.config)
    _, _, optim, _ = trainer._prepare(head, TargetParts.from_loaded(loaded), TrainConfig(steps=2), torch.device("cpu"))
    assert optim.defaults["fused"] is True
