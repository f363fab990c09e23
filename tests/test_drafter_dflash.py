"""DFlash: the block attention pattern against a reference masked computation, what a block may
see, training (the loss falls, resume is exact), and the drafter: its drafts equal the training
forward's on the committed context, its caches hold exactly the true features (also when the
suffix lookup drafts some rounds), blocks longer than the trained one are refused, and a q that
is not the one sampled from fails the audit.
(Greedy identity, the sampled audit and the other per-method checks run in test_drafter_heads.)"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from heads_fixtures import (
    expected_tau,
    make_batch,
    parts,
    sharp_target,
    train,
)
from test_drafter_heads import (
    COPYING_PROMPTS,
    GREEDY,
    PROMPTS,
    audit,
    committed_batch,
    make_llm,
    plain,
    prefill_hidden,
    recorded_drafts,
    recorded_lookups,
    saved_fixture,  # noqa: F401 (the fixture `saved`)
)

from tandem.config import EngineConfig, SamplingParams
from tandem.drafters import DraftInput
from tandem.drafters.dflash import DFlashDrafter
from tandem.drafters.heads.base import TrainBatch
from tandem.drafters.heads.io import build_head
from tandem.engine.engine import Engine
from tandem.llm import LLM
from tandem.scheduler.cost_model import CostCurve
from tandem.train.capture import CapturedData, capture, sequences
from tandem.train.data import DistillConfig, distill
from tandem.train.trainer import TrainConfig
from tandem.train.trainer import train as run

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def saved_dflash(saved):
    return saved("dflash")


def reference_block_logits(head, batch, target, anchor: int, size: int) -> torch.Tensor:
    """One block at `anchor` of row 0, attention written out: softmax over the context keys at
    positions < anchor and the block's own keys, per head."""
    context = head.context({layer: batch.hidden[layer][:1] for layer in head.serving_layers})[:, :anchor]
    x = head.block_input(target.embed(batch.token_ids[:1, anchor]).float(), size)  # [1, S, H]
    q_pos = (anchor + torch.arange(size)).unsqueeze(0)
    for layer in head.draft_layers:
        blk = layer.block
        kc, vc = layer.context_kv(context, torch.arange(anchor).unsqueeze(0))
        q, kb, vb = blk.qkv_heads(layer.norm(x), q_pos)
        k, v = blk._expand(torch.cat([kc, kb], dim=2)), blk._expand(torch.cat([vc, vb], dim=2))
        weights = torch.softmax(q @ k.transpose(-1, -2) * blk.scale, dim=-1)
        x = blk.finish(x, weights @ v)
    return head.head_logits(x)[0]


def test_block_attention_equals_a_reference_masked_computation():
    p, batch = parts(), make_batch()
    torch.manual_seed(0)
    head = build_head("dflash", p, block_size=5).eval()
    anchors = torch.tensor([[3, 9, 10, 17]])  # overlapping blocks (9 and 10) are still separate
    one = TrainBatch(batch.token_ids[:1], batch.lengths[:1], batch.loss_mask[:1], {})
    context = head.context({layer: batch.hidden[layer][:1] for layer in head.serving_layers})
    with torch.no_grad():
        together = head.block_logits(one, p, context, anchors, 5)[0]
        for i, a in enumerate(anchors[0].tolist()):
            torch.testing.assert_close(together[i], reference_block_logits(head, batch, p, a, 5), rtol=1e-4, atol=1e-4)


def test_a_block_sees_the_context_before_its_anchor_and_nothing_else():
    p, batch = parts(), make_batch()
    torch.manual_seed(0)
    head = build_head("dflash", p, block_size=4).eval()
    one = TrainBatch(batch.token_ids[:1].clone(), batch.lengths[:1], batch.loss_mask[:1], {})

    def logits(hidden, token_ids=None):
        b = TrainBatch(one.token_ids if token_ids is None else token_ids, one.lengths, one.loss_mask, {})
        ctx = head.context({layer: hidden[layer][:1] for layer in head.serving_layers})
        with torch.no_grad():
            return head.block_logits(b, p, ctx, torch.tensor([[8, 14]]), 4)[0]

    base = logits(batch.hidden)
    later = {k: v.clone() for k, v in batch.hidden.items()}
    for layer in head.serving_layers:
        later[layer][:, 8] += 1.0  # the feature at the first block's anchor: only the second sees it
    moved = logits(later)
    torch.testing.assert_close(moved[0], base[0])
    assert not torch.allclose(moved[1], base[1])
    tokens = one.token_ids.clone()
    tokens[0, 14] = (tokens[0, 14] + 1) % p.config.vocab_size  # the second block's anchor token
    moved = logits(batch.hidden, tokens)
    torch.testing.assert_close(moved[0], base[0])
    assert not torch.allclose(moved[1], base[1])


def test_overfits_a_tiny_batch():
    p, batch = parts(), make_batch(self_distilled=True)
    torch.manual_seed(0)
    head = build_head("dflash", p, block_size=5, anchors_per_sequence=8)
    before = expected_tau(head.draft_accuracy(batch, p, 4))
    losses = train(head, batch, p, steps=40, lr=3e-3)
    assert losses[-1] < losses[0] / 8
    assert expected_tau(head.draft_accuracy(batch, p, 4)) > before + 1.0


def test_loss_weights_decay_by_position():
    """exp(-(j-1)/gamma): with a huge gamma every position counts alike, with a tiny one only
    the first; the loss moves accordingly on a head whose positions differ in quality."""
    p, batch = parts(), make_batch(self_distilled=True)
    losses = {}
    for gamma in (1e-3, 1e6):
        torch.manual_seed(0)
        head = build_head("dflash", p, block_size=5, anchors_per_sequence=8, gamma=gamma)
        torch.manual_seed(1)
        losses[gamma] = float(head.training_loss(batch, p)[0].detach())
    assert math.isfinite(losses[1e-3]) and losses[1e-3] != pytest.approx(losses[1e6], rel=1e-3)


def test_options_are_checked():
    p = parts()
    for bad, match in ((dict(block_size=1), "block_size"), (dict(num_draft_layers=0), "num_draft_layers"),
                       (dict(gamma=0.0), "gamma"), (dict(layers=[9]), r"\[0, 4\)")):
        with pytest.raises(ValueError, match=match):
            build_head("dflash", p, **bad)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_head("dflash", p, token_counts=torch.ones(97))


def test_a_block_longer_than_the_trained_one_is_refused(saved_dflash):
    with pytest.raises(ValueError, match="at most 5"):
        make_llm("dflash", saved_dflash, k=6)


def test_engine_drafts_equal_the_training_forward_on_the_committed_context(saved_dflash):
    """Across rounds with rejections: every draft is the block recomputed from scratch on the
    committed context, and each layer's cache holds exactly the positions before the anchor."""
    llm = make_llm("dflash", saved_dflash, k=3, lookup=False)
    drafter = llm.engine.drafter

    def caches_before_the_anchor(inp, d):
        caches = drafter.contexts[inp.request_id]
        assert all(c.origin + c.length == len(inp.token_ids) - 1 for c in caches)
        assert all(0 <= x <= 1 for x in d.confidence)

    head, p = drafter.head, parts()
    for ids, draft in recorded_drafts(llm, caches_before_the_anchor):
        batch = committed_batch(llm, head, ids)
        with torch.no_grad():
            logits = head.block_logits(batch, p, head.context(batch.hidden), torch.tensor([[len(ids) - 1]]), 4)[0, 0, 1:]
        assert draft.token_ids == head.to_target_ids(logits.argmax(-1)).tolist()[: len(draft)]


def test_lookup_rounds_leave_their_rows_waiting_and_the_block_catches_up(saved_dflash):
    """With the lookup on, a round's draft is the suffix lookup's when that has LOOKUP_MIN_TOKENS
    tokens or more, else the block's; the rows of rounds the block sat out wait (caches plus
    waiting rows = every position before the anchor), and every block draft is still the training
    forward's on the committed context."""
    from tandem.drafters.lookup import LOOKUP_MIN_TOKENS

    llm = make_llm("dflash", saved_dflash, k=3)
    drafter = llm.engine.drafter
    looked, sources = recorded_lookups(drafter), []

    def check(inp, draft):
        lookup = looked[inp.request_id, len(inp.token_ids)]
        waiting = 0
        if len(lookup) >= LOOKUP_MIN_TOKENS:
            assert draft.token_ids == lookup and draft.confidence is None
            pieces = drafter.lookup.pending[inp.request_id][0]
            waiting = sum(len(next(iter(piece.values()))) for piece in pieces)
            sources.append("lookup" if len(pieces) == 1 else "lookup after lookup")
        else:
            sources.append("block")
        caches = drafter.contexts.get(inp.request_id)
        held = caches[0].origin + caches[0].length if caches else len(inp.token_ids) - 1 - waiting
        assert held + waiting == len(inp.token_ids) - 1

    seen = recorded_drafts(llm, check, COPYING_PROMPTS)
    assert {"lookup", "lookup after lookup", "block"} <= set(sources)
    head, p = drafter.head, parts()
    for (ids, draft), source in zip(seen, sources):
        if source == "block":
            batch = committed_batch(llm, head, ids)
            with torch.no_grad():
                logits = head.block_logits(batch, p, head.context(batch.hidden), torch.tensor([[len(ids) - 1]]), 4)[0, 0, 1:]
            assert draft.token_ids == head.to_target_ids(logits.argmax(-1)).tolist()[: len(draft)]


def test_under_the_confidence_scheduler_lookup_drafts_carry_how_often_earlier_ones_passed(saved):
    """The scheduler prices every draft by its confidences: a lookup draft's are the pass rates
    of earlier lookup drafts on the same evidence, corrected by the request's offset, and the
    output stays plain decoding's."""
    from tandem.drafters.calibration import shifted

    llm = make_llm("dspark", saved("dspark"), k=3)
    assert llm.engine.drafter.lookup.suffix.confidence is None  # other policies do not read them
    spec = dataclasses.replace(llm.engine.config.spec, policy="confidence")
    eng = Engine(llm.loaded, dataclasses.replace(llm.engine.config, spec=spec), cost_curve=CostCurve((1, 64), (1.0, 1.0)))
    drafter, lookup = eng.drafter, eng.drafter.lookup
    expected, proposed = {}, []
    suffix_lookup, propose = lookup.suffix.lookup, drafter.propose

    def recording_lookup(inputs):
        drafts = suffix_lookup(inputs)
        for inp, d in zip(inputs, drafts):
            if d.token_ids:
                conf = lookup.suffix.confidence
                offset = conf.calibration.offset.get(inp.request_id, conf.calibration.global_offset)
                evidence = lookup.suffix.evidence[inp.request_id]
                rates = [shifted(conf.rate(evidence, j), offset) for j in range(len(d))]
                expected[inp.request_id, len(inp.token_ids)] = (d.token_ids, rates)
        return drafts

    def recording(batch):
        drafts = propose(batch)
        proposed.extend((inp.request_id, len(inp.token_ids), d) for inp, d in zip(batch, drafts))
        return drafts

    lookup.suffix.lookup, drafter.propose = recording_lookup, recording
    reqs = [eng.add_request(ids, GREEDY) for ids in COPYING_PROMPTS]
    while eng.has_work():
        eng.step()
    assert [r.output_ids for r in reqs] == [list(o) for o in plain(GREEDY, tuple(map(tuple, COPYING_PROMPTS)))]
    looked = 0
    for rid, n, draft in proposed:
        if (rid, n) in expected:
            tokens, rates = expected[rid, n]
            assert draft.token_ids == tokens and draft.confidence == rates
            looked += 1
    assert looked >= 3 and lookup.suffix.confidence.grades  # the lookup's drafts were graded


def test_lookup_pass_rates_are_kept_by_evidence_and_start_at_one():
    """A lookup draft's pass rates are kept apart by evidence (own text or not, match-length
    class), start at 1 and move only where a position was graded, so a position the scheduler
    has not yet admitted is still tried rather than kept out by a pessimistic start; one request
    that drafts badly is corrected on its own (docs/serving.md)."""
    from tandem.drafters.suffix import LookupConfidence
    from tandem.drafters.suffix import CORPUS_TRIE, OWN_TRIE

    conf = LookupConfidence()
    long_own, short_corpus = (OWN_TRIE, 12), (CORPUS_TRIE, 1)
    assert conf.confidences("r", short_corpus, 4) == [1.0] * 4
    conf.observe("r", 1, 0)  # cut to one token by the scheduler, rejected
    assert conf.rate(short_corpus, 0) == 0.5 and [conf.rate(short_corpus, j) for j in (1, 2, 3)] == [1.0] * 3
    assert conf.rate(long_own, 0) == 1.0  # other evidence: untouched
    assert conf.confidences("s", short_corpus, 2)[0] < 1.0  # a new request starts from the shared rates
    conf.observe("s", 2, 1)  # positions 0 and 1 graded: the first passed
    assert conf.rate(short_corpus, 0) == pytest.approx(2 / 3) and conf.rate(short_corpus, 1) == 0.5
    conf.observe("s", 2, 2)  # nothing drafted since: nothing to grade
    assert conf.rate(short_corpus, 0) == pytest.approx(2 / 3)
    # a request whose drafts keep failing reports lower confidences than the shared rates
    for _ in range(4):
        conf.confidences("bad", short_corpus, 2)
        conf.observe("bad", 2, 0)
    assert conf.confidences("bad", short_corpus, 2)[0] < conf.rate(short_corpus, 0)
    conf.not_drafted("bad")
    conf.observe("bad", 2, 2)  # the head's draft: not the lookup's to learn from
    conf.release("bad")
    assert "bad" not in conf.drafted


def test_the_scheduler_hears_which_drafts_the_lookup_makes_before_drafting(saved):
    """Under the confidence scheduler the engine asks the drafter, before the policy decides,
    whether each request's draft would be the lookup's or the head's (DraftSlot.source); the
    lookup's drafts found then are the ones proposed (the suffix drafter is asked once per
    request and round), and the output stays plain decoding's."""
    llm = make_llm("dspark", saved("dspark"), k=3)
    spec = dataclasses.replace(llm.engine.config.spec, policy="confidence")
    eng = Engine(llm.loaded, dataclasses.replace(llm.engine.config, spec=spec), cost_curve=CostCurve((1, 64), (1.0, 1.0)))
    lookup, policy = eng.drafter.lookup, eng.policy
    asked, rounds, proposed = [], [], []
    suffix_lookup, draft_lengths, propose = lookup.suffix.lookup, policy.draft_lengths, eng.drafter.propose

    def counting(inputs):
        asked.append(len(inputs))
        return suffix_lookup(inputs)

    def deciding(slots):
        rounds.append(list(slots))
        return draft_lengths(slots)

    def recording(batch):
        drafts = propose(batch)
        proposed.extend(zip([i.request_id for i in batch], drafts))
        return drafts

    lookup.suffix.lookup, policy.draft_lengths, eng.drafter.propose = counting, deciding, recording
    reqs = [eng.add_request(ids, GREEDY) for ids in COPYING_PROMPTS]
    while eng.has_work():
        eng.step()
    assert [r.output_ids for r in reqs] == [list(o) for o in plain(GREEDY, tuple(map(tuple, COPYING_PROMPTS)))]
    sources = [s.source for slots in rounds for s in slots if s.limit > 0]
    assert {"lookup", "head"} <= set(sources)
    assert sum(asked) == len(sources)  # the round's propose took the drafts its peek found
    assert any(d.token_ids for _, d in proposed)


def test_confidences_are_fixed_before_the_block_is_drawn(saved_dflash):
    """DFlash's positions are independent given the context, so a position's confidence (what
    the confidence scheduler cuts on) must be the same whatever token each seed drew there: a
    confidence that read the drawn token (q_j(x_j)) would bias the output (algorithms.md)."""
    llm = make_llm("dflash", saved_dflash, k=3, lookup=False)
    ctx = PROMPTS[0]
    hidden = prefill_hidden(llm, ctx)
    params = SamplingParams(temperature=1.0)
    drafts = llm.engine.drafter.propose([DraftInput(f"r{i}", ctx, len(ctx), 3, params,
                                                    torch.Generator().manual_seed(i), hidden) for i in range(64)])
    for j in range(3):
        drawn = {d.token_ids[j] for d in drafts if len(d) > j}
        assert len(drawn) > 1  # the seeds drew different tokens at position j
        assert len({d.confidence[j] for d in drafts if len(d) > j}) == 1


def test_a_round_the_drafter_missed_restarts_its_caches(saved_dflash):
    llm = make_llm("dflash", saved_dflash, k=3, lookup=False)
    drafter = llm.engine.drafter
    ctx = PROMPTS[0] + [11, 12, 13, 14, 15, 16]
    hidden = prefill_hidden(llm, ctx)  # rows for ctx[:-1]

    def call(n_ctx: int, rows: slice):
        inp = DraftInput("r", ctx[:n_ctx], 6, 3, SamplingParams(temperature=0), torch.Generator(),
                         {k: v[rows] for k, v in hidden.items()})
        return drafter.propose([inp])[0]

    assert len(call(6, slice(0, 5))) == 3
    assert len(call(10, slice(7, 9))) == 3  # rows 5 and 6 never arrive: restart at position 7
    caches = drafter.contexts["r"]
    assert all(c.origin == 7 and c.length == 2 for c in caches)
    assert len(call(11, slice(9, 10))) == 3
    assert all(c.origin == 7 and c.length == 3 for c in drafter.contexts["r"])


def test_audit_fails_a_q_that_is_not_the_one_sampled_from(saved_dflash, monkeypatch):
    """Negative control: report a flattened q (q ** 0.1 renormalised, not the q each token was
    drawn from) and the committed tokens stop following the target."""
    original = DFlashDrafter.choose

    def flattened(self, inputs, seen, logits):
        tokens, qs = original(self, inputs, seen, logits)
        flat = [None if q is None else q.clamp(min=0) ** 0.1 for q in qs]
        return tokens, [None if q is None else q / q.sum() for q in flat]

    monkeypatch.setattr(DFlashDrafter, "choose", flattened)
    _, checks = audit(make_llm("dflash", saved_dflash, k=2, lookup=False), SamplingParams(temperature=1.0), seed=1)
    ran = [c for c in checks if c.passed is not None]
    assert ran and not all(c.passed for c in ran), checks


def test_training_resumes_bit_for_bit(tmp_path):
    """The anchors are drawn from torch's RNG, whose state the checkpoint carries: a run stopped
    after a checkpoint and resumed ends with the weights of an uninterrupted one."""
    loaded, p = sharp_target(), parts()
    llm = LLM.from_loaded(loaded, EngineConfig(max_model_len=64, max_num_seqs=8))
    prompts = [" ".join(str(3 + (i * 11 + j) % 90) for j in range(4)) for i in range(8)]
    seqs = sequences(distill(llm, prompts, tmp_path / "answers", DistillConfig("sharp", max_new_tokens=10)))
    torch.manual_seed(0)
    layers = build_head("dflash", p, block_size=4).hidden_layers
    data = CapturedData(capture(loaded, seqs, tmp_path / "cap", layers, shard_size=4, store_dtype=torch.float32), layers)
    cfg = TrainConfig(steps=6, batch_size=3, lr=3e-3, eval_every=100, checkpoint_every=3)

    def head():
        torch.manual_seed(0)
        return build_head("dflash", p, block_size=4, anchors_per_sequence=3)

    whole = head()
    run(whole, p, data, None, cfg, tmp_path / "whole")
    interrupted = head()
    calls = {"n": 0}
    original = interrupted.training_loss

    class Stop(Exception):
        pass

    def crash_on_fifth(batch, target):
        calls["n"] += 1
        if calls["n"] == 5:  # steps 1-4 done, checkpoint at step 3
            raise Stop
        return original(batch, target)

    interrupted.training_loss = crash_on_fifth
    with pytest.raises(Stop):
        run(interrupted, p, data, None, cfg, tmp_path / "part")
    torch.manual_seed(123)
    resumed = build_head("dflash", p, block_size=4, anchors_per_sequence=3)
    assert run(resumed, p, data, None, cfg, tmp_path / "part", resume=True).step == 6
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_greedy_choice_ends_a_draft_only_at_a_broken_row(saved):
    """A greedy row's token is its argmax in target ids; a row holding a NaN or an infinity gives
    -1 (the draft ends there), a row of finite values whose sum overflows does not."""
    llm = make_llm("dflash", saved("dflash"), k=3, lookup=False)
    drafter = llm.engine.drafter
    V = len(drafter.head.draft_ids)
    logits = torch.randn(4, V)
    logits[0, 7] = 50.0
    logits[1, 3] = float("nan")
    logits[2, 9] = float("-inf")
    logits[3] = torch.full((V,), 3e38)  # finite, though its sum is not
    logits[3, 11] = 3.3e38
    inp = DraftInput("r", [1, 2, 3], 3, 3, SamplingParams(temperature=0), torch.Generator(), {})
    tokens, qs = drafter.choose([inp] * 4, [None] * 4, logits)
    ids = drafter.head.draft_ids
    assert tokens == [int(ids[7]), -1, -1, int(ids[11])]
    assert qs == [None] * 4
