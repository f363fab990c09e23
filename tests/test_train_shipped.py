"""The drafters shipped for the default model: records are complete and speculation with each is
lossless on the real SmolLM2 (greedy output identical to plain decoding)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SHIPPED = Path(__file__).resolve().parents[1] / "src" / "tandem" / "drafters" / "shipped" / "smollm2-135m-instruct"
HEADS = sorted(p for p in SHIPPED.glob("*") if (p / "head.json").exists()) if SHIPPED.exists() else []


@pytest.mark.parametrize("head_dir", HEADS, ids=lambda p: p.name)
def test_shipped_record_is_complete(head_dir):
    from tandem.drafters.heads.io import read_head_config

    config = read_head_config(head_dir)
    assert config["target"]["model_name"] == "smollm2-135m-instruct" and config["method"] == head_dir.name
    record = json.loads((head_dir / "training_record.json").read_text())
    assert record["data"]["train_sequences"] > 0 and record["training"]["steps_done"] > 0
    held = record["held_out"]
    assert held["tau"] == pytest.approx(1 + sum(held["cumulative"]), abs=1e-3)
    assert sum(f.stat().st_size for f in head_dir.iterdir()) < 40 * 2**20  # kept small in the repo


def test_shipped_heads_are_found_by_model_and_method():
    from tandem.drafters.heads.io import shipped_head_dir

    for head_dir in HEADS:
        assert shipped_head_dir("smollm2-135m-instruct", head_dir.name) == head_dir
    assert shipped_head_dir("smollm2-135m-instruct", "no-such-method") is None
    assert shipped_head_dir("gemma3-270m", "eagle3") is None


def assert_greedy_lossless(spec, cost_curve=None):
    """Speculation with SpecConfig `spec` on the real model commits plain decoding's tokens for
    two chat prompts at once, and accepts some drafts."""
    from tandem.config import EngineConfig, SamplingParams
    from tandem.llm import LLM

    plain = LLM(max_model_len=512)
    llm = LLM.from_loaded(plain.loaded, EngineConfig(max_model_len=512, spec=spec), cost_curve=cost_curve)
    prompts = ["Explain in three sentences why the sky is blue.", "Natalia sold 48 clips in April and half as many in May. How many in total?"]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    want = [o.token_ids for o in plain.generate(prompts, params, chat=True)]
    got = llm.generate(prompts, params, chat=True)
    assert [o.token_ids for o in got] == want
    assert sum(o.spec.num_accepted_tokens for o in got) > 0


@pytest.mark.slow
@pytest.mark.parametrize("head_dir", HEADS, ids=lambda p: p.name)
def test_shipped_drafter_is_lossless_on_the_real_model(head_dir):
    from tandem.config import SpecConfig

    assert_greedy_lossless(SpecConfig(algorithm=head_dir.name, num_draft_tokens=4, draft_model_path=str(head_dir)))


@pytest.mark.slow
def test_shipped_eagle3_trees_are_lossless_on_the_real_model():
    """Trees through the block kernels' tree attention, batched (two requests of different
    lengths): greedy output equals plain decoding, and the tree commits more per forward than
    the chain does."""
    from tandem.config import EngineConfig, SamplingParams, SpecConfig
    from tandem.llm import LLM

    plain = LLM(max_model_len=512)
    prompts = ["Explain in three sentences why the sky is blue.",
               "Translate into French: The cat sleeps on the warm windowsill every afternoon."]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    want = [o.token_ids for o in plain.generate(prompts, params, chat=True)]
    taus = {}
    for topk, nodes in ((1, 4), (4, 16)):
        spec = LLM.from_loaded(plain.loaded, EngineConfig(max_model_len=512, spec=SpecConfig(
            algorithm="eagle3", num_draft_tokens=nodes, eagle_topk=topk)))
        got = spec.generate(prompts, params, chat=True)
        assert [o.token_ids for o in got] == want
        taus[topk] = spec.engine.stats.mean_acceptance_length
    assert taus[4] > taus[1]


@pytest.mark.slow
def test_shipped_dspark_under_the_confidence_scheduler_is_lossless_on_the_real_model():
    """DSpark as tandem serve runs it: each round's verified prefixes admitted across the batch
    from the shipped head's calibrated confidences, on a curve where verification is cheap."""
    from tandem.config import SpecConfig
    from tandem.scheduler.cost_model import CostCurve

    if not (SHIPPED / "dspark" / "head.json").exists():
        pytest.skip("no shipped dspark head")
    curve = CostCurve((1, 4, 8, 16, 64), (1.0, 1.02, 1.1, 1.4, 5.0))
    assert_greedy_lossless(SpecConfig(algorithm="dspark", num_draft_tokens=4, policy="confidence"), curve)
