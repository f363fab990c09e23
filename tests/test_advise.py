"""`tandem advise`: predictions from synthetic measurements, the configuration warnings, prompt files,
and the command end to end on tiny models with controlled agreement (a draft model that reproduces
the target's logits at a fraction of its cost vs an unrelated one)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tandem.advise import analyse_drafter, drafter_warnings, setup_warnings
from tandem.bench.prompts import load_prompt_file, spread_prompts
from tandem.scheduler.cost_model import CostCurve, best_k, expected_tau
from test_bench_spec import save_tiny_family

pytestmark = pytest.mark.usefixtures("one_thread")

GENTLE = CostCurve.from_points({n: 0.01 * (1 + 0.1 * (n - 1)) for n in (1, 2, 4, 8, 16, 32, 64)})


def test_analysis_follows_the_cost_model():
    acc = [0.9, 0.8, 0.7, 0.6]
    a = analyse_drafter("good", acc, GENTLE, k_measured=4, draft_seconds_per_position=0.0005,
                        measured_speedup=1.9, measured_tau=3.1, k_max=4)
    cost = lambda k, b: b * k * 0.0005  # noqa: E731
    assert (a.best_k, a.predicted_best) == best_k(acc, GENTLE, 1, 4, cost)
    assert a.expected_tau == {k: pytest.approx(expected_tau(acc, k)) for k in range(1, 5)}
    tau4 = 1 + 0.9 + 0.72 + 0.504 + 0.3024
    assert a.predicted_at_k_measured == pytest.approx(tau4 * GENTLE(1) / (GENTLE(5) + 4 * 0.0005))
    assert a.break_even_batch is not None and a.break_even_batch > 1
    assert drafter_warnings(a, GENTLE) == []


def test_low_acceptance_warns_to_swap_the_drafter():
    a = analyse_drafter("poor", [0.3, 0.2, 0.1, 0.1], GENTLE, 4, 0.0005, 0.8, 1.3, k_max=4)
    warnings = drafter_warnings(a, GENTLE)
    assert "low_tau" in {w.kind for w in warnings}
    msg = next(w.message for w in warnings if w.kind == "low_tau")
    assert "swap the drafter" in msg and "k = 4" in msg


def test_a_costly_drafter_is_told_it_does_not_pay():
    """Full acceptance, but drafting each token costs as much as a forward: never worth it."""
    a = analyse_drafter("slow", [1.0] * 4, GENTLE, 4, GENTLE(1), 0.7, 5.0, k_max=4)
    assert a.best_k == 0 and [w.kind for w in drafter_warnings(a, GENTLE)] == ["no_gain"]
    assert a.break_even_batch == 1


def test_short_drafts_pay_only_for_what_they_verify():
    """Half the rounds draft nothing, half draft 4: at k = 4 a round costs the mean of c(1) and c(5),
    not c(5); at k = 2 the drafting rounds verify 3 tokens."""
    steep = CostCurve.from_points({1: 0.01, 3: 0.02, 5: 0.04, 9: 0.08})
    acc = [0.4, 0.9, 0.9, 0.9]
    a = analyse_drafter("lookup", acc, steep, 4, 0.0, 1.0, 1.5, k_max=4, draft_lengths=[5, 0, 0, 0, 5])
    assert a.predicted_at_k_measured == pytest.approx(expected_tau(acc, 4) * 0.01 / ((0.01 + 0.04) / 2))
    full = analyse_drafter("full", acc, steep, 4, 0.0, 1.0, 1.5, k_max=4)
    assert full.predicted_at_k_measured == pytest.approx(expected_tau(acc, 4) * 0.01 / 0.04)
    at2 = expected_tau(acc, 2) * 0.01 / ((0.01 + 0.02) / 2)
    assert a.expected_tau[2] == pytest.approx(expected_tau(acc, 2)) and a.predicted_best >= at2 - 1e-12


def test_measurements_far_from_the_prediction_are_flagged():
    a = analyse_drafter("good", [0.9, 0.8, 0.7, 0.6], GENTLE, 4, 0.0005, 1.9, 3.1, k_max=4)
    a.measured_best = a.predicted_best * 0.5
    warnings = drafter_warnings(a, GENTLE)
    assert [w.kind for w in warnings] == ["noisy"] and f"k = {a.best_k}" in warnings[0].message


def test_monotone_cost_curve():
    """The advisor and the serving profile share one rule: a dip means the smaller sizes were
    slowed by other load, so they take the faster time measured at a larger size."""
    noisy = CostCurve.from_points({1: 0.010, 2: 0.008, 4: 0.012, 8: 0.011, 16: 0.02})
    assert noisy.monotone().seconds == (0.008, 0.008, 0.011, 0.011, 0.02)
    assert GENTLE.monotone() == GENTLE


def fake_target(quantization="native", dtype=torch.bfloat16):
    return SimpleNamespace(quantization=quantization, dtype=dtype)


def test_setup_warnings():
    mb = 100_000_000
    # 10 ms per step while 100 MB at 20 GB/s needs 5 ms: half the limit, fine; 4 threads of 4 cores.
    quiet = setup_warnings(fake_target(), GENTLE, 20.0, mb, threads=4, cores=4)
    assert quiet == []
    slow = setup_warnings(fake_target(), GENTLE, 100.0, mb, threads=2, cores=4)  # 1 ms needed: 10%
    assert [w.kind for w in slow] == ["slow_base", "threads"]
    assert "10% of the bandwidth limit" in slow[0].message and "--threads 4" in slow[1].message
    steep = CostCurve.from_points({1: 0.01, 5: 0.03})
    kinds = [w.kind for w in setup_warnings(fake_target("none", torch.float32), steep, 20.0, mb, 4, 4)]
    assert kinds == ["expensive_verify", "dtype"]


def test_prompt_files(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("first prompt\n\n second one \n")
    assert [p.text for p in load_prompt_file(str(text))] == ["first prompt", "second one"]
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "a", "category": "code"}\n{"turns": ["b", "c"]}\n{"text": "d"}\n')
    got = load_prompt_file(str(jl), limit=2)
    assert [(p.text, p.category) for p in got] == [("a", "code"), ("b", "prompts")]
    jl.write_text('{"question": "no prompt field"}\n')
    with pytest.raises(ValueError, match='p.jsonl:1: no prompt text; give a "prompt"'):
        load_prompt_file(str(jl))
    with pytest.raises(FileNotFoundError, match="missing.txt: no such file"):
        load_prompt_file(str(tmp_path / "missing.txt"))
    sample = spread_prompts(7)
    assert len(sample) == 7 and len({p.category for p in sample[:6]}) == 6


@pytest.fixture(scope="module")
def advice(tmp_path_factory):
    from tandem.cli import main

    root = tmp_path_factory.mktemp("advise")
    dirs = save_tiny_family(root, target_layers=24)
    prompts = root / "prompts.txt"
    prompts.write_text("Write a haiku about rain.\nList three prime numbers.\nWhat is the capital of France?\n")
    out = root / "advice.json"
    rc = main(["advise", "--model", dirs["target"], "--drafters", f"draft_model={dirs['early']}",
               f"draft_model={dirs['other']}", "--prompts", str(prompts), "--limit", "3",
               "--max-new-tokens", "24", "--k-max", "4", "--threads", "1", "--json", str(out)])
    assert rc == 0
    return json.loads(out.read_text())


def test_advise_warns_for_a_poor_drafter_and_stays_quiet_for_a_good_one(advice):
    drafters = {d["label"]: d for d in advice["drafters"]}
    good, poor = drafters["draft_model(early)"], drafters["draft_model(other)"]
    # Controlled agreement: the early-exit copy is always right, the unrelated model almost never.
    assert good["acceptance"] == [1.0] * 4
    assert [good["expected_tau"][str(k)] for k in range(1, 5)] == [2.0, 3.0, 4.0, 5.0]
    assert poor["expected_tau"]["4"] < 1.2
    about = lambda label: {w["kind"] for w in advice["warnings"] if w["subject"] == label}  # noqa: E731
    assert about("draft_model(other)") >= {"low_tau"}, advice["warnings"]
    assert good["measured_best"] > 0 and good["measured_at_k_measured"] > 0
    # What follows from timings is checked for consistency, not for values: on a CPU that other work
    # keeps busy, the measured cost curve can make even a perfect drafter not pay. "noisy" is about
    # the machine, not the drafter; "no_gain" exactly when no draft length is predicted to pay.
    assert about("draft_model(early)") - {"noisy", "no_gain"} == set(), advice["warnings"]
    assert ("no_gain" in about("draft_model(early)")) == (good["best_k"] == 0)
    if good["best_k"] >= 1:
        assert good["predicted_best"] > 1.0
        assert advice["recommendation"].startswith("--speculative-algorithm draft_model --speculative-num-draft-tokens")


def test_advise_report(advice):
    assert advice["k_max"] == 4 and advice["num_prompts"] == 3
    assert advice["bandwidth_gb_s"] > 0 and advice["weight_bytes"] > 0
    assert int(min(advice["cost_curve"], key=int)) == 1 and len(advice["cost_curve"]) >= 8
    # A dense fp32 target on CPU is told about it; its threads setting matches what it asked for.
    kinds = {w["kind"] for w in advice["warnings"] if w["subject"] == "target"}
    assert "dtype" in kinds
    assert advice["threads"] == 1
    assert ("threads" in kinds) == (advice["cores"] > 1)
    for d in advice["drafters"]:
        assert d["break_even_batch"] is None or 1 <= d["break_even_batch"] <= advice["max_batch_checked"]


def test_advise_rejects_bad_input(tmp_path, capsys):
    from tandem.cli import main

    assert main(["advise", "--drafters", "nope", "--limit", "1"]) == 2
    assert main(["advise", "--limit", "0"]) == 2
    assert main(["advise", "--prompts", str(tmp_path / "missing.txt")]) == 2
    assert main(["advise", "--drafters", "eagle3@k=16@topk=4", "--limit", "1"]) == 2
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Write a haiku.\n")
    assert main(["advise", "--prompts", str(prompts), "--json", str(tmp_path / "." / "prompts.txt")]) == 2
    assert prompts.read_text() == "Write a haiku.\n"
    binary = tmp_path / "prompts.bin"
    binary.write_bytes(b"\xff\xfe")
    assert main(["advise", "--prompts", str(binary)]) == 2
    err = capsys.readouterr().err
    assert "unknown drafter 'nope'" in err and "--limit must be >= 1" in err and "missing.txt: no such file" in err
    assert "is one of the command's input files" in err and "prompts.bin is not UTF-8 text" in err
    assert "drop the @ options of eagle3@k=16@topk=4" in err


@pytest.mark.parametrize("flag, value, message", [("--k-max", "0", "k-max"), ("--temperature", "-1", "temperature")])
def test_bad_settings_are_refused_before_the_model_loads(monkeypatch, flag, value, message):
    import tandem.advise as advise_module
    from tandem.cli import main

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(advise_module, "load_model", load_model)
    assert main(["advise", flag, value, "--limit", "1"]) == 2  # a clear error, nothing loaded
