"""DSpark's confidence scheduler: admission across the batch in descending survival, stopping at
the first drop; nothing drafted when nothing would be admitted; rows priced as the runner
computes them; and a sampled audit of the scheduled engine that passes, with the power to see a
2% TV bias, while two broken schedulers fail it (docs/algorithms.md section 6)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import pickle
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch
from heads_fixtures import sharp_target
from test_drafter_heads import GREEDY, PROMPTS, make_llm, plain, saved_fixture  # noqa: F401 (the fixture `saved`)

from tandem.audit import Auditor, audit_rounds
from tandem.config import EngineConfig, SamplingParams, SpecConfig
from tandem.drafters import Drafter, register
from tandem.engine.engine import Engine
from tandem.sampling import processed_probs
from tandem.scheduler.cost_model import CostCurve
from tandem.scheduler.confidence import RETRY_ROUNDS, SOURCE_ROUNDS, ConfidenceScheduler
from tandem.scheduler.policy import DraftSlot, padded_rows
from tandem.types import Draft

pytestmark = pytest.mark.usefixtures("one_thread")

SAMPLED = SamplingParams(temperature=4.0, top_k=3)  # flat enough (top token ~0.6) for biases to show


def scheduler(curve: CostCurve, k: int = 4, verify_rows=padded_rows) -> ConfidenceScheduler:
    return ConfidenceScheduler(SpecConfig("dspark", k, policy="confidence"), curve, verify_rows)


def chain(*confidence: float) -> Draft:
    """A deterministic chain (a lookup's, or argmax drafts): graded by the one-hot rule."""
    return Draft(list(range(1, len(confidence) + 1)), confidence=list(confidence))


def sampled_chain(*confidence: float) -> Draft:
    """The same chain drawn from q rows: graded by the q-ratio rule."""
    tokens = list(range(1, len(confidence) + 1))
    return Draft(tokens, torch.full((len(tokens), 8), 1 / 8), confidence=list(confidence))


# ---- admission ----------------------------------------------------------------------------------


def test_admission_takes_pairs_in_descending_survival_across_the_batch():
    # Each extra row costs 0.1 of a one-row forward (flat rows): curve(n) = 0.9 + 0.1 n.
    curve = CostCurve((1, 64), (1.0, 7.3))
    s = scheduler(curve, verify_rows=sum)
    out = s.admit(["a", "b"], [chain(0.9, 0.9, 0.2, 0.9), chain(0.5, 0.3, 0.9, 0.9)], batch=2)
    # Survivals a: 0.9 0.81 0.162 ..., b: 0.5 0.15 ... In descending order a1 a2 b1 raise the
    # tokens per second (2/1.1 -> 2.9/1.2 -> 3.71/1.3 -> 4.21/1.4 = 3.01); a3 would lower it
    # (4.37/1.5 = 2.91), so b2 (0.15) is never reached.
    assert [len(d) for d in out] == [2, 1]
    assert out[0].token_ids == [1, 2] and out[1].confidence == [0.5]
    assert s.last.draft_lengths == (2, 1) and s.last.predicted_speedup == pytest.approx(4.21 / 1.4 / (2 / 1.1))


def test_sampled_drafts_stop_at_the_first_drop_deterministic_ones_look_past_it():
    # One row more costs 0.6, two rows more the same (a dip): admitting x_1 alone loses, so a
    # sampled draft stops there although x_1 and x_2 together (survivals 0.5 and 0.495) would win
    # (looking past the dip would read x_1 through c_2). A deterministic draft is graded by the
    # one-hot rule, which any cut keeps exact: it gets the best prefix, both tokens.
    curve = CostCurve((1, 2, 3), (1.0, 1.6, 1.6))
    s = scheduler(curve, k=2)
    assert [len(d) for d in s.admit(["a"], [sampled_chain(0.5, 0.99)], batch=1)] == [0]
    assert [len(d) for d in LooksPastTheDip(SpecConfig("dspark", 2, policy="confidence"), curve).admit(
        ["a"], [sampled_chain(0.5, 0.99)], batch=1)] == [2]
    assert [len(d) for d in s.admit(["a"], [chain(0.5, 0.99)], batch=1)] == [2]
    # One sampled draft in the round keeps every draft to the first drop (flat rows after a first
    # dear one, at batch 2).
    flat = scheduler(CostCurve((2, 3, 4, 5, 6), (1.0, 1.6, 1.6, 1.6, 1.6)), k=3, verify_rows=sum)
    assert [len(d) for d in flat.admit(["a", "b"], [chain(0.5, 0.99, 0.99), chain(0.1)], batch=2)] == [3, 1]
    assert [len(d) for d in flat.admit(["a", "b"], [chain(0.5, 0.99, 0.99), sampled_chain(0.1)], batch=2)] == [0, 0]


def test_running_requests_without_a_draft_count_in_the_batch():
    curve = CostCurve((1, 64), (1.0, 7.3))
    alone = scheduler(curve).admit(["a"], [chain(0.3, 0.3)], batch=1)
    crowded = scheduler(curve).admit(["a"], [chain(0.3, 0.3)], batch=16)
    assert len(alone[0]) == 1 and len(crowded[0]) == 0  # 16 committed tokens per round to beat


def test_the_rows_priced_are_the_rows_the_runner_computes():
    # Padded: one long draft makes every request's row count its length; flat rows do not.
    curve = CostCurve((1, 2, 8, 64), (1.0, 1.0, 1.6, 12.0))
    drafts = [chain(0.95, 0.95, 0.95), chain(0.2, 0.2, 0.2), chain(0.2, 0.2, 0.2), chain(0.2, 0.2, 0.2)]
    padded = scheduler(curve, verify_rows=padded_rows).admit(list("abcd"), drafts, batch=4)
    flat = scheduler(curve, verify_rows=sum).admit(list("abcd"), drafts, batch=4)
    assert [len(d) for d in padded] != [len(d) for d in flat]
    eng = Engine(sharp_target(), EngineConfig(max_model_len=64, spec=SpecConfig("test_sched_markov", 3, policy="confidence")),
                 cost_curve=curve)
    assert eng.policy.verify_rows == eng.runner.verify_rows
    lengths = [4, 1, 2]
    expected = sum(lengths) if eng.runner.fused is not None else 3 * 4
    assert eng.runner.verify_rows(lengths) == expected


def test_drafts_without_confidences_are_refused():
    with pytest.raises(ValueError, match="confidences"):
        scheduler(CostCurve((1,), (1.0,))).admit(["a"], [Draft([1, 2])], batch=1)
    # a drafter that reports none is refused when the engine is built, not at its first request
    for algorithm in ("ngram",):
        with pytest.raises(ValueError, match="reports none"):
            Engine(sharp_target(), EngineConfig(max_model_len=64, spec=SpecConfig(algorithm, 3, policy="confidence")),
                   cost_curve=CostCurve((1,), (1.0,)))


def test_before_drafting_the_best_prefix_is_priced_past_a_dip():
    # The first pair pays the whole round's drafting (0.8 of a forward) and loses alone; four
    # pairs together win. Nothing is drawn yet, so the scheduler may look past the dip.
    curve = CostCurve((1, 5), (1.0, 1.1))
    s = scheduler(curve, verify_rows=sum)
    s.observe_draft_time(0.8, 1)
    s.admit(["a"], [chain(0.7, 0.95, 0.95, 0.95)], batch=1)  # its survivals: 0.7 0.67 0.63 0.6
    assert s.draft_lengths([DraftSlot("a", 4)]) == [4]
    assert s._admission(1, [s.expected["a"][""]], [0.8]) == ([0], pytest.approx(1.0))  # stopping at the first drop: none


def test_a_lookup_draft_and_a_head_draft_are_priced_apart():
    """Survivals are kept per source, and a lookup's draft pays no drafting: the head stops
    drafting where its drafts do not pay for their drafting, the lookup's go on."""
    curve = CostCurve((1, 5), (1.0, 1.1))
    s = scheduler(curve, verify_rows=sum)
    s.observe_draft_time(0.5, 1)  # half a forward per head round
    for source, draft in (("head", chain(0.2, 0.2, 0.2, 0.2)), ("lookup", chain(0.9, 0.9, 0.9, 0.9))):
        assert s.draft_lengths([DraftSlot("a", 4, source)]) == [4]  # a first draft of each source is measured
        s.admit(["a"], [draft], batch=1)
    assert s.expected["a"]["head"][0] == pytest.approx(0.2) and s.expected["a"]["lookup"][0] == pytest.approx(0.9)
    assert s.draft_lengths([DraftSlot("a", 4, "head")]) == [0]
    assert s.draft_lengths([DraftSlot("a", 4, "lookup")]) == [4]
    # the same lookup survivals, priced as if they cost a head round, would not pay either
    assert s._admission(1, [s.expected["a"]["lookup"]], [10.0], past_dips=True)[0] == [0]
    s.release("a")
    assert "a" not in s.expected and "a" not in s.sources


def test_a_new_request_starts_from_the_first_drafts_of_its_source_not_from_the_starting_guess():
    """The server-wide survivals start at 1 so the first request drafts; from its first draft on
    they are the mean of the drafts so far per position (then a moving average), so the next
    requests price a head that drafts badly at what it reported, not at the guess."""
    curve = CostCurve((1, 5), (1.0, 1.1))
    s = scheduler(curve, verify_rows=sum)
    s.observe_draft_time(0.5, 1)  # half a forward per head round
    assert s.draft_lengths([DraftSlot("a", 4, "head")]) == [4]  # the guess: worth measuring
    s.admit(["a"], [chain(0.3, 0.2, 0.1, 0.05)], batch=1)
    assert s._global("head") == pytest.approx([0.3, 0.06, 0.006, 0.0003])
    assert s.draft_lengths([DraftSlot("b", 4, "head")]) == [0]  # a new request: priced at that draft
    s.admit(["b"], [chain(0.5, 0.4)], batch=1)  # drafted anyway: only two positions reported
    assert s._global("head") == pytest.approx([0.4, 0.13, 0.006, 0.0003])
    for i in range(200):  # then a moving average, which follows a drafter that got better
        s.draft_lengths([DraftSlot(f"r{i}", 4, "head")])
        s.admit([f"r{i}"], [chain(1.0, 1.0, 1.0, 1.0)], batch=1)
    assert min(s._global("head")) > 0.99
    assert s._global("lookup") == [1.0] * 4  # another source keeps its own


def test_a_retry_happens_only_where_a_draft_that_always_passes_would_pay():
    linear = scheduler(CostCurve((1, 2, 3), (1.0, 2.0, 3.0)), k=2)  # every row a whole forward
    linear.observe_draft_time(0.01, 1)
    assert all(linear.draft_lengths([DraftSlot("a", 2)]) == [0] for _ in range(3 * RETRY_ROUNDS))


def test_the_policy_learns_drafting_time_from_steady_rounds_only(saved):
    """A request's first draft catches the drafter up on its whole prompt: that round's time is
    not the per-round cost the policy prices but a cost per row caught up on, told apart
    (observe_catch_up) with the request's backlog (DraftSlot.backlog)."""
    llm = make_llm("dspark", saved("dspark"), k=3, max_num_seqs=1)
    eng = llm.engine  # a fixed k: the head drafts every round the lookup has nothing
    steady, caught, backlogs = [], [], []
    tell, catch, lengths = eng.policy.observe_draft_time, eng.policy.observe_catch_up, eng.policy.draft_lengths
    eng.policy.observe_draft_time = lambda seconds, units: steady.append(units) or tell(seconds, units)
    eng.policy.observe_catch_up = lambda seconds, rows, units: caught.append(rows) or catch(seconds, rows, units)
    eng.policy.draft_lengths = lambda slots: backlogs.append(slots[0].backlog) or lengths(slots)
    long_prompt = PROMPTS[2] * 3  # 39 rows to catch up on at the first draft
    assert llm.generate([long_prompt], GREEDY)[0].token_ids
    most = eng.config.spec.max_draft_len + 1
    assert backlogs[0] == len(long_prompt) and caught[0] == len(long_prompt)
    assert steady and all(rows > most for rows in caught)


def test_a_head_is_priced_by_the_rows_it_would_catch_up_on():
    """Catching up is learnt per row, beyond a steady round's time, and a head draft is priced
    by its request's backlog: one that would first catch up on a long prompt costs more."""
    s = scheduler(CostCurve((1, 2, 8), (0.003, 0.0031, 0.0035)), k=2)
    s.observe_draft_time(0.001, 1)
    s.observe_catch_up(0.001 + 300 * 0.00005, 300, 1)
    assert s.catch_up_per_row == pytest.approx(0.00005)
    s.expected["a"] = {"head": [0.5, 0.25]}
    assert s.draft_lengths([DraftSlot("a", 2, "head")]) == [2]
    assert s.draft_lengths([DraftSlot("a", 2, "head", backlog=300)]) == [0]  # 15 ms to catch up first


# ---- drafting only what could be admitted -------------------------------------------------------


def test_nothing_is_drafted_when_no_position_could_be_admitted(saved):
    """On a linear curve (every row costs a whole forward) no position can pay even at survival
    1, so the drafter is never called; on a flat one it drafts and the scheduler cuts."""
    def engine(curve):
        llm = make_llm("dspark", saved("dspark"), k=4)
        spec = dataclasses.replace(llm.engine.config.spec, policy="confidence")
        return Engine(llm.loaded, dataclasses.replace(llm.engine.config, spec=spec), cost_curve=curve)

    linear = engine(CostCurve((1,), (1.0,)))
    calls, asked = [], []
    propose, sources = linear.drafter.propose, linear.drafter.draft_sources
    linear.drafter.propose = lambda batch: calls.append(len(batch)) or propose(batch)
    # not even the lookup is asked which source would draft: the load pays no drafting at all
    linear.drafter.draft_sources = lambda inputs: asked.append(len(inputs)) or sources(inputs)
    for ids in PROMPTS:
        linear.add_request(ids, GREEDY)
    while linear.has_work():
        linear.step()
    assert calls == [] and asked == [] and linear.stats.num_drafts == 0
    assert not any(linear.policy.worth_asking([DraftSlot("a", 4), DraftSlot("b", 4)]))

    flat = engine(CostCurve((1, 64), (1.0, 1.0)))
    assert all(flat.policy.worth_asking([DraftSlot("a", 4), DraftSlot("b", 4)]))
    reqs = [flat.add_request(ids, GREEDY) for ids in PROMPTS]
    while flat.has_work():
        flat.step()
    assert flat.stats.num_drafts > 0
    assert tuple(tuple(r.output_ids) for r in reqs) == plain()  # greedy identity under the scheduler


def test_worth_asking_bounds_a_round_by_what_past_rounds_say():
    """Before asking the drafter anything, the scheduler checks that a draft could pay at each
    request's best expected survivals over the drafter's sources: once both sources' drafts are
    known to fail here, nothing is asked until the request is due a retry."""
    s = ConfidenceScheduler(SpecConfig("dspark", 2, policy="confidence"), CostCurve((1, 2, 3), (1.0, 1.15, 1.3)),
                            sources=("lookup", "head"))
    slots = [DraftSlot("a", 2)]
    assert any(s.worth_asking(slots))  # nothing learnt yet: a draft that all passes would pay
    for source in ("lookup", "head"):
        s.draft_lengths([DraftSlot("a", 2, source)])
        s.admit(["a"], [chain(0.05, 0.05)], batch=1)
    assert not any(s.worth_asking(slots))
    s.admit(["b"], [chain(0.9, 0.9)], batch=1)  # another request's good drafts: its own business
    assert not any(s.worth_asking(slots))
    for _ in range(RETRY_ROUNDS):
        s.skip_round(slots)
    assert any(s.worth_asking(slots))  # due a retry: priced as if its draft would all pass
    # one source still unknown for the request: the server-wide survivals bound it
    t = ConfidenceScheduler(SpecConfig("dspark", 2, policy="confidence"), CostCurve((1, 2, 3), (1.0, 1.15, 1.3)),
                            sources=("lookup", "head"))
    t.draft_lengths([DraftSlot("a", 2, "lookup")])
    t.admit(["a"], [chain(0.05, 0.05)], batch=1)
    # for SOURCE_ROUNDS rounds it is priced at the source it had when asked ...
    assert [any(t.worth_asking(slots)) for _ in range(SOURCE_ROUNDS)] == [False] * SOURCE_ROUNDS
    assert any(t.worth_asking(slots))  # ... then the head, unknown for it, bounds it again


def test_worth_asking_prices_the_source_a_request_was_last_asked_at_with_its_drafting_cost():
    """A request is priced at the source it was last asked at while that still stands: one whose
    lookup drafts failed is not asked again for SOURCE_ROUNDS rounds. One whose last draft was
    the head's (its lookup found nothing) is priced at the free lookup in front of it, whose
    match moves with the text, not at the head's round: asked when its lookup drafts would pay
    (at one user 86 of 688 rounds had gone undrafted by pricing the head), not when they fail."""
    s = ConfidenceScheduler(SpecConfig("dspark", 2, policy="confidence"), CostCurve((1, 2, 3), (1.0, 1.15, 1.3)),
                            sources=("lookup", "head"))
    slots = [DraftSlot("a", 2)]
    assert any(s.worth_asking(slots))
    assert s.draft_lengths([DraftSlot("a", 2, "head")]) == [2]
    s.observe_draft_time(5.0, 1)  # a head round costs 5 forwards
    s.admit(["a"], [chain(0.8, 0.8)], batch=1)
    assert any(s.worth_asking(slots))  # priced at the lookup (nothing known of it: it may pay), for free
    assert s.draft_lengths([DraftSlot("a", 2, "head")]) == [0]  # the head itself still does not pay
    s.draft_lengths([DraftSlot("a", 2, "lookup")])
    s.admit(["a"], [chain(0.05, 0.05)], batch=1)  # the lookup's drafts fail here
    assert [any(s.worth_asking(slots)) for _ in range(SOURCE_ROUNDS)] == [False] * SOURCE_ROUNDS
    assert s.draft_lengths([DraftSlot("a", 2, "head")]) == [0]  # asked at the head: not drafted ...
    assert not any(s.worth_asking(slots))  # ... and priced at its failing lookup, not asked


def test_a_head_alone_is_priced_at_its_drafting_cost_even_when_it_was_not_asked_lately():
    """With one source the bound needs no free drafting: a head whose round costs more than any
    draft could bring is never asked (under load a head alone had been asked every fifth round
    for nothing); behind a lookup, whose drafts are free, the same head's request still is."""
    curve = CostCurve((1, 2, 3), (1.0, 1.15, 1.3))
    alone = ConfidenceScheduler(SpecConfig("dspark", 2, policy="confidence"), curve)
    behind_lookup = ConfidenceScheduler(SpecConfig("dspark", 2, policy="confidence"), curve, sources=("lookup", "head"))
    slots = [DraftSlot("a", 2)]
    for s in (alone, behind_lookup):
        s.observe_draft_time(5.0, 1)  # a head round costs 5 forwards
    assert not any(alone.worth_asking(slots))  # even if its whole draft passed
    assert any(behind_lookup.worth_asking(slots))


def test_only_requests_whose_drafts_could_pay_are_asked_and_asking_has_a_price():
    s = ConfidenceScheduler(SpecConfig("dspark", 2, policy="confidence"),
                            CostCurve((1, 2, 3, 4, 5, 6), (1.0, 1.15, 1.3, 1.45, 1.6, 1.75)),
                            verify_rows=sum, sources=("lookup", "head"))  # the fused path's rows
    for source in ("lookup", "head"):  # earlier requests drafted well; a's drafts fail from either source
        for rid, confidence in [(f"done{i}", 0.95) for i in range(9)] + [("a", 0.05)]:
            s.draft_lengths([DraftSlot(rid, 2, source)])
            s.admit([rid], [chain(confidence, confidence)], batch=1)
    for i in range(9):
        s.release(f"done{i}")
    slots = [DraftSlot("a", 2), DraftSlot("b", 2)]
    assert s.worth_asking(slots) == [False, True]  # b is new: priced as the server's drafts so far, it would pay
    s.observe_asking(10.0, 1)  # asking costs more than any draft brings
    assert s.worth_asking(slots) == [False, False]


def test_a_request_switched_off_is_retried_later():
    s = scheduler(CostCurve((1, 2, 3), (1.0, 1.35, 1.7)), k=2)
    s.admit(["a"], [chain(0.1, 0.1)], batch=1)  # its survivals are now low
    slot = [DraftSlot("a", 2)]
    lengths = [s.draft_lengths(slot)[0] for _ in range(2 * RETRY_ROUNDS + 2)]
    # Idle for RETRY_ROUNDS rounds, it drafts once to measure again, and (with nothing new
    # admitted) waits as long again.
    assert lengths == ([0] * RETRY_ROUNDS + [2]) * 2


# ---- the sampled audit of the scheduled engine ---------------------------------------------------


def scheduled_audit(engine: Engine, params: SamplingParams, rounds: int, batch: int = 64, seed: int = 0):
    """The auditor's rounds from PROMPTS[0] through the engine's own admission (Auditor.run)."""
    auditor = Auditor(engine, PROMPTS[0], params, batch=batch)
    out = auditor.run(rounds, seed=seed)
    return out, audit_rounds(auditor, out, alpha=1e-3)


# Rows are cheap up to 192 (64 requests x 3), dearer to 256, then expensive: of 64 requests'
# 3-token drafts (survivals about 0.74, 0.45-0.53, 0.25-0.38 here) the scheduler verifies the
# first two tokens of all and the third of those whose survival is highest.
AUDIT_CURVE = CostCurve((64, 192, 256, 512), (1.0, 1.128, 1.282, 5.0))


def scheduled_engine(head_dir: str) -> Engine:
    llm = make_llm("dspark", head_dir, k=3)
    spec = dataclasses.replace(llm.engine.config.spec, policy="confidence")
    eng = Engine(llm.loaded, dataclasses.replace(llm.engine.config, spec=spec), cost_curve=AUDIT_CURVE)
    # Priced as flat rows (the CPU's fused path), so admitted lengths vary pair by pair; the tiny
    # float target runs the padded path, which changes what a round costs, not what is verified.
    eng.policy.verify_rows = sum
    return eng


def audit_rounds_in_a_worker(head_dir: str, rounds: int, seed: int) -> bytes:
    """Rounds of the scheduled engine's audit in a spawned process, on the machine's other core,
    pickled plainly: multiprocessing would pass each round's tensor as a file descriptor."""
    torch.set_num_threads(1)
    return pickle.dumps(Auditor(scheduled_engine(head_dir), PROMPTS[0], SAMPLED, batch=64).run(rounds, seed=seed))


@pytest.mark.slow
def test_the_scheduled_engine_passes_a_sampled_audit_with_power_for_a_2_percent_bias(saved):
    # 64 x 920 rounds. They are independent and seeded, so half of them run in a second process
    # (another seed, so other draws) while this one runs the rest: the same power in half the time.
    head_dir = str(saved("dspark"))
    half = 64 * 460
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        elsewhere = pool.submit(audit_rounds_in_a_worker, head_dir, half, 1)
        auditor = Auditor(scheduled_engine(head_dir), PROMPTS[0], SAMPLED, batch=64)
        rounds = auditor.run(half, seed=0) + pickle.loads(elsewhere.result(timeout=1200))
    checks = audit_rounds(auditor, rounds, alpha=1e-3)
    lengths = {len(r.draft) for r in rounds}
    assert {2, 3} <= lengths, lengths  # the schedule really cuts, by survival
    ran = {c.name: c for c in checks if c.passed is not None}
    assert all(c.passed for c in ran.values()), checks
    assert ran["position 1 token"].detectable <= 0.02, ran["position 1 token"]


@register("test_sched_markov")
class NextConfidenceDrafter(Drafter):
    """Samples x_1 from the target's own p_1 (so q = p: every verified x_1 is accepted) with
    confidence 0.5, then x_2 from p_2; c_2 is high exactly when x_1 is p_1's top token. A
    scheduler whose decision on x_1 reads c_2 verifies x_1 only when it is the top token."""

    reports_confidences = True

    def propose(self, batch):
        out = []
        for inp in batch:
            ctx, toks, qs, conf = list(inp.token_ids), [], [], []
            top = None
            for j in range(min(2, inp.max_draft_tokens)):
                q = processed_probs(target_logits(ctx), inp.params)[0]
                top = int(q.argmax()) if j == 0 else top
                toks.append(int(torch.multinomial(q, 1, generator=inp.generator)))
                qs.append(q)
                conf.append(0.5 if j == 0 else (0.99 if toks[0] == top else 0.01))
                ctx.append(toks[-1])
            out.append(Draft(toks, torch.stack(qs), None, conf))
        return out


def target_logits(ctx):
    from tandem.model.kv_cache import KVCache
    from tandem.model.runner import ModelRunner, SeqInput

    loaded = sharp_target()
    r = ModelRunner(loaded.model, KVCache(loaded.config, 1, 64, torch.float32))
    return r.forward([SeqInput(r.cache.allocate(), ctx)]).logits


class LooksPastTheDip(ConfidenceScheduler):
    """Broken on purpose: admits the best prefix of the descending order overall, looking past a
    pair that lowers the throughput to the pairs after it."""

    def _admission(self, batch, survivals, draft_seconds=None, past_dips=False, contexts=None):
        return super()._admission(batch, survivals, draft_seconds, past_dips=True, contexts=contexts)


DIP_CURVE = CostCurve((1, 2, 3), (1.0, 1.6, 1.6))


def markov_engine(policy_cls=ConfidenceScheduler) -> Engine:
    eng = Engine(sharp_target(), EngineConfig(max_model_len=64, spec=SpecConfig("test_sched_markov", 2, policy="confidence")),
                 cost_curve=DIP_CURVE)
    eng.drafting.policy = policy_cls(eng.config.spec, DIP_CURVE, eng.runner.verify_rows)
    return eng


def test_audit_fails_an_admission_that_looks_past_the_first_drop():
    rounds, checks = scheduled_audit(markov_engine(LooksPastTheDip), SAMPLED, rounds=1500, batch=1)
    assert {len(r.draft) for r in rounds} == {0, 2}  # verified only when x_1 was the top token
    failed = {c.name for c in checks if c.passed is False}
    assert "position 1 token" in failed, checks


def test_audit_passes_the_same_drafter_under_the_scheduler():
    rounds, checks = scheduled_audit(markov_engine(), SAMPLED, rounds=1500, batch=1)
    ran = [c for c in checks if c.passed is not None]
    assert ran and all(c.passed for c in ran), checks


@register("test_sched_lookup")
class DeterministicDipDrafter(Drafter):
    """Proposes two tokens without q, as a lookup does (one-hot rule): x_1 is p_1's top, second
    or third token in turn, x_2 p_2's top after it. c_1 = 0.5; c_2 is high every other round,
    so under DIP_CURVE the scheduler verifies both tokens, looking past the dip, or none."""

    reports_confidences = True
    calls = 0

    def propose(self, batch):
        out = []
        for inp in batch:
            DeterministicDipDrafter.calls += 1
            first = int(target_logits(list(inp.token_ids))[0].argsort(descending=True)[self.calls % 3])
            second = int(target_logits(list(inp.token_ids) + [first])[0].argmax())
            toks = [first, second][: inp.max_draft_tokens]
            out.append(Draft(toks, None, None, [0.5, 0.99 if self.calls % 2 else 0.01][: len(toks)]))
        return out


def test_audit_passes_deterministic_drafts_admitted_past_the_dip():
    """The one-hot rule keeps any cut that reads nothing of the target exact, so deterministic
    drafts are admitted past a dip; the sampled audit still passes."""
    eng = Engine(sharp_target(), EngineConfig(max_model_len=64, spec=SpecConfig("test_sched_lookup", 2, policy="confidence")),
                 cost_curve=DIP_CURVE)
    eng.drafting.policy = ConfidenceScheduler(eng.config.spec, DIP_CURVE, eng.runner.verify_rows)
    rounds, checks = scheduled_audit(eng, SAMPLED, rounds=1500, batch=1)
    assert {len(r.draft) for r in rounds} == {0, 2}
    ran = [c for c in checks if c.passed is not None]
    assert ran and all(c.passed for c in ran), checks


def test_audit_fails_an_admission_that_reads_the_q_of_the_drawn_token(saved):
    """The scheduler's admission, then a cut wherever x_j is not q_j's top token: it reads x_j."""
    llm = make_llm("dspark", saved("dspark"), k=3)
    spec = dataclasses.replace(llm.engine.config.spec, policy="confidence")
    eng = Engine(llm.loaded, dataclasses.replace(llm.engine.config, spec=spec), cost_curve=CostCurve((1, 256), (1.0, 1.0)))
    admit = eng.policy.admit

    def reads_the_token(ids, drafts, batch, contexts=None):
        out = []
        for d in admit(ids, drafts, batch, contexts):
            # verify x_j only while it is q_j's most likely token: a decision on x_j itself
            keep = next((j for j, t in enumerate(d.token_ids) if float(d.probs[j, t]) < float(d.probs[j].max())), len(d))
            out.append(d.truncated(keep))
        return out

    eng.policy.admit = reads_the_token
    rounds, checks = scheduled_audit(eng, SAMPLED, rounds=64 * 40)
    failed = {c.name for c in checks if c.passed is False}
    assert failed & {"position 1 token", "position 2 token"}, checks
