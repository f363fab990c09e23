"""`tandem bench spec` core on a tiny random model: report structure, greedy identity, ratio definitions."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_loaded
from tandem.bench.spec import OVERALL, SpecCase, plot_spec, print_identity, print_table, run_spec_bench

# Repetitive prompts so n-gram / suffix drafts get matched (and sometimes accepted) on a random model.
CASES = [
    SpecCase("summarization", [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], 1),
    SpecCase("summarization", [10, 11, 12, 10, 11, 12, 10, 11], 2),
    SpecCase("qa", [30, 31, 30, 31, 30, 31], 3),
]
METHODS = ["ngram", "suffix"]


@pytest.fixture(scope="module")
def report():
    hf, loaded = tiny_loaded("llama")
    return run_spec_bench(loaded, CASES, methods=METHODS, num_draft_tokens=3, max_new_tokens=16,
                          hf_model=hf, hf_pld_tokens=4, warmup_ids=[40, 41, 42], progress=False)


def test_report_structure(report):
    assert list(report["categories"]) == ["summarization", "qa", OVERALL]
    assert report["categories"][OVERALL]["num_prompts"] == len(CASES)
    assert report["methods"] == METHODS and len(report["prompts"]) == len(CASES)
    json.dumps(report)  # the --out file


def test_stats_and_ratios(report):
    for cat, row in report["categories"].items():
        plain = row["tandem"]["plain"]
        assert plain["tau"] == pytest.approx(1.0)  # plain decoding commits one token per forward
        assert plain["tokens"] > 0 and plain["tokens_per_second"] > 0
        for m in METHODS:
            r = row["tandem"][m]
            assert r["tau"] >= 1.0
            assert 0.0 <= r["acceptance_rate"] <= 1.0
            assert r["tokens"] == plain["tokens"]  # identical greedy output -> identical counts
            assert r["tokens_per_second"] == pytest.approx(r["tokens"] / r["seconds"], rel=1e-3)
            assert r["speedup"] == pytest.approx(r["tokens_per_second"] / plain["tokens_per_second"])
        hf = row["transformers"]
        assert hf["pld"]["speedup"] == pytest.approx(hf["pld"]["tokens_per_second"] / hf["plain"]["tokens_per_second"])
    # The overall row aggregates the categories' counters (SpecStats.merge), not their ratios.
    for m in METHODS:
        total = sum(report["categories"][c]["tandem"][m]["spec"]["num_draft_tokens"] for c in ("summarization", "qa"))
        assert report["categories"][OVERALL]["tandem"][m]["spec"]["num_draft_tokens"] == total
    assert any(report["categories"][OVERALL]["tandem"][m]["spec"]["num_accepted_tokens"] > 0 for m in METHODS)


def test_greedy_identity(report):
    for m in METHODS:
        assert report["identity"][m]["mismatches"] == 0, report["identity"][m]["details"]
    assert report["identity_transformers_pld"]["mismatches"] == 0


def test_output(report, tmp_path, capsys):
    print_table(report)
    print_identity(report)
    out = capsys.readouterr().out
    assert "summarization" in out and OVERALL in out and "ngram 0/3" in out
    pytest.importorskip("matplotlib")
    plot_spec(report, str(tmp_path / "spec.png"))
    assert (tmp_path / "spec.png").stat().st_size > 0
