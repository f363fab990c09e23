"""`tandem bench burst`: what a burst of new requests does to a server, and to the requests it is
already running.

Per server configuration (each launched in turn as `tandem serve FLAGS`, default: no flags at
all, or given with --url): a few long streams start first and run alone for a while (their
unloaded inter-token latency), then a burst of simultaneous streamed chat requests arrives. The
report gives the burst's TTFT (p50, max), its throughput (completion tokens, from each answer's
usage), and the running streams' inter-token latency before the burst, while its prompts are
prefilled, and after (the same batch, all decoding), plus the server's resident memory at start
and end when it was launched here.

Inter-token latency is the gap between a stream's events, as a streaming client sees it (and as
vLLM's benchmark counts it): a speculative round's accepted tokens arrive in one event, so where
the server drafts, an event holds several tokens and its gap is a round's.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem.bench.prompts import load_prompt_file
from tandem.bench.server_process import (
    api_base,
    chat_events,
    event_text,
    resident_mb,
    start_with_flags,
    stop_server,
    write_report,
)
from tandem.bench.spec import machine_info
from tandem.bench.steal import StealMeter
from tandem.flags import at_least, number_in
from tandem.model.catalogue import DEFAULT_MODEL

QUESTIONS = Path(__file__).resolve().parents[1] / "data" / "mt_bench_question.jsonl"
RUNNING_PROMPT = "Write a long story about a lighthouse keeper and a storm, in many chapters."


@dataclass
class Stream:
    """One streamed request: when it was sent and when each text piece arrived."""

    sent: float
    pieces: list[float] = field(default_factory=list)
    error: str | None = None
    tokens: int | None = None  # completion tokens, from the final usage chunk (None: cut off before it)

    def gaps_between(self, start: float, end: float) -> list[float]:
        return [b - a for a, b in zip(self.pieces, self.pieces[1:]) if start <= b < end]


@dataclass
class BurstResult:
    server: str
    burst: int
    running: int
    ttft_p50_s: float
    ttft_max_s: float
    burst_throughput: float  # completion tokens per second, first burst request to last answer
    itl_unloaded_p50_ms: float
    itl_during_p50_ms: float
    itl_during_p99_ms: float
    itl_after_p50_ms: float
    itl_p99_over_unloaded: float
    itl_p99_over_after: float
    errors: int
    rss_start_mb: float | None = None
    rss_end_mb: float | None = None
    first_errors: list[str] = field(default_factory=list)
    empty_windows: list[str] = field(default_factory=list)  # windows without a gap: their figures read 0


async def _stream(http, url: str, model: str, prompt: str, max_tokens: int, out: Stream) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    try:
        async for event in chat_events(http, url, body):
            if event_text(event):
                out.pieces.append(time.perf_counter())
            if event.get("usage"):
                out.tokens = event["usage"]["completion_tokens"]
    except Exception as err:  # reported in the table, not a crashed benchmark
        out.error = repr(err)


async def run_burst(url: str, model: str, prompts: list[str], running: int, unloaded_s: float,
                    max_tokens: int, running_max_tokens: int = 1000) -> tuple[list[Stream], list[Stream], float, float]:
    """-> (running streams, burst streams, burst start, burst end). The running streams are asked
    for enough tokens to outlast the burst and are cancelled after it."""
    import httpx  # lazy: only the benchmark's client needs it

    limits = httpx.Limits(max_connections=running + len(prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as http:
        long = [Stream(time.perf_counter()) for _ in range(running)]
        long_tasks = [asyncio.create_task(_stream(http, url, model, RUNNING_PROMPT, running_max_tokens, s)) for s in long]
        while any(len(s.pieces) < 2 and s.error is None for s in long):
            await asyncio.sleep(0.05)
        await asyncio.sleep(unloaded_s)
        start = time.perf_counter()
        burst = [Stream(start) for _ in prompts]
        await asyncio.gather(*(_stream(http, url, model, p, max_tokens, s) for p, s in zip(prompts, burst)))
        end = time.perf_counter()
        for t in long_tasks:
            t.cancel()
        await asyncio.gather(*long_tasks, return_exceptions=True)
    return long, burst, start, end


def summarize(server: str, long: list[Stream], burst: list[Stream], start: float, end: float) -> BurstResult:
    ok = [s for s in burst if s.error is None and s.pieces]
    ttfts = sorted(s.pieces[0] - s.sent for s in ok) or [0.0]
    prefilled = max((s.pieces[0] for s in ok), default=end)  # the last burst prompt's first token

    empty = []

    def gaps(a: float, b: float, window: str) -> list[float]:
        found = sorted(g for s in long for g in s.gaps_between(a, b))
        if not found:
            empty.append(window)
        return found or [0.0]

    def pct(xs: list[float], q: float) -> float:
        return 1000 * xs[min(len(xs) - 1, int(q * len(xs)))]

    before = gaps(0.0, start, "before")
    during = gaps(start, prefilled, "during")
    after = gaps(prefilled, end, "after")
    errors = [s.error for s in burst if s.error] + [s.error for s in long if s.error and "Cancelled" not in s.error]
    return BurstResult(
        server=server, burst=len(burst), running=len(long), ttft_p50_s=ttfts[len(ttfts) // 2], ttft_max_s=ttfts[-1],
        burst_throughput=sum(s.tokens or len(s.pieces) for s in ok) / (end - start),
        itl_unloaded_p50_ms=pct(before, 0.5), itl_during_p50_ms=pct(during, 0.5), itl_during_p99_ms=pct(during, 0.99),
        itl_after_p50_ms=pct(after, 0.5), itl_p99_over_unloaded=pct(during, 0.99) / max(pct(before, 0.5), 1e-9),
        itl_p99_over_after=pct(during, 0.99) / max(pct(after, 0.5), 1e-9),
        errors=len(burst) - len(ok) + sum(1 for s in long if s.error and "Cancelled" not in s.error),
        first_errors=errors[:3], empty_windows=empty,
    )


def bench_burst(args) -> dict:
    steal = StealMeter()
    if args.prompts_file:
        questions = [p.text for p in load_prompt_file(args.prompts_file, args.burst)]
    else:
        questions = [json.loads(line)["turns"][0] for line in QUESTIONS.read_text().splitlines() if line.strip()]
    prompts = [questions[i % len(questions)] for i in range(args.burst)]
    servers = [("url " + u, u) for u in args.url] or [(f or "default", f) for f in args.server_flags]
    results = []
    for label, target in servers:
        proc = None
        if target.startswith("http"):
            url = api_base(target)
        else:
            print(f"starting `tandem serve {target}` ...", flush=True)
            proc, url = start_with_flags(target, args.model, Path(args.out).parent / f"server-{len(results)}.log")
        try:
            asyncio.run(run_burst(url, args.model, ["Say hello."], 0, 0.0, 8))  # warm-up, off the clock
            rss_start = resident_mb(proc.pid) if proc else None
            long, burst, start, end = asyncio.run(run_burst(url, args.model, prompts, args.running,
                                                            args.unloaded_seconds, args.max_tokens,
                                                            args.running_max_tokens))
            result = summarize(label, long, burst, start, end)
            result.rss_start_mb, result.rss_end_mb = rss_start, resident_mb(proc.pid) if proc else None
            results.append(result)
        finally:
            if proc is not None:
                stop_server(proc)
    report = {"model": args.model, "burst": args.burst, "running": args.running, "max_tokens": args.max_tokens,
              "machine": machine_info(steal), "results": [asdict(r) for r in results]}
    print_table(report)
    write_report(report, args.out)
    return report


def print_table(report: dict) -> None:
    print(f"{report['burst']} simultaneous streamed requests of {report['max_tokens']} tokens, "
          f"{report['running']} long streams already running; {report['machine'].get('cpu', '')}")
    head = (f"{'server':34} {'TTFT p50':>8} {'max':>6} {'tok/s':>6} {'ITL before':>10} {'during p50':>10} "
            f"{'p99':>7} {'after':>7} {'p99/before':>10} {'p99/after':>9} {'RSS MB':>11} {'err':>3}")
    print(head)
    print("-" * len(head))
    for r in report["results"]:
        rss = f"{r['rss_start_mb']:.0f}/{r['rss_end_mb']:.0f}" if r["rss_start_mb"] else "-"
        print(f"{r['server'][:34]:34} {r['ttft_p50_s']:7.2f}s {r['ttft_max_s']:5.2f}s {r['burst_throughput']:6.0f} "
              f"{r['itl_unloaded_p50_ms']:8.1f}ms {r['itl_during_p50_ms']:8.1f}ms {r['itl_during_p99_ms']:5.0f}ms "
              f"{r['itl_after_p50_ms']:5.1f}ms {r['itl_p99_over_unloaded']:9.1f}x {r['itl_p99_over_after']:8.1f}x "
              f"{rss:>11} {r['errors']:3d}")
        if r.get("empty_windows"):
            print(f"  no running stream had a gap {' or '.join(r['empty_windows'])} the burst (they had finished: "
                  "raise --running-max-tokens); those figures read 0")
        for err in r.get("first_errors") or ():
            print(f"  error: {err}")


def add_burst_bench_parser(kinds) -> None:
    p = kinds.add_parser("burst", help="a burst of simultaneous requests: TTFT, and the stall of running requests")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--server-flags", nargs="+", default=[""],
                   help="one `tandem serve` flag string per server to launch in turn ('' = the defaults), e.g. "
                        "'' '--max-running-requests 8 --chunked-prefill-size 0'")
    p.add_argument("--url", action="append", default=[],
                   help="an already running server instead (repeatable; http://host:port, with or without /v1)")
    p.add_argument("--burst", type=at_least(1), default=32, help="simultaneous new requests (MT-Bench questions)")
    p.add_argument("--prompts-file", default=None, help="the burst's prompts (.jsonl or one per line; default MT-Bench)")
    p.add_argument("--running", type=at_least(0), default=4, help="long streams running before the burst")
    p.add_argument("--unloaded-seconds", type=number_in(0, 3600), default=2.0, help="how long they run alone first")
    p.add_argument("--max-tokens", type=at_least(1), default=64)
    p.add_argument("--running-max-tokens", type=at_least(1), default=1000, help="what the running streams ask for")
    p.add_argument("--out", default="results/serve/bench_burst.json")
    p.set_defaults(func=_run)


def _run(args) -> int:
    report = bench_burst(args)
    return 1 if any(r["errors"] for r in report["results"]) else 0
