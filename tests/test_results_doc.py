"""`tandem bench results`: results/README.md rebuilt from the results JSON files (bench/results_doc.py).

Synthetic reports of every known kind plus unknown and broken files go through the generator,
and the tables must carry their numbers; the checked-in results/README.md must be exactly what
the generator makes of the checked-in results/ (no model, no torch work: JSON in, text out).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.bench.results_doc import render
from tandem.bench.results_format import slug
from tandem.bench.results_page import kind_of

REPO = Path(__file__).resolve().parents[1]


def _row(tps, tau=None, speedup=None, accept=None, drafts=0, drafted=0, rounds=0, seconds=0.0):
    row = {"tokens": 100, "seconds": 100 / tps, "tokens_per_second": tps}
    if speedup is not None:
        row["speedup"] = speedup
    if tau is not None:
        row.update(tau=tau, acceptance_rate=0.25, acceptance_per_position=accept or [],
                   spec={"num_drafts": drafts, "num_draft_tokens": drafted, "mean_acceptance_length": tau})
    if rounds:
        row["draft"] = {"rounds": rounds, "seconds": seconds}
    return row


def _spec_report(subtasks, date="2026-12-02 10:00 UTC", transformers=True, limit=2):
    cats = {}
    for i, cat in enumerate([*subtasks, "overall"]):
        cats[cat] = {"num_prompts": limit if cat != "overall" else limit * len(subtasks), "tandem": {
            "plain": _row(40.0 + i, tau=1.0, drafts=0),
            "suffix": _row(44.0 + i, tau=1.57 + i / 100, speedup=1.111 + i / 100, accept=[0.39, 0.76],
                           drafts=10, drafted=18, rounds=10, seconds=0.001),
            "eagle3@k=16@topk=4@steps=5": _row(20.0, tau=2.53, speedup=0.47, accept=[0.71, 0.65],
                                               drafts=10, drafted=154, rounds=10, seconds=0.233),
        }}
        if transformers:
            cats[cat]["transformers"] = {
                "plain": {"tokens": 100, "seconds": 13.0, "tokens_per_second": 7.7, "vs_tandem_plain": 0.21},
                "prompt_lookup": {"tokens": 100, "seconds": 12.0, "tokens_per_second": 8.6, "speedup": 1.104},
            }
    return {
        "model": "smollm2-135m-instruct", "quantization": "native", "dtype": "float32", "temperature": 0.0,
        "seed": 0, "num_draft_tokens": 4, "max_new_tokens": 64, "num_prompts": limit * len(subtasks),
        "methods": [
            {"label": "suffix", "algorithm": "suffix", "draft_path": None, "num_draft_tokens": 4},
            {"label": "eagle3@k=16@topk=4@steps=5", "algorithm": "eagle3", "draft_path": None,
             "num_draft_tokens": 16, "eagle_topk": 4, "num_steps": 5, "lookup": True},
        ],
        "transformers": {"dtype": "float32", "prompt_lookup_num_tokens": 10,
                         "assisted": {"model": None, "applicable": False, "reason": "none smaller"}}
        if transformers else None,
        "machine": {"cpu": "Test CPU 9000", "isa": ["avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"],
                    "kernels": "tandem avx2", "cores": 2, "torch_threads": 1, "torch": "2.13.0+cpu", "date": date},
        "categories": cats,
        "identity": {"suffix": {"mismatches": 0, "prompts": limit * len(subtasks), "details": []},
                     "eagle3@k=16@topk=4@steps=5": {"mismatches": 0, "prompts": limit * len(subtasks), "details": []}},
        "identity_transformers": {"prompt_lookup": {"mismatches": 0, "prompts": limit * len(subtasks)}}
        if transformers else {},
        "cost_curve": {"1": 0.02, "2": 0.025, "4": 0.03, "8": 0.04, "16": 0.06, "32": 0.1},
        "limit_per_subtask": limit,
    }


def _base_report():
    curve = {"1": 0.01, "2": 0.0116, "4": 0.0132, "8": 0.0175, "16": 0.0279, "32": 0.0513}
    return {
        "model": "gemma3-270m", "bandwidth_gb_s": 22.38, "max_new_tokens": 128, "clock": "wall", "threads": None,
        "num_prompts": 6,
        "kernels": {"cpu": "Test CPU 9000", "isa": ["avx2"], "kernels": "tandem avx2", "threads": 2,
                    "bandwidth_gb_s": 22.38, "int8_peak_gmac_s": 441.85, "tandem_bytes": 111617280,
                    "gguf_bytes": 96576768, "floor_ms": 4.3146, "context": 300, "step_ms": 6.7416,
                    "curve": {"1": 1.0, "2": 1.1577, "4": 1.3183, "5": 1.5101, "8": 1.7459, "16": 2.7908},
                    "extra_row_ms": 0.8048, "extra_row_efficiency": 0.378, "bf16_step_ms": 30.87,
                    "bf16_curve": {"1": 1.0, "8": 0.999}},
        "results": [
            {"name": "transformers generate fp32", "tokens_per_second": 7.08, "weight_bytes": 538060288,
             "bandwidth_fraction": 0.2166, "cost_curve": curve, "step_ms": 133.88, "agreement_tokens": None},
            {"name": "tandem native/float32 (tandem avx2)", "tokens_per_second": 85.5889, "weight_bytes": 111617280,
             "bandwidth_fraction": 0.4268, "cost_curve": curve, "step_ms": 7.147, "agreement_tokens": 18.67},
            {"name": "llama.cpp (same GGUF)", "tokens_per_second": 37.506, "weight_bytes": 0,
             "bandwidth_fraction": None, "cost_curve": {}, "step_ms": None, "agreement_tokens": None},
        ],
    }


def _advise_report():
    return {
        "model": "smollm2-135m-instruct", "quantization": "native", "dtype": "float32", "num_prompts": 6,
        "max_new_tokens": 32, "temperature": 0.0, "k_max": 3, "threads": 1, "cores": 2, "bandwidth_gb_s": 2.2,
        "weight_bytes": 111617280, "bandwidth_limit_seconds": 0.0507,
        "cost_curve": {"1": 0.1484, "2": 0.19, "4": 0.3078, "5": 0.3078},
        "drafters": [{"label": "ngram", "k_measured": 3, "expected_tau": {"1": 1.0516, "2": 1.0959, "3": 1.1253},
                      "best_k": 0, "predicted_best": 1.0, "predicted_at_k_measured": 0.682,
                      "measured_at_k_measured": 0.7943, "measured_tau": 1.1515, "break_even_batch": 1,
                      "measured_best": 1.0}],
        "recommendation": "leave speculation off: no drafter measured here beats plain decoding",
        "warnings": [{"kind": "low_tau", "subject": "ngram", "message": "swap the drafter"}],
        "machine": {"cpu": "Test CPU 9000", "cores": 2, "torch_threads": 1, "torch": "2.13.0+cpu",
                    "kernels": "tandem avx512", "isa": ["avx512f"], "date": "2026-12-02 11:00 UTC"},
    }


def _serve_report():
    def level(c, tps, speedup, tau):
        return {"mode": "x", "concurrency": c, "num_requests": 4, "wall_seconds": 7.0, "throughput": tps,
                "per_user_tps": tps + 10, "ttft_p50_ms": 520.8, "ttft_p95_ms": 700.0, "itl_ms": 25.0,
                "acceptance_rate": 0.24, "tau": tau, "errors": 0, "speedup": speedup, "per_user_speedup": speedup}
    return {
        "model": "smollm2-135m-instruct", "modes": ["adaptive", "fixed", "off"], "concurrency": [1, 16],
        "requests_per_user": 1, "max_tokens": 64, "num_prompts": 80,
        "levels": {str(c): {"adaptive": level(c, 29.7, 0.99, 1.02), "fixed": level(c, 26.8, 0.894, 1.14),
                            "off": level(c, 29.98, 1.0, 1.0)} for c in (1, 16)},
        "identity": {"adaptive": {"compared": 68, "mismatches": 0}, "fixed": {"compared": 68, "mismatches": 1}},
        "algorithm": "suffix", "num_draft_tokens": 4, "max_running_requests": 32,
        "categories": ["qa"], "launched": ["adaptive", "fixed", "off"], "threads": 1,
    }


def _replicas_report():
    def level(c, tps, speedup):
        return {"mode": "x", "concurrency": c, "num_requests": 4, "wall_seconds": 7.0, "throughput": tps,
                "per_user_tps": tps / c, "ttft_p50_ms": 250.0, "ttft_p95_ms": 400.0, "itl_ms": 10.0,
                "acceptance_rate": 0.3, "tau": 1.4, "errors": 0, "speedup": speedup, "per_user_speedup": None}
    servers = ["--replicas 1 --threads 2", "--replicas 2 --threads 1"]
    return {
        "bench": "replicas", "model": "smollm2-135m-instruct", "servers": servers, "concurrency": [1, 8],
        "requests_per_user": 2, "max_tokens": 128, "num_prompts": 80,
        "levels": {servers[0]: {"1": level(1, 100.0, 1.0), "8": level(8, 200.0, 1.0)},
                   servers[1]: {"1": level(1, 90.0, 0.9), "8": level(8, 250.0, 1.25)}},
        "identity": {servers[0]: {"compared": 20, "mismatches": 0}, servers[1]: {"compared": 20, "mismatches": 0}},
        "load_before": {servers[0]: [0.1, 0.2, 0.3], servers[1]: [1.0, 0.5, 0.3]},
        "machine": {"cpu": "Test CPU 9000", "cores": 2, "torch_threads": None, "torch": "2.13.0+cpu",
                    "kernels": "tandem avx2", "isa": ["avx2"], "date": "2026-12-02 12:00 UTC"},
    }


@pytest.fixture
def results(tmp_path):
    root = tmp_path / "results"

    def put(rel, data):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(data if isinstance(data, str) else json.dumps(data))

    put("bench_spec.json", _spec_report(["translation", "qa"]))
    put("noted/bench_spec.json", {**_spec_report(["qa"]), "note": "the build before X, alternating with Y"})
    (root / "bench_spec").mkdir()
    (root / "bench_spec" / "cost_curve.png").write_bytes(b"png")
    parts = {"translation": "2026-12-02 08:00 UTC", "qa": "2026-12-02 09:00 UTC"}
    for cat, date in parts.items():
        put(f"full/parts/{cat}.json", _spec_report([cat], date=date, transformers=False, limit=80))
    merged = _spec_report(["translation", "qa"], transformers=False, limit=80)
    merged["merged_from"] = [{"report": f"{cat}.json", "subtasks": [cat], "num_prompts": 80, "date": date}
                             for cat, date in parts.items()]
    put("full/merged.json", merged)
    # A merge of parts over two subtasks each, in the results directory itself.
    pairs = {"a.json": (["multi_turn", "summarization"], "2026-12-03 08:00 UTC"),
             "b.json": (["math_reasoning", "rag"], "2026-12-03 09:00 UTC")}
    for name, (cats, date) in pairs.items():
        put(name, _spec_report(cats, date=date, transformers=False, limit=80))
    wide = _spec_report([c for cats, _ in pairs.values() for c in cats], transformers=False, limit=80)
    wide["merged_from"] = [{"report": name, "subtasks": cats, "num_prompts": 160, "date": date}
                           for name, (cats, date) in pairs.items()]
    put("wide_merged.json", wide)
    put("kernels/bench_base_gemma.json", _base_report())
    (root / "kernels" / "bench_base_gemma.png").write_bytes(b"png")
    put("advise.json", _advise_report())
    put("serve/sweep.json", _serve_report())
    put("zz_unknown.json", {"name": "something else", "count": 3, "ratio": 0.5, "nested": {"a": 1}})
    put("list.json", [1, 2, 3])
    put("broken.json", "{not json")
    return root


def _section(text: str, rel: str) -> str:
    start = text.index(f"\n## {rel}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def test_kinds():
    assert kind_of(_spec_report(["qa"])) == "bench_spec"
    assert kind_of({**_spec_report(["qa"]), "merged_from": [{"report": "qa.json"}]}) == "bench_spec_merged"
    assert kind_of(_base_report()) == "bench_base"
    assert kind_of(_advise_report()) == "advise"
    assert kind_of(_serve_report()) == "bench_serve"
    assert kind_of(_replicas_report()) == "bench_replicas"
    assert kind_of({"a": 1}) == kind_of([1]) == kind_of(3) == "unknown"


def test_every_file_gets_a_section_in_path_order(results):
    text = render(results, results / "README.md")
    rels = ["advise.json", "bench_spec.json", "broken.json", "full/merged.json", "full/parts/qa.json",
            "full/parts/translation.json", "kernels/bench_base_gemma.json", "list.json", "noted/bench_spec.json",
            "serve/sweep.json", "zz_unknown.json"]
    positions = [text.index(f"\n## {rel}\n") for rel in rels]
    assert positions == sorted(positions)
    for rel in rels:
        assert f"- [{rel}](#{slug(rel)})" in text
    assert slug("full/parts/qa.json") == "fullpartsqajson"
    # Deterministic, and nothing of the temporary path leaks into the text.
    assert render(results, results / "README.md") == text
    assert str(results.parent) not in text


def test_bench_spec_tables(results):
    text = _section(render(results, results / "README.md"), "bench_spec.json")
    # The command, rebuilt from the report's own fields (threads 1 of 2 cores; avx2 forced on an AVX-512 CPU).
    assert ("TANDEM_KERNELS=avx2 tandem bench spec --limit 2 --categories translation qa --max-new-tokens 64 "
            "--threads 1 --methods suffix eagle3@k=16@topk=4@steps=5 --json results/bench_spec.json "
            "--plots results/bench_spec") in text
    assert "Test CPU 9000, 2 cores, 1 torch threads" in text and "kernels: tandem avx2" in text
    overall = "| tandem suffix | 1.59 | 0.25 | 0.39 / 0.76 | 1.8 | 0.10 | 46.0 | 1.13x |"
    assert overall in text
    assert "| tandem eagle3@k=16@topk=4@steps=5 | 2.53 | 0.25 | 0.71 / 0.65 | 15.4 | 23.30 | 20.0 | 0.47x |" in text
    assert "| transformers plain | - | - | - | - | - | 7.7 | 1.00x (0.21x tandem plain) |" in text
    assert "| transformers prompt_lookup | - | - | - | - | - | 8.6 | 1.10x |" in text
    # Per subtask: tau / speedup of each method, the transformers ratio and its plain speed.
    assert "| translation | 2 | 40.0 | 1.57 / 1.11x | 2.53 / 0.47x | 1.10x | 7.7 |" in text
    assert "| qa | 2 | 41.0 | 1.58 / 1.12x | 2.53 / 0.47x | 1.10x | 7.7 |" in text
    assert "0 mismatches of 4 prompts for every method" in text
    assert "c(2) / c(4) / c(8) / c(16) / c(32) = 1.25 / 1.50 / 2.00 / 3.00 / 5.00 x one token (20.0 ms)" in text
    assert "[cost_curve.png](bench_spec/cost_curve.png)" in text


def test_a_spec_runs_note_is_in_its_command_and_section(results):
    text = _section(render(results, results / "README.md"), "noted/bench_spec.json")
    assert "--note 'the build before X, alternating with Y' --json results/noted/bench_spec.json" in text
    assert "\nNote: the build before X, alternating with Y\n" in text
    assert "Note:" not in _section(render(results, results / "README.md"), "bench_spec.json")


def test_merged_spec_and_its_parts(results):
    text = render(results, results / "README.md")
    merged = _section(text, "full/merged.json")
    assert "for cat in translation qa; do" in merged
    assert "--categories $cat" in merged and "--json results/full/parts/$cat.json --plots ''" in merged
    assert "tandem bench spec-merge results/full/parts/*.json --json results/full/merged.json --plots ''" in merged
    assert "(2026-12-02 08:00 UTC to 2026-12-02 09:00 UTC)" in merged
    part = _section(text, "full/parts/qa.json")
    assert "one part of [full/merged.json](full/merged.json)" in part
    assert "--categories qa" in part and "Per subtask" not in part


def test_a_merge_of_parts_over_several_subtasks(results):
    """One `bench spec` line per part, with its own subtasks (no per-subtask loop), and parts
    that lie beside other reports merged by name (a glob would take the others too)."""
    merged = _section(render(results, results / "README.md"), "wide_merged.json")
    assert "for cat in" not in merged and "over disjoint subtasks" in merged
    assert "--categories multi_turn summarization" in merged and "--json results/a.json" in merged
    assert "--categories math_reasoning rag" in merged and "--json results/b.json" in merged
    assert "spec-merge results/a.json results/b.json --json results/wide_merged.json" in merged and "//" not in merged


def test_bench_base_tables(results):
    text = _section(render(results, results / "README.md"), "kernels/bench_base_gemma.json")
    assert "TANDEM_KERNELS" not in text  # avx2 is what this CPU picks by itself: no override
    assert ("tandem bench base --model gemma3-270m --configs float32/native --num-prompts 6 --max-new-tokens 128 "
            "--out results/kernels/bench_base_gemma.json --plot results/kernels/bench_base_gemma.png") in text
    assert ("| tandem native/float32 (tandem avx2) | 85.6 | 12.09x | 2.28x | 112 | 43% | 18.7 | 7.1 | "
            "1.16 / 1.32 / 1.75 / 2.79 / 5.13 |") in text
    assert "| llama.cpp (same GGUF) | 37.5 | 5.30x | 1.00x | - | - | - | - | - |" in text
    assert "| decode step at a 300-token context | 6.74 ms = 1.56x the floor (4.31 ms) |" in text
    assert "| c(2) / c(4) / c(5) / c(8) / c(16) | 1.16 / 1.32 / 1.51 / 1.75 / 2.79 |" in text
    assert "| each extra verified row (n = 1..16) | 0.80 ms = 38% of the peak |" in text
    assert "| int8 peak (register loop) | 442 GMAC/s |" in text
    assert "| weights per step: tandem / the GGUF's own | 112 / 97 MB |" in text


def test_a_base_run_without_its_kernel_report_names_its_machine(tmp_path):
    """--skip-kernel-report: the run still records its machine, so the page does not take it for history."""
    root = tmp_path / "results"
    (root / "kernels").mkdir(parents=True)
    data = {**_base_report(), "kernels": None,
            "machine": {"cpu": "Test CPU 9000", "isa": ["avx2"], "kernels": "tandem avx2", "torch_threads": 2,
                        "cores": 2, "date": "2026-12-07 06:00 UTC"}}
    (root / "kernels" / "bench_base_fresh.json").write_text(json.dumps(data))
    text = _section(render(root, root / "README.md"), "kernels/bench_base_fresh.json")
    assert "Test CPU 9000" in text and "previous kernels" not in text and "--skip-kernel-report" in text


def test_advise_and_serve_tables(results):
    text = render(results, results / "README.md")
    advise = _section(text, "advise.json")
    assert ("tandem advise --limit 6 --max-new-tokens 32 --k-max 3 --threads 1 --drafters ngram "
            "--json results/advise.json") in advise
    assert "| ngram | 1.05 / 1.10 / 1.13 | 0.68x / 0.79x | 1.15 | 0 (do not speculate) | 1.00x / 1.00x | 1 |" in advise
    assert "leave speculation off" in advise and "`low_tau` (ngram)" in advise
    assert "One decode forward 148.4 ms; verifying 4 drafts 2.07x one forward" in advise
    serve = _section(text, "serve/sweep.json")
    assert ("tandem bench serve --algorithm suffix --threads 1 --max-running-requests 32 --max-tokens 64 "
            "--requests-per-user 1 --concurrency 1 16 --num-prompts 80 --categories qa "
            "--out results/serve/sweep.json --plot ''") in serve
    assert "| 1 | 30.0 | 0.99x | 0.89x | 40.0 | 0.99x | 0.89x | 1.02 (0.24) | 1.14 (0.24) | 0.5 | 0 |" in serve
    assert "| 16 | 30.0 |" in serve
    assert "adaptive 68/68, fixed 67/68" in serve
    # No machine recorded and not in the notes table: said so, and marked as the previous kernels.
    assert "not recorded in the file" in serve and "previous kernels" in serve


def test_bench_replicas_table(tmp_path):
    root = tmp_path / "results" / "serve"
    root.mkdir(parents=True)
    (root / "bench_ray.json").write_text(json.dumps(_replicas_report()))
    text = render(root.parent)
    assert ("tandem bench replicas --server-flags '--replicas 1 --threads 2' '--replicas 2 --threads 1' "
            "--concurrency 1 8 --requests-per-user 2 --num-prompts 80 --max-tokens 128 "
            "--out results/serve/bench_ray.json") in text
    assert "Test CPU 9000, 2 cores, torch 2.13.0+cpu" in text
    assert "| `--replicas 2 --threads 1` | 8 | 250.0 | 1.25x | 31.2 | 0.25 | 1.40 | 0 |" in text
    assert "`--replicas 2 --threads 1` 20/20" in text and "`--replicas 2 --threads 1` 1.00 / 0.50 / 0.30" in text


def test_unknown_and_broken_files_get_a_generic_section(results):
    text = render(results, results / "README.md")
    unknown = _section(text, "zz_unknown.json")
    assert "| name | \"something else\" |" in unknown and "| count | 3 |" in unknown and "| ratio | 0.5 |" in unknown
    assert "Nested fields: `nested`." in unknown
    assert "a JSON list of 3 items" in _section(text, "list.json")
    assert "Could not be read as JSON (JSONDecodeError" in _section(text, "broken.json")


def test_scratch_under_tmp_is_not_a_result(results):
    (results / "tmp").mkdir()
    (results / "tmp" / "full_report.json").write_text('{"benchmarks": []}')
    assert "full_report" not in render(results, results / "README.md")


def test_a_known_kind_with_a_broken_shape_falls_back(tmp_path):
    root = tmp_path / "results"
    root.mkdir()
    bad = _spec_report(["qa"])
    bad["categories"]["overall"]["tandem"] = "not a table"
    (root / "bench_spec.json").write_text(json.dumps(bad))
    text = render(root)
    assert "a `bench_spec` report whose fields this page could not read" in text
    assert "| model | \"smollm2-135m-instruct\" |" in text


def test_command_writes_and_checks(results, capsys):
    from tandem.cli import main

    out = results / "README.md"
    assert main(["bench", "results", "--results-dir", str(results), "--out", str(out)]) == 0
    assert out.read_text() == render(results, out)
    assert main(["bench", "results", "--results-dir", str(results), "--out", str(out), "--check"]) == 0
    out.write_text(out.read_text() + "edited\n")
    assert main(["bench", "results", "--results-dir", str(results), "--out", str(out), "--check"]) == 1
    assert main(["bench", "results", "--results-dir", str(results / "missing"), "--out", str(out)]) == 2


def test_checked_in_results_readme_is_up_to_date():
    """Regenerating results/README.md from the checked-in results/ gives the checked-in text
    (after adding or changing a result: `tandem bench results`)."""
    readme = REPO / "results" / "README.md"
    assert readme.read_text() == render(REPO / "results", readme), (
        "results/README.md is out of date: run `tandem bench results --results-dir results --out results/README.md`")
