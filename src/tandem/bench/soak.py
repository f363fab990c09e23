"""`tandem bench soak`: many requests of mixed length and sampling settings, some cancelled
mid-stream, against one `tandem serve` launched here; then SIGTERM while requests are in flight.

Checks, each reported as passed or failed (exit 1 if any failed): no errors but the cancellations;
the server's resident memory grows at most 5% from the 100th request to the last; nothing is left
running or reserved in the KV cache afterwards (`/metrics`); and on SIGTERM the requests in flight
finish (drained, not cut) and the server exits 0. Loopback only, bounded in time.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import time
from contextlib import aclosing
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem.bench.burst import QUESTIONS
from tandem.bench.server_process import (
    ServerError,
    chat_events,
    resident_mb,
    start_with_flags,
)
from tandem.bench.spec import machine_info
from tandem.bench.steal import StealMeter
from tandem.flags import at_least, number_in
from tandem.model.catalogue import DEFAULT_MODEL
from tandem.progress import progress

RSS_GROWTH_LIMIT = 0.05


@dataclass
class SoakReport:
    requests: int
    cancelled: int
    errors: list[str] = field(default_factory=list)
    rss_at_100_mb: float | None = None
    rss_at_end_mb: float | None = None
    running_after: float | None = None
    reserved_after: float | None = None
    drained: int = 0
    drain_in_flight: int = 0
    exit_code: int | None = None
    seconds: float = 0.0
    checks: dict[str, bool | None] = field(default_factory=dict)  # None: skipped (the run was too short)


def _settings(rng: random.Random) -> dict:
    """One request's mixed settings: length, greedy or sampled, nucleus, seed, stop strings."""
    body = {"max_tokens": rng.choice([4, 16, 32, 64, 128]), "temperature": rng.choice([0.0, 0.7, 1.0])}
    if rng.random() < 0.3:
        body["top_p"] = rng.choice([0.8, 0.95])
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(1 << 30)
    if rng.random() < 0.1:
        body["stop"] = ["\n\n"]
    return body


async def _request(http, url: str, model: str, prompt: str, body: dict, cancel_after: int | None) -> str | None:
    """One streamed chat request -> None, "cancelled", or an error message."""
    payload = {"model": model, "messages": [{"role": "user", "content": prompt}], **body}
    try:
        async with aclosing(chat_events(http, url, payload)) as events:
            pieces = 0
            async for event in events:
                if "error" in event:
                    return json.dumps(event)[:200]
                pieces += 1
                if cancel_after is not None and pieces >= cancel_after:
                    return "cancelled"  # leaving the block closes the connection mid-stream
        return "cancelled" if cancel_after is not None else None
    except Exception as err:  # counted as an error in the report
        return repr(err)


async def _soak(url: str, model: str, prompts: list[str], n: int, concurrency: int, cancel_share: float,
                seed: int, pid: int | None, report: SoakReport) -> None:
    import httpx  # lazy: only the benchmark's client needs it

    rng = random.Random(seed)
    jobs = [(prompts[i % len(prompts)], _settings(rng), rng.randint(1, 6) if rng.random() < cancel_share else None)
            for i in range(n)]
    done = 0
    bar = progress(total=n, desc="soak", unit="req")
    queue = list(range(n))

    async def user(http):
        nonlocal done
        while queue:
            prompt, body, cancel_after = jobs[queue.pop(0)]
            outcome = await _request(http, url, model, prompt, body, cancel_after)
            if outcome == "cancelled":
                report.cancelled += 1
            elif outcome is not None:
                report.errors.append(outcome)
            done += 1
            bar.update()
            if done == 100 and pid is not None:
                report.rss_at_100_mb = resident_mb(pid)

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=concurrency + 4)) as http:
        await asyncio.gather(*(user(http) for _ in range(concurrency)))
    bar.close()
    report.requests = n


def _gauge(text: str, name: str) -> float | None:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


async def _drain_on_sigterm(url: str, model: str, prompts: list[str], proc, in_flight: int) -> tuple[int, int]:
    """Start `in_flight` requests, SIGTERM the server once all have their first token, and count
    how many still finish with their full answer."""
    import httpx  # lazy: only the benchmark's client needs it

    started = asyncio.Event()
    first = 0

    async def one(http, prompt):
        nonlocal first
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 48,
                "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
        seen_first, usage = False, {}
        try:
            async for event in chat_events(http, url, body):
                if not seen_first:
                    seen_first, first = True, first + 1
                    if first == in_flight:
                        started.set()
                usage = event.get("usage") or usage
        except (httpx.HTTPError, ServerError):
            return False
        return usage.get("completion_tokens") == 48

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as http:
        tasks = [asyncio.create_task(one(http, p)) for p in prompts[:in_flight]]
        await asyncio.wait_for(started.wait(), 300)
        proc.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*tasks)
    return sum(results), in_flight


def bench_soak(args) -> SoakReport:
    import httpx  # lazy: only the benchmark's client needs it

    prompts = [json.loads(line)["turns"][0] for line in QUESTIONS.read_text().splitlines() if line.strip()]
    report = SoakReport(requests=0, cancelled=0)
    steal = StealMeter()
    t0 = time.perf_counter()
    log_dir = Path(args.out).parent
    proc, url = start_with_flags(args.server_flags, args.model, log_dir / "server-soak.log")
    try:
        asyncio.run(_soak(url, args.model, prompts, args.requests, args.concurrency, args.cancel_share, args.seed,
                          proc.pid, report))
        time.sleep(1.0)  # aborted requests leave at the engine's next step
        report.rss_at_end_mb = resident_mb(proc.pid)
        metrics = httpx.get(f"{url.removesuffix('/v1')}/metrics").text
        report.running_after = _gauge(metrics, "tandem:num_requests_running")
        report.reserved_after = _gauge(metrics, "tandem:kv_cache_reserved_perc")
        report.drained, report.drain_in_flight = asyncio.run(_drain_on_sigterm(url, args.model, prompts, proc,
                                                                               args.drain_requests))
        report.exit_code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    report.seconds = time.perf_counter() - t0
    growth = (report.rss_at_end_mb / report.rss_at_100_mb - 1) if report.rss_at_100_mb and report.rss_at_end_mb else None
    report.checks = {
        "no errors but cancellations": not report.errors,
        f"RSS growth from request 100 to the end <= {RSS_GROWTH_LIMIT:.0%}": None if growth is None
        else growth <= RSS_GROWTH_LIMIT,
        "nothing left running or reserved": report.running_after == 0 and report.reserved_after == 0,
        "SIGTERM drains the requests in flight": report.drained == report.drain_in_flight,
        "the server exits 0 after SIGTERM": report.exit_code == 0,
    }
    _print(report, growth)
    if args.out:
        log_dir.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"model": args.model, "server_flags": args.server_flags,
                                              "concurrency": args.concurrency, "cancel_share": args.cancel_share,
                                              "machine": machine_info(steal), "soak": asdict(report)}, indent=2))
        print(f"wrote {args.out}")
    return report


def _print(r: SoakReport, growth: float | None) -> None:
    print(f"{r.requests} requests ({r.cancelled} cancelled mid-stream), {len(r.errors)} errors, {r.seconds:.0f} s")
    if r.errors:
        print("  first errors: " + "; ".join(r.errors[:3]))
    if growth is not None:
        print(f"RSS {r.rss_at_100_mb:.0f} MB after request 100, {r.rss_at_end_mb:.0f} MB at the end ({growth:+.1%})")
    print(f"after the soak: running {r.running_after}, KV reserved {r.reserved_after}; "
          f"SIGTERM with {r.drain_in_flight} in flight: {r.drained} finished, exit code {r.exit_code}")
    for name, ok in r.checks.items():
        mark = "skip" if ok is None else "pass" if ok else "FAIL"
        print(f"  [{mark}] {name}" + (" (fewer than 100 requests ran)" if ok is None else ""))


def add_soak_bench_parser(kinds) -> None:
    p = kinds.add_parser("soak", help="many mixed requests, some cancelled, then SIGTERM: errors, memory, leaks, drain")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--server-flags", default="", help="`tandem serve` flags")
    p.add_argument("--requests", type=at_least(1), default=1000)
    p.add_argument("--concurrency", type=at_least(1), default=16)
    p.add_argument("--cancel-share", type=number_in(0, 1), default=0.1, help="share of requests cancelled mid-stream")
    p.add_argument("--drain-requests", type=at_least(0), default=4, help="requests in flight when SIGTERM arrives")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/serve/bench_soak.json")
    p.set_defaults(func=_run)


def _run(args) -> int:
    return 0 if all(ok is not False for ok in bench_soak(args).checks.values()) else 1
