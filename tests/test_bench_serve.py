"""`tandem bench serve` against three in-process tiny servers (adaptive / fixed / off): the sweep,
its JSON, table and plot, the lossless cross-check, and the summary arithmetic."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import tiny_loaded
from test_server_fuzz import ByteTokenizer
from tandem.bench.serve import RequestResult, _parse_url, summarize
from tandem.cli import main
from tandem.config import EngineConfig, SpecConfig
from tandem.engine.engine import Engine
from tandem.launch_server import serve_in_background
from tandem.scheduler.cost_model import CostCurve
from tandem.server.app import build_app
from tandem.server.async_engine import AsyncEngine
from tandem.server.metrics import ServerMetrics

pytestmark = pytest.mark.usefixtures("one_thread")

CHEAP = CostCurve.from_points({1: 0.01, 64: 0.0101, 256: 0.0102})
SPECS = {
    "adaptive": SpecConfig(algorithm="suffix", num_draft_tokens=4, policy="adaptive"),
    "fixed": SpecConfig(algorithm="suffix", num_draft_tokens=4),
    "off": SpecConfig(),
}


@pytest.fixture(scope="module")
def servers(one_thread):
    _, loaded = tiny_loaded("llama")
    loaded = dataclasses.replace(loaded, tokenizer=ByteTokenizer())
    running = {}
    for mode, spec in SPECS.items():
        engine = Engine(loaded, EngineConfig(max_model_len=160, max_num_seqs=4, spec=spec), cost_curve=CHEAP)
        running[mode] = serve_in_background(build_app(AsyncEngine(engine, 8, ServerMetrics("tiny")), "tiny"))
    yield {mode: s.url for mode, s in running.items()}
    for s in running.values():
        s.stop()


def test_sweep_writes_table_json_and_plot(servers, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("count: 1 2 3 1 2 3\nsay hi\nabcabcabc\n")
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    argv = ["bench", "serve", "--served-model", "tiny", "--concurrency", "1", "3", "--requests-per-user", "1",
            "--prompts-file", str(prompts), "--max-tokens", "24", "--out", str(out), "--plot", str(png)]
    for mode, url in servers.items():
        argv += ["--url", f"{mode}={url}"]
    assert main(argv) == 0  # exit 0: every mode gave the same greedy answers
    report = json.loads(out.read_text())
    assert png.stat().st_size > 1000
    assert set(report["levels"]) == {"1", "3"} and report["modes"] == ["adaptive", "fixed", "off"]
    for c, per in report["levels"].items():
        assert per["off"]["speedup"] == 1.0 and per["off"]["tau"] == 1.0 and per["off"]["acceptance_rate"] == 0.0
        for mode, r in per.items():
            assert r["errors"] == 0 and r["num_requests"] == max(4, int(c))
            assert r["throughput"] > 0 and r["per_user_tps"] > 0 and r["ttft_p50_ms"] > 0
            assert r["speedup"] == pytest.approx(r["throughput"] / per["off"]["throughput"])
        assert per["fixed"]["tau"] > 1.0  # the suffix drafter hits on these repetitive prompts
    for mode in ("adaptive", "fixed"):
        assert report["identity"][mode] == {"compared": 4 + 4, "mismatches": 0}
    table = capsys.readouterr().out
    assert "conc" in table and "answers differ" in table


def test_summary_arithmetic():
    results = [
        RequestResult(0, ttft=0.5, e2e=2.5, completion_tokens=21, text="a", spec={
            "num_draft_tokens": 10, "num_accepted_tokens": 5, "num_target_forwards": 14}),
        RequestResult(1, ttft=1.0, e2e=2.0, completion_tokens=11, text="b", spec={
            "num_draft_tokens": 6, "num_accepted_tokens": 3, "num_target_forwards": 8}),
        RequestResult(2, 0.0, 0.0, 0, "", error="HTTP 503"),
    ]
    r = summarize("fixed", 2, wall=4.0, results=results)
    assert r.throughput == pytest.approx(32 / 4.0)
    assert r.per_user_tps == pytest.approx((20 / 2.0 + 10 / 1.0) / 2)
    assert r.itl_ms == pytest.approx(1000 / 10.0)
    assert r.acceptance_rate == pytest.approx(8 / 16)
    assert r.tau == pytest.approx(32 / 22)
    assert r.errors == 1 and r.num_requests == 3
    assert r.ttft_p50_ms == pytest.approx(1000.0)


def test_url_flag_is_checked():
    assert _parse_url("off=http://127.0.0.1:9/v1/") == ("off", "http://127.0.0.1:9/v1")
    assert _parse_url("confidence:dspark=http://x/v1") == ("confidence:dspark", "http://x/v1")
    with pytest.raises(ValueError, match="POLICY"):
        _parse_url("turbo=http://x/v1")
    with pytest.raises(ValueError, match="MODE=URL"):
        _parse_url("off=ftp://x")
    # a mode's own options hold '=' too
    assert _parse_url("adaptive:suffix@corpus=0=http://x/v1") == ("adaptive:suffix@corpus=0", "http://x/v1")
    # the server's address alone names its API too
    assert _parse_url("off=http://127.0.0.1:9") == ("off", "http://127.0.0.1:9/v1")
    assert _parse_url("off=http://127.0.0.1:9/") == ("off", "http://127.0.0.1:9/v1")


def test_alternating_slices_give_every_mode_every_prompt(servers):
    from tandem.bench.serve import run_sweep, slice_count

    assert slice_count(12, 3, 8) == 4 and slice_count(12, 3, 1) == 1 and slice_count(2, 3, 5) == 1
    prompts = ["count: 1 2 3 1 2 3", "say hi", "abcabcabc", "one two one two", "xyzxyz", "hello hello"]
    report = run_sweep({m: servers[m] for m in ("fixed", "off")}, "tiny", prompts, [2], requests_per_user=3,
                       max_tokens=16, alternations=3)
    assert report["alternations"] == 3
    for r in report["levels"]["2"].values():
        assert r["num_requests"] == 6 and r["errors"] == 0 and r["wall_seconds"] > 0
    assert report["identity"]["fixed"] == {"compared": 6, "mismatches": 0}
    assert "off" not in report["identity"] and report["identity_reference"] == "off"


def test_one_mode_compares_no_answers(servers, capsys):
    """Without a second mode there is nothing to hold the answers against: no identity is claimed."""
    from tandem.bench.serve import print_table, run_sweep

    report = run_sweep({"fixed": servers["fixed"]}, "tiny", ["say hi", "abcabcabc"], [1], requests_per_user=2,
                       max_tokens=8)
    assert report["identity"] == {} and report["identity_reference"] is None
    print_table(report)
    assert "add `off` to --modes" in capsys.readouterr().out
    report = run_sweep({"off": servers["off"]}, "tiny", ["say hi"], [1], requests_per_user=1, max_tokens=4)
    print_table(report)
    assert "add a speculative mode to --modes" in capsys.readouterr().out


def test_a_sampled_sweep_draws_for_the_same_seeds_in_every_mode(servers):
    """--temperature > 0: each request carries the temperature, top-p and its prompt index as its
    seed, so a mode repeats its own answers; modes differ by design, so no identity is compared."""
    from tandem.bench.serve import run_sweep

    prompts = ["count: 1 2 3 1 2 3", "say hi", "abcabcabc", "one two one two"]
    sampling = {"temperature": 0.8, "top_p": 0.9}
    runs = [run_sweep({"off": servers["off"]}, "tiny", prompts, [2], requests_per_user=2, max_tokens=12,
                      sampling=sampling) for _ in range(2)]
    assert runs[0]["sampling"] == sampling and runs[0]["identity"] == {}
    assert runs[0]["levels"]["2"]["off"]["errors"] == 0
    texts = [[r.text for r in run_level_results(servers["off"], prompts, sampling)] for _ in range(2)]
    assert texts[0] == texts[1]  # the same seeds draw the same answers


def run_level_results(url, prompts, sampling):
    import asyncio

    from tandem.bench.serve import run_level

    return asyncio.run(run_level(url, "tiny", prompts, 2, len(prompts), 12, sampling))[1]


def test_a_mode_names_its_policy_and_may_name_its_drafter():
    from tandem.bench.serve import mode_flags

    assert mode_flags("off") == ["--speculative-algorithm", "none"]
    assert mode_flags("adaptive") == ["--speculative-policy", "adaptive"]
    assert mode_flags("confidence:dspark") == ["--speculative-policy", "confidence", "--speculative-algorithm", "dspark"]
    assert mode_flags("adaptive:suffix@corpus=0") == ["--speculative-policy", "adaptive", "--speculative-algorithm",
                                                      "suffix", "--no-speculative-corpus"]
    assert mode_flags("fixed:eagle3@lookup=1")[-1] == "--speculative-lookup"
    with pytest.raises(ValueError, match="bad option 'k=3'"):
        mode_flags("adaptive:suffix@k=3")
    with pytest.raises(ValueError, match="POLICY"):
        mode_flags("greedy:dspark")
    with pytest.raises(ValueError, match="unknown speculative algorithm 'bogus'"):
        mode_flags("fixed:bogus")


@pytest.mark.parametrize("argv, message", [
    (["bench", "soak", "--concurrency", "0"], "--concurrency: must be >= 1, got 0"),
    (["bench", "soak", "--requests", "0"], "--requests: must be >= 1"),
    (["bench", "soak", "--cancel-share", "1.5"], "--cancel-share: must be in [0, 1], got 1.5"),
    (["bench", "serve", "--concurrency", "0"], "--concurrency: must be >= 1"),
    (["bench", "serve", "--max-tokens", "0"], "--max-tokens: must be >= 1"),
    (["bench", "serve", "--temperature", "-1"], "--temperature: must be in [0, 2]"),
    (["bench", "serve", "--top-p", "5"], "--top-p: must be in (0, 1]"),
    (["bench", "serve", "--alternations", "0"], "--alternations: must be >= 1"),
    (["bench", "serve", "--modes", "fixed:bogus"], "--modes: invalid"),
    (["bench", "replicas", "--concurrency", "0"], "--concurrency: must be >= 1"),
    (["bench", "burst", "--burst", "0"], "--burst: must be >= 1"),
    (["bench", "burst", "--running", "-1"], "--running: must be >= 0"),
    (["bench", "agent", "--turns", "0"], "--turns: must be >= 1"),
    (["bench", "base", "--max-new-tokens", "0"], "--max-new-tokens: must be >= 1"),
    (["bench", "base", "--threads", "0"], "--threads: must be >= 1"),
    (["bench", "spec", "--threads", "0"], "--threads: must be >= 1"),
    (["serve", "--threads", "0"], "--threads: must be >= 1"),
    (["generate", "--prompt", "x", "--threads", "0"], "--threads: must be >= 1"),
    (["advise", "--threads", "0"], "--threads: must be >= 1"),
])
def test_bench_sizes_that_cannot_work_are_refused_while_parsing(argv, message, capsys):
    """Zero or negative sizes and shares out of range: refused before any server starts (they
    used to run, or pass, with nothing measured)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_bench_checks_that_need_more_than_one_flag_come_before_any_work(monkeypatch, capsys):
    import tandem.bench.base as base_module
    import tandem.bench.serve as serve_module

    def no_work(*args, **kwargs):
        raise AssertionError("the benchmark started")

    monkeypatch.setattr(serve_module, "bench_serve", no_work)
    assert main(["bench", "serve", "--top-p", "0.5"]) == 2  # greedy answers ignore it
    assert "--top-p filters sampling" in capsys.readouterr().err
    assert main(["bench", "serve", "--algorithm", "bogus"]) == 2
    assert "unknown speculative algorithm 'bogus'" in capsys.readouterr().err
    monkeypatch.setattr(base_module, "kernel_report", no_work)
    monkeypatch.setattr(base_module, "run_transformers", no_work)
    assert main(["bench", "base", "--configs", "bogus/none"]) == 2
    assert "--configs 'bogus/none'" in capsys.readouterr().err


def test_bench_serve_fails_when_requests_failed(monkeypatch, capsys):
    import tandem.bench.serve as serve_module

    report = {"levels": {"1": {"off": {"errors": 4}}}, "identity": {}}
    monkeypatch.setattr(serve_module, "bench_serve", lambda args: report)
    assert main(["bench", "serve", "--modes", "off"]) == 1
    assert "4 requests failed" in capsys.readouterr().err
    report["levels"]["1"]["off"]["errors"] = 0
    assert main(["bench", "serve", "--modes", "off"]) == 0


def test_a_server_interrupted_while_starting_is_stopped(monkeypatch, tmp_path):
    import subprocess
    import sys

    import httpx

    import tandem.bench.server_process as server_process

    started, popen = [], subprocess.Popen

    def sleeper(cmd, **kwargs):
        started.append(popen([sys.executable, "-c", "import time; time.sleep(60)"], **kwargs))
        return started[-1]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(server_process.subprocess, "Popen", sleeper)
    monkeypatch.setattr(httpx, "get", interrupted)
    with pytest.raises(KeyboardInterrupt):
        server_process.start_server("m", [], tmp_path / "server.log", "test")
    assert started[0].poll() is not None  # stopped, not left behind


def test_bench_burst_against_a_running_server(servers, tmp_path, capsys):
    from tandem.bench.results_doc import render

    out = tmp_path / "serve" / "bench_burst.json"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("count: 1 2 3\nsay hi\n")
    assert servers["off"].endswith("/v1")
    server = servers["off"].removesuffix("/v1")  # the address alone names the API as well
    argv = ["bench", "burst", "--model", "tiny", "--url", server, "--burst", "3", "--running", "1",
            "--prompts-file", str(prompts),
            "--unloaded-seconds", "0.2", "--max-tokens", "6", "--running-max-tokens", "40", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    (r,) = report["results"]
    assert r["burst"] == 3 and r["running"] == 1 and r["errors"] == 0
    assert 0 < r["ttft_p50_s"] <= r["ttft_max_s"] and r["burst_throughput"] > 0
    assert r["itl_unloaded_p50_ms"] > 0
    assert "TTFT p50" in capsys.readouterr().out
    assert "`tandem bench burst`" in render(tmp_path)


def test_an_agent_conversation_past_the_context_stops_with_its_reason(servers):
    """The tiny server's context (160 byte-tokens) holds the first turn but not the third: the
    answered turns are kept and the refusal is the reason the conversation stopped."""
    from tandem.bench.agent import converse

    turns, stopped = converse(servers["off"], "tiny", 3, 10, 4)
    assert 1 <= len(turns) < 3 and stopped.startswith(f"turn {len(turns) + 1}: HTTP 400")
    turns, stopped = converse(servers["off"], "tiny", 1, 5, 4)
    assert len(turns) == 1 and stopped is None


def test_burst_summary_arithmetic():
    from tandem.bench.burst import Stream, summarize as summarize_burst

    # One running stream: a token every 10 ms before the burst (t < 1), every 40 ms while its
    # prompts are prefilled (until the last first token at t = 1.4), every 20 ms after.
    pieces = [i * 0.01 for i in range(100)] + [1.0 + i * 0.04 for i in range(1, 11)] + [1.4 + i * 0.02 for i in range(1, 11)]
    long = [Stream(0.0, pieces)]
    burst = [Stream(1.0, [1.2, 1.25]), Stream(1.0, [1.4, 1.5])]
    r = summarize_burst("x", long, burst, start=1.0, end=1.6)
    assert r.ttft_p50_s == pytest.approx(0.4) and r.ttft_max_s == pytest.approx(0.4)
    assert r.itl_unloaded_p50_ms == pytest.approx(10, abs=0.01)
    assert r.itl_during_p50_ms == pytest.approx(40, abs=0.01) and r.itl_after_p50_ms == pytest.approx(20, abs=0.01)
    # A gap belongs to the window its second token lands in: 0.99 -> 1.04 is the burst's worst.
    assert r.itl_during_p99_ms == pytest.approx(50, abs=0.01) and r.itl_p99_over_after == pytest.approx(2.5, abs=0.01)
    assert r.burst_throughput == pytest.approx(4 / 0.6)  # without usage: one token an event
    # With each answer's usage, its tokens: a speculative round's tokens arrive in one event.
    burst = [Stream(1.0, [1.2, 1.25], tokens=6), Stream(1.0, [1.4, 1.5], tokens=9)]
    assert summarize_burst("x", long, burst, start=1.0, end=1.6).burst_throughput == pytest.approx(15 / 0.6)
    # Running streams that ended before the burst leave its windows empty, which the result names;
    # a failed request's reason is kept.
    r = summarize_burst("x", [Stream(0.0, [0.1, 0.2, 0.3])], [Stream(1.0, [1.2]), Stream(1.0, error="HTTP 404")],
                        start=1.0, end=1.6)
    assert r.empty_windows == ["during", "after"] and r.first_errors == ["HTTP 404"] and r.errors == 1
