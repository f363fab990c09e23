"""DSpark: the anchor's output is draft token 0, the sequential head conditions each token on the
one before it, a token's confidence and q are fixed before it is drawn, and the calibration fits
and is saved with the head (`tandem train` recording it: test_train_cli). (Greedy identity, the
sampled audit and the per-method checks run in test_drafter_heads; the scheduler in
test_scheduler_confidence.)"""

from __future__ import annotations

import copy

import pytest
import torch
from heads_fixtures import hf_tokenizer, make_batch, parts
from test_drafter_heads import (
    PROMPTS,
    committed_batch,
    make_llm,
    prefill_hidden,
    recorded_drafts,
    saved_fixture,  # noqa: F401 (the fixture `saved`)
    trained,
)

from tandem.config import SamplingParams
from tandem.drafters import DraftInput
from tandem.drafters.calibration import OnlineCalibration, shifted
from tandem.drafters.heads.dspark import (
    expected_calibration_error,
    fit_survival_calibration,
    survival,
)
from tandem.drafters.heads.io import build_head, load_head, save_head

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def saved_dspark(saved):
    return saved("dspark")


def reference_chain(head, llm, ids: list[int], k: int) -> tuple[list[int], list[float]]:
    """The greedy chain and its uncalibrated confidence logits recomputed from the training
    forward on the committed context: block at the last token, then the sequential head."""
    p = parts()
    batch = committed_batch(llm, head, ids)
    with torch.no_grad():
        out = head.out_norm(head.block_states(batch, p, head.context(batch.hidden), torch.tensor([[len(ids) - 1]]), k)[0, 0])
        logits = head.lm_head(out)
        previous = head.draft_index(torch.tensor([ids[-1]]))[0]
        tokens, conf = [], []
        for j in range(k):
            code, bias = head.sequential(previous)
            conf.append(float(head.confidence_logit(out[j], code)))
            previous = (logits[j] + bias).argmax(-1)
            tokens.append(int(head.to_target_ids(previous)))
    return tokens, conf


def test_engine_drafts_equal_the_training_forward_on_the_committed_context(saved_dspark):
    """Across rounds with rejections, every greedy draft (k tokens from a block of k inputs) and
    its confidences are the training forward's on the committed context (the confidences
    calibrated, then moved by the request's online offset at the time)."""
    llm = make_llm("dspark", saved_dspark, k=3, lookup=False)
    drafter = llm.engine.drafter
    assert drafter.block_size == 3  # the anchor drafts too
    head, online = drafter.head, drafter.online_calibration
    offsets = []
    record = lambda inp, draft: offsets.append(online.offset.get(inp.request_id, online.global_offset))  # noqa: E731
    drafts = recorded_drafts(llm, record)
    assert any(d != 0.0 for d in offsets)  # the correction moved
    for (ids, draft), d in zip(drafts, offsets):
        tokens, logits = reference_chain(load_head(saved_dspark, parts()), llm, ids, 3)
        assert draft.token_ids == tokens[: len(draft)]
        temperature, offset = head.calibration(torch.tensor([True]))
        expected = [float(torch.sigmoid(torch.tensor(x) / temperature[0, j] + offset[0, j] + d)) for j, x in enumerate(logits)]
        assert draft.confidence == pytest.approx(expected[: len(draft)], abs=2e-2)  # served: 8-bit linears


def test_the_sequential_head_conditions_each_token_on_the_one_before():
    head = trained("dspark")
    with torch.no_grad():
        biases = head.sequential(torch.tensor([0, 1, len(head.draft_ids)]))[1]
    assert not torch.allclose(biases[0], biases[1]) and not torch.allclose(biases[1], biases[2])
    fresh = build_head("dspark", parts(), block_size=4, rank=32)
    assert torch.count_nonzero(fresh.sequential(torch.tensor([3]))[1]) == 0  # starts as the backbone


def test_a_sampled_tokens_q_and_confidence_are_fixed_before_it_is_drawn(saved_dspark):
    """Many seeds from one context: wherever two drafts share x_0..x_{j-1}, their q_j and c_j are
    equal whatever x_j each drew, and q_j is the distribution x_j was drawn from."""
    llm = make_llm("dspark", saved_dspark, k=3, lookup=False)
    drafter = llm.engine.drafter
    ctx = PROMPTS[0]
    hidden = prefill_hidden(llm, ctx)
    params = SamplingParams(temperature=1.0)
    drafts = drafter.propose([DraftInput(f"r{i}", ctx, len(ctx), 3, params, torch.Generator().manual_seed(i), hidden)
                              for i in range(64)])
    by_prefix: dict[tuple, list] = {}
    for d in drafts:
        for j in range(len(d)):
            by_prefix.setdefault(tuple(d.token_ids[:j]), []).append((d.token_ids[j], d.probs[j], d.confidence[j]))
    shared = [v for v in by_prefix.values() if len({t for t, _, _ in v}) > 1]
    assert shared  # some prefix was followed by different tokens
    for group in shared:
        for _, q, c in group[1:]:
            torch.testing.assert_close(q, group[0][1])
            assert c == group[0][2]
        assert all(float(q[t]) > 0 for t, q, _ in group)
    # top_k 3: q_j is position j's own processed law, which holds the token drawn there (a q of
    # the position before, equal within a group too, would not always)
    narrow = SamplingParams(temperature=1.0, top_k=3)
    for d in drafter.propose([DraftInput(f"n{i}", ctx, len(ctx), 3, narrow, torch.Generator().manual_seed(i), hidden)
                              for i in range(64)]):
        for j, token in enumerate(d.token_ids):
            assert int((d.probs[j] > 0).sum()) <= 3 and float(d.probs[j][token]) > 0, (j, token)


def test_a_block_longer_than_the_trained_one_is_refused(saved_dspark):
    with pytest.raises(ValueError, match="at most 5"):
        make_llm("dspark", saved_dspark, k=6)


def test_options_are_checked():
    for bad in (dict(rank=0), dict(block_size=0), dict(tv_loss_weight=-1.0)):
        with pytest.raises(ValueError):
            build_head("dspark", parts(), **bad)


def test_loss_falls_and_reports_its_terms():
    p, batch = parts(), make_batch()
    torch.manual_seed(0)
    head = build_head("dspark", p, block_size=4, rank=32)
    with torch.no_grad():
        loss0, metrics = head.training_loss(batch, p)
        assert {"ce", "tv", "bce"} <= set(metrics)
        assert float(trained("dspark").training_loss(batch, p)[0]) < float(loss0)
        assert head.draft_accuracy(batch, p, 6)[:, 4:].sum() == 0  # past the block of 4: never drafted


def test_calibration_recovers_a_known_temperature_and_offset():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(20000, 3, generator=g) * 3
    true_t, true_b = torch.tensor([2.0, 0.5, 1.0]), torch.tensor([-1.0, 0.0, 0.5])
    passes = torch.bernoulli(torch.sigmoid(logits / true_t + true_b), generator=g)
    outcome = torch.cumprod(passes, dim=1)
    valid = torch.ones_like(outcome, dtype=torch.bool)
    temps, offsets = fit_survival_calibration(logits, outcome, valid)
    assert temps == pytest.approx(true_t.tolist(), rel=0.15)
    assert offsets == pytest.approx(true_b.tolist(), abs=0.2)
    before = expected_calibration_error(survival(logits, torch.ones(3), torch.zeros(3)), outcome, valid)
    only_t, _ = fit_survival_calibration(logits, outcome, valid, offsets=(0.0,))
    tempered = expected_calibration_error(survival(logits, torch.tensor(only_t), torch.zeros(3)), outcome, valid)
    after = expected_calibration_error(survival(logits, torch.tensor(temps), torch.tensor(offsets)), outcome, valid)
    assert after < 0.02 < min(tempered, before)  # a temperature alone cannot move the level


def test_calibration_lowers_the_error_and_is_saved_with_the_head(tmp_path):
    p, batch = parts(), make_batch()
    head = copy.deepcopy(trained("dspark"))  # the shared trained head stays uncalibrated for the other tests
    report = head.calibrate([batch], p)
    for kind in ("greedy", "sampled"):
        assert report[kind]["ece_after"] <= min(report[kind]["ece_temperature_only"], report[kind]["ece_before"])
        assert len(report[kind]["temperatures"]) == len(report[kind]["offsets"]) == head.block_size
    save_head(head, tmp_path, "sharp-qwen2-0", {"steps": 1}, tokenizer=hf_tokenizer())
    loaded = load_head(tmp_path, p)
    torch.testing.assert_close(loaded.confidence_temperature, head.confidence_temperature)
    torch.testing.assert_close(loaded.confidence_offset, head.confidence_offset)


def test_the_online_offset_follows_how_the_requests_drafts_fare():
    """A request whose confident drafts keep failing gets its later confidences lowered, one whose
    drafts all pass gets them raised; a new request starts from the server-wide offset; only
    the graded positions count, and a round without the head's draft grades nothing."""
    online = OnlineCalibration()
    for _ in range(10):
        online.correct("bad", [0.8, 0.8])
        online.observe("bad", 2, 0)  # the first token failed: only it was graded
        online.correct("good", [0.5, 0.5])
        online.observe("good", 2, 2)
    assert online.offset["bad"] < -1.0 and online.offset["good"] > 1.0
    bad, good = online.correct("bad", [0.6, 0.6]), online.correct("good", [0.6, 0.6])
    assert bad[0] < 0.6 < good[0] and bad[0] == bad[1]
    assert online.correct("new", [0.6]) == [pytest.approx(shifted(0.6, online.global_offset))]
    before = online.offset["good"]
    online.not_drafted("good")  # a lookup round: its outcome is not the head's
    online.observe("good", 2, 0)
    assert online.offset["good"] == before
    online.correct("good", [0.6, 0.6])
    online.observe("good", 0, 0)  # nothing verified (the scheduler admitted none)
    assert online.offset["good"] == before
    assert shifted(0.3, 1.0) > 0.3 and shifted(1.0, -2.0) == 1.0 and shifted(0.3, 0.0) == 0.3


def test_the_native_greedy_chain_equals_the_torch_one(saved_dspark):
    """On the block kernels a greedy step is one call (bias + backbone logits, argmax, finiteness):
    the same tokens and confidences as the torch steps, a broken row ending its draft there."""
    llm = make_llm("dspark", saved_dspark, k=3, lookup=False)
    drafter = llm.engine.drafter
    assert drafter.markov_kernels is not None
    torch.manual_seed(0)
    vocab = len(drafter.head.draft_ids)
    state_logits, base = torch.randn(3, 3), 4 * torch.randn(3, 3, vocab)
    base[1, 1, 5] = float("nan")
    previous = torch.tensor([0, 7, vocab])  # the last: a token outside the draft vocabulary
    temperature, offset = drafter.head.calibration(torch.tensor([True, True, True]))
    budgets = [3, 3, 2]
    native = drafter._native_argmax_drafts(state_logits, base, budgets, previous.clone(), temperature, offset)
    reference = drafter._argmax_drafts(state_logits, base, budgets, previous.clone(), temperature, offset)
    assert [d.token_ids for d in native] == [d.token_ids for d in reference]
    assert [d.confidence for d in native] == [d.confidence for d in reference]
    assert [len(d) for d in native] == [3, 1, 2]
