"""A step that raises ends only the request it raised for: a forward that fails for one request
(in its prompt or while it decodes), a drafter that fails, a grading or a first draw that fails.
The other requests keep the tokens they would have had alone, and nothing is left behind."""

from __future__ import annotations

import pytest

from conftest import quantized_tiny, tiny_loaded
from tandem.config import EngineConfig, SamplingParams, SpecConfig
from tandem.engine.engine import Engine
from tandem.verify import grading

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 17, 33, 8, 91, 4], [60, 61, 62], [7] * 11 + [12, 13]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
SUFFIX = SpecConfig(algorithm="suffix", num_draft_tokens=3)


@pytest.fixture(params=["general", "fused"])
def loaded(request):
    if request.param == "general":
        return tiny_loaded("llama")[1]
    model = quantized_tiny("llama")
    if not Engine(model, EngineConfig(max_model_len=64, max_num_seqs=1)).runner.batch_invariant:
        pytest.skip("this CPU runs no block-kernel variant, so no fused path")
    return model


def make_engine(loaded, spec: SpecConfig = SUFFIX) -> Engine:
    return Engine(loaded, EngineConfig(max_model_len=128, max_num_seqs=4, spec=spec))


def alone(loaded, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    engine = make_engine(loaded, SpecConfig())
    req = engine.add_request(prompt, params)
    while engine.has_work():
        engine.step()
    return req.output_ids


def finish(engine: Engine) -> None:
    while engine.has_work():
        engine.step()
    assert engine.admission.kv_reserved == 0
    assert engine.cache.num_free == engine.config.max_num_seqs - len(engine.admission.prefix_cache or ())


@pytest.mark.parametrize("when", ["prompt", "decoding"])
def test_a_forward_that_fails_for_one_request_ends_that_request_alone(loaded, when, monkeypatch):
    """The others keep the tokens they would have had alone, and the failed request's row is not
    kept for prefix reuse."""
    engine = make_engine(loaded)
    reqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    bad = reqs[1]
    forward = engine.runner.forward

    def failing(inputs, *args, **kwargs):
        due = not bad.output_ids if when == "prompt" else len(bad.output_ids) >= 3
        if due and any(i.seq == bad.seq for i in inputs):
            raise RuntimeError("a kernel fault")
        return forward(inputs, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", failing)
    finish(engine)
    assert bad.finish_reason == "error" and "RuntimeError" in bad.error
    assert bad.output().error == bad.error
    assert len(bad.output_ids) == (0 if when == "prompt" else 3)
    for req in (reqs[0], reqs[2]):
        assert req.finish_reason == "length" and req.output_ids == alone(loaded, req.prompt_ids)
    kept = engine.admission.prefix_cache  # (the fused path's: rows are reused where numbers do not depend on a batch)
    if kept is not None:
        assert len(kept) == 2  # the two that finished; the failed one's row was freed
        assert kept.longest_prefix(bad.prompt_ids)[1] == 0


def test_a_drafter_that_fails_costs_its_rounds_drafts_and_nothing_else(loaded, monkeypatch, caplog):
    engine = make_engine(loaded)
    short = SamplingParams(temperature=0.0, max_tokens=4)
    reqs = [engine.add_request(PROMPTS[0], GREEDY), engine.add_request(PROMPTS[1], short),
            engine.add_request(PROMPTS[2], GREEDY)]
    bad = reqs[1]
    drafter = engine.drafter
    propose = drafter.propose
    failed = []

    def failing(batch):
        if any(inp.request_id == bad.request_id for inp in batch):
            failed.append(len(batch))
            raise RuntimeError("a drafter bug")
        return propose(batch)

    monkeypatch.setattr(drafter, "propose", failing)
    alone_rounds = []
    round_of = engine._round_of
    monkeypatch.setattr(engine, "_round_of", lambda members: alone_rounds.append(len(members)) or round_of(members))
    finish(engine)
    assert failed, "the drafter was never asked while the request it fails for ran"
    assert len(alone_rounds) == len(failed) and set(alone_rounds) == {3}  # each time one plain round for all
    reports = [r for r in caplog.records if "a step over" in r.getMessage()]
    assert len(failed) > 1 and len(reports) == 1 and reports[0].exc_info  # once, with its traceback
    assert engine.stats.num_draft_tokens > 0  # once that request ended, the others drafted again
    for req in reqs:
        assert req.finish_reason == "length" and req.error is None
        assert req.output_ids == alone(loaded, req.prompt_ids, req.params)


def test_a_grading_that_fails_for_one_request_ends_it_and_the_round_goes_on(loaded, monkeypatch):
    engine = make_engine(loaded)
    reqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    bad = reqs[2]
    grade = grading.grade_round

    def failing(logits, draft, params, context, *args):
        if context[: len(bad.prompt_ids)] == bad.prompt_ids and len(context) > len(bad.prompt_ids) + 2:
            raise IndexError("a grading bug")
        return grade(logits, draft, params, context, *args)

    monkeypatch.setattr(grading, "grade_round", failing)
    recovered = []
    monkeypatch.setattr(engine, "_recover", lambda members: recovered.append(members))
    finish(engine)
    assert not recovered  # the round itself went on: nothing ran again
    assert bad.finish_reason == "error" and "IndexError" in bad.error and len(bad.output_ids) == 3
    for req in reqs[:2]:
        assert req.finish_reason == "length" and req.output_ids == alone(loaded, req.prompt_ids)


def test_a_first_draw_that_fails_ends_that_request_and_leaves_nothing_behind(loaded, monkeypatch):
    """The request whose first token cannot be drawn ends (its cache row and KV reservation go
    back: 64 such requests once left a server with no free row); the one decoding beside it
    goes on."""
    engine = make_engine(loaded)
    running = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()  # decoding now
    failing = engine.add_request(PROMPTS[1], GREEDY)
    sample_one = Engine._sample_one

    def broken(self, logits, req, *args):
        if req is failing:
            raise RuntimeError("a draw that cannot be made")
        return sample_one(self, logits, req, *args)

    monkeypatch.setattr(Engine, "_sample_one", broken)
    finish(engine)
    assert failing.finish_reason == "error" and not failing.output_ids and failing.seq is None
    assert running.output_ids == alone(loaded, PROMPTS[0])
