"""`tandem bench replicas`: `tandem serve` throughput under different replica layouts (Ray Serve
replicas and kernel threads, or any other server flags), one server after another in one sitting.

Each flag string is launched in turn as `tandem serve FLAGS` (e.g. `--replicas 2 --threads 1`),
warmed up, swept over the concurrency levels with `tandem bench serve`'s client (streamed greedy
chat requests, the same prompts for every server), and stopped before the next starts, so no two
servers share the cores. The report gives each server's throughput, per-user speed, TTFT and
tau per level, its throughput over the first server's, and whether every server gave the first
one's answers (greedy: replicas and threads must not change them).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import asdict
from pathlib import Path

from tandem.bench.prompts import spread_prompts
from tandem.bench.serve import SPEEDUP_DEFINITION, WARMUP_PROMPT, run_level, summarize
from tandem.bench.server_process import start_with_flags, stop_server, write_report
from tandem.bench.spec import machine_info
from tandem.bench.steal import StealMeter
from tandem.flags import at_least
from tandem.model.catalogue import DEFAULT_MODEL

# The in-process server first (the reference), then Ray Serve layouts of a 2-core machine.
DEFAULT_LAYOUTS = ["--threads 1", "--replicas 1 --threads 2", "--replicas 1 --threads 1", "--replicas 2 --threads 1"]


def bench_replicas(args) -> dict:
    steal = StealMeter()
    prompts = [p.text for p in spread_prompts(10**6)[: args.num_prompts]]
    sizes = [max(4, c * args.requests_per_user) for c in args.concurrency]
    levels: dict[str, dict[str, dict]] = {}
    texts: dict[str, dict[tuple[int, int], str]] = {}
    load_before: dict[str, list[float]] = {}
    for i, flags in enumerate(args.server_flags):
        load_before[flags] = [round(x, 2) for x in os.getloadavg()]
        print(f"starting `tandem serve {flags}` (load average {load_before[flags]}) ...", flush=True)
        proc, url = start_with_flags(flags, args.model, Path(args.log_dir) / f"server-replicas-{i}.log")
        levels[flags], texts[flags] = {}, {}
        try:
            asyncio.run(run_level(url, args.model, [WARMUP_PROMPT], 1, 1, 8))  # first-request costs off the clock
            offset = 0
            for c, n in zip(args.concurrency, sizes):
                level_prompts = [prompts[(offset + j) % len(prompts)] for j in range(n)]
                offset += n
                wall, results = asyncio.run(run_level(url, args.model, level_prompts, c, n, args.max_tokens))
                levels[flags][str(c)] = asdict(summarize(flags, c, wall, results))
                texts[flags].update({(c, r.prompt_index): r.text for r in results if r.error is None})
                print(f"  {c:>3} users: {levels[flags][str(c)]['throughput']:.1f} tok/s", flush=True)
        finally:
            stop_server(proc)
    first = args.server_flags[0]
    for flags, per in levels.items():
        for c, level in per.items():
            base = levels[first][c]["throughput"]
            level["speedup"] = level["throughput"] / base if base else None
    identity = {flags: {"compared": len(set(t) & set(texts[first])),
                        "mismatches": sum(1 for k, v in t.items() if k in texts[first] and texts[first][k] != v)}
                for flags, t in texts.items()}
    report = {"bench": "replicas", "model": args.model, "servers": args.server_flags,
              "concurrency": args.concurrency, "requests_per_user": args.requests_per_user,
              "max_tokens": args.max_tokens, "num_prompts": args.num_prompts, "definitions": SPEEDUP_DEFINITION,
              "levels": levels, "identity": identity, "load_before": load_before,
              "machine": {**machine_info(steal), "torch_threads": None}}  # threads: each server's own flags
    print_table(report)
    write_report(report, args.out)
    return report


def print_table(report: dict) -> None:
    width = max(len(s) for s in report["servers"])
    head = (f"{'server flags':{width}} {'users':>5} {'tok/s':>8} {'x first':>7} {'user tok/s':>10} {'TTFT p50':>9} "
            f"{'tau':>5} {'err':>3}")
    print(f"{report['model']}; {report['machine'].get('cpu', '')}, {report['machine'].get('cores')} cores")
    print(head)
    print("-" * len(head))
    for flags, per in report["levels"].items():
        for c, r in per.items():
            print(f"{flags:{width}} {c:>5} {r['throughput']:8.1f} {r['speedup'] or 0:6.2f}x {r['per_user_tps']:10.1f} "
                  f"{r['ttft_p50_ms']:7.0f}ms {r['tau']:5.2f} {r['errors']:3d}")
    for flags, ident in report["identity"].items():
        print(f"{flags}: {ident['mismatches']} of {ident['compared']} answers differ from the first server's")


def add_replicas_bench_parser(kinds) -> None:
    p = kinds.add_parser("replicas", help="throughput of replica layouts (Ray Serve replicas x threads), one "
                                          "after another")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--server-flags", nargs="+", default=DEFAULT_LAYOUTS,
                   help="one `tandem serve` flag string per server, launched in turn (the first is the reference)")
    p.add_argument("--concurrency", type=at_least(1), nargs="+", default=[1, 4, 16])
    p.add_argument("--requests-per-user", type=at_least(1), default=2)
    p.add_argument("--num-prompts", type=at_least(1), default=80, help="Spec-Bench prompts, round-robin over subtasks")
    p.add_argument("--max-tokens", type=at_least(1), default=128)
    p.add_argument("--out", default="results/serve/bench_ray.json")
    p.add_argument("--log-dir", default="results/tmp", help="where the servers' logs go (scratch)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    report = bench_replicas(args)
    errors = sum(r["errors"] for per in report["levels"].values() for r in per.values())
    mismatches = sum(v["mismatches"] for v in report["identity"].values())
    return 1 if errors or mismatches else 0
