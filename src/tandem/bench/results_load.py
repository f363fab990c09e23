"""The results page's sections for `tandem bench burst` (a burst of simultaneous requests against
servers with different flags), `tandem bench agent` (an agent loop, prefix cache on and off),
guidellm, `tandem bench soak` and `tandem bench replicas` (replica layouts on Ray Serve)."""

from __future__ import annotations

from tandem.bench.results_format import bash_block, num, shell_line, table, times
from tandem.bench.results_page import KINDS, Page, machine_line, model_flags


def burst_section(page: Page, rel: str, data: dict) -> list[str]:
    results = data["results"]
    words = ["tandem", "bench", "burst", *model_flags(data), "--server-flags",
             *[r["server"] if r["server"] != "default" else "" for r in results],
             "--burst", str(data.get("burst")), "--running", str(data.get("running")),
             "--max-tokens", str(data.get("max_tokens")), "--out", page.shown(rel)]
    lines = [f"`{KINDS['bench_burst']}`: {data.get('burst')} simultaneous streamed chat requests of "
             f"{data.get('max_tokens')} tokens arrive while {data.get('running')} long streams run; "
             f"{data.get('model')}, one `tandem serve` per row.", ""]
    lines += bash_block([shell_line(words)])
    lines += ["", machine_line(rel, data.get("machine")), ""]
    rows = [[f"`{r['server']}`", num(r["ttft_p50_s"]), num(r["ttft_max_s"]), num(r["burst_throughput"], 0),
             num(r["itl_unloaded_p50_ms"], 1), num(r["itl_during_p50_ms"], 1), num(r["itl_during_p99_ms"], 0),
             num(r["itl_after_p50_ms"], 1), times(r["itl_p99_over_after"]),
             num(r["rss_start_mb"], 0) if r.get("rss_start_mb") else "-", r["errors"]] for r in results]
    lines += table(["server flags", "TTFT p50 s", "TTFT max s", "tok/s", "running ITL before ms",
                    "during p50 ms", "during p99 ms", "after p50 ms", "p99 / after", "RSS at start MB", "errors"], rows)
    return lines


def agent_section(page: Page, rel: str, data: dict) -> list[str]:
    on, off = data["runs"]["cache on"], data["runs"]["cache off"]
    words = ["tandem", "bench", "agent", *model_flags(data), "--turns", str(data.get("turns")),
             "--tool-chars", str(data.get("tool_chars")), "--max-tokens", str(data.get("max_tokens"))]
    if data.get("server_flags"):
        words += ["--server-flags", data["server_flags"]]
    lines = [f"`{KINDS['bench_agent']}`: a {data.get('turns')}-turn agent conversation, each turn re-sending "
             f"the transcript plus a tool output; {data.get('model')}, prefix cache on and off.", ""]
    lines += bash_block([shell_line(words + ["--out", page.shown(rel)])])
    lines += ["", machine_line(rel, data.get("machine")), ""]
    rows = [[a["turn"], a["prompt_tokens"], num(a["ttft_s"], 3), num(b["ttft_s"], 3), times(b["ttft_s"] / a["ttft_s"])]
            for a, b in zip(on["turns"], off["turns"])]
    lines += table(["turn", "prompt tokens", "TTFT cache on s", "TTFT cache off s", "off / on"], rows)
    same = sum(a["answer"] == b["answer"] for a, b in zip(on["turns"], off["turns"]))
    lines += ["", f"Prompt tokens reused: {on['prefix_hit_tokens']:.0f} of {on['prefix_queried_tokens']:.0f}; "
                  f"the same answers with and without the cache in {same}/{len(on['turns'])} turns."]
    return lines


def guidellm_section(page: Page, rel: str, data: dict) -> list[str]:
    env = f"SERVER_FLAGS={data['server_flags']!r} " if data.get("server_flags") else ""
    lines = [f"`{KINDS['guidellm']}`: guidellm (PyPI) against `tandem serve`, synthetic prompts, one level per "
             f"concurrency; {data.get('model')}.", ""]
    lines += bash_block([f"{env}bash scripts/guidellm_bench.sh"])
    lines += ["", machine_line(rel, data.get("machine")), ""]
    rows = [[lv["concurrency"], lv["requests"], lv["errored"], num(lv["output_tokens_per_second"], 1),
             num(lv["ttft_p50_ms"], 0), num(lv["ttft_p95_ms"], 0), num(lv["itl_p50_ms"], 1), num(lv["itl_p95_ms"], 1)]
            for lv in data["levels"]]
    return lines + table(["concurrency", "requests", "errored", "output tok/s", "TTFT p50 ms", "TTFT p95 ms",
                          "ITL p50 ms", "ITL p95 ms"], rows)


def soak_section(page: Page, rel: str, data: dict) -> list[str]:
    r = data["soak"]
    words = ["tandem", "bench", "soak", *model_flags(data), "--requests", str(r["requests"]),
             "--concurrency", str(data.get("concurrency")), "--cancel-share", str(data.get("cancel_share"))]
    if data.get("server_flags"):
        words += ["--server-flags", data["server_flags"]]
    lines = [f"`{KINDS['bench_soak']}`: {r['requests']} requests of mixed length and sampling settings, "
             f"{r['cancelled']} cancelled mid-stream, then SIGTERM with {r['drain_in_flight']} in flight; "
             f"{data.get('model')}.", ""]
    lines += bash_block([shell_line(words + ["--out", page.shown(rel)])])
    lines += ["", machine_line(rel, data.get("machine")), ""]
    lines += table(["check", "result"], [[name, "pass" if ok else "FAIL"] for name, ok in r["checks"].items()])
    lines += ["", f"Errors {len(r['errors'])}; RSS {num(r['rss_at_100_mb'], 0)} MB after request 100, "
                  f"{num(r['rss_at_end_mb'], 0)} MB at the end; {r['drained']} of {r['drain_in_flight']} requests "
                  f"in flight finished after SIGTERM, exit code {r['exit_code']}; {num(r['seconds'], 0)} s in all."]
    return lines


def replicas_section(page: Page, rel: str, data: dict) -> list[str]:
    servers = data["servers"]
    words = ["tandem", "bench", "replicas", *model_flags(data), "--server-flags", *servers,
             "--concurrency", *[str(c) for c in data.get("concurrency") or []],
             "--requests-per-user", str(data.get("requests_per_user")), "--num-prompts", str(data.get("num_prompts")),
             "--max-tokens", str(data.get("max_tokens")), "--out", page.shown(rel)]
    lines = [f"`{KINDS['bench_replicas']}`: `tandem serve` with each flag string in turn, one server at a time; "
             f"greedy streamed chat requests of up to {data.get('max_tokens')} tokens, {data.get('num_prompts')} "
             f"Spec-Bench prompts; {data.get('model')}, its default drafter.", ""]
    lines += bash_block([shell_line(words)])
    lines += ["", machine_line(rel, data.get("machine")), ""]
    rows = []
    for flags in servers:
        for level, r in data["levels"][flags].items():
            rows.append([f"`{flags}`", level, num(r["throughput"], 1), times(r.get("speedup")),
                         num(r["per_user_tps"], 1), num(r["ttft_p50_ms"] / 1000, 2), num(r["tau"]), r["errors"]])
    lines += table(["server flags", "users", "tok/s", "x first", "user tok/s", "TTFT p50 s", "tau", "errors"], rows)
    identity = data.get("identity") or {}
    load = data.get("load_before") or {}
    lines += ["", "Same answers as the first server (greedy): " + ", ".join(
        f"`{flags}` {v['compared'] - v['mismatches']}/{v['compared']}" for flags, v in identity.items()) + "."]
    if load:
        lines += ["", "Load average (1, 5, 15 min) as each server started: " + "; ".join(
            f"`{flags}` {' / '.join(num(x) for x in avg)}" for flags, avg in load.items()) + "."]
    return lines
