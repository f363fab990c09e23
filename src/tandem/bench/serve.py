"""`tandem bench serve`: a concurrency sweep against the OpenAI server, speculation adaptive /
fixed / off side by side, in one run.

Each mode is its own server (launched here, one after another so a startup profile is not
measured under another's load, or given with --url MODE=URL). At each concurrency the modes run
in turn on the same prompts, so drift on a shared machine hits them alike. `concurrency` users
each send streamed, greedy chat requests back to back; the report gives throughput, per-user
decode speed, TTFT, inter-token latency and acceptance per mode, the ratios to `off`, and whether
every mode produced the same text (greedy speculation is lossless).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem.bench.plots import stamp_machine
from tandem.bench.prompts import SPEC_BENCH_SUBTASKS, load_prompt_file, spread_prompts
from tandem.bench.server_process import (
    ServerError,
    api_base,
    chat_events,
    event_text,
    start_server,
    stop_server,
)
from tandem.bench.spec import machine_info
from tandem.bench.steal import StealMeter, steal_notice
from tandem.drafters import check_algorithm_name
from tandem.flags import at_least, number_in
from tandem.launch_server import SERVE_MAX_RUNNING_REQUESTS
from tandem.model.catalogue import DEFAULT_MODEL
from tandem.progress import progress

MODES = ("adaptive", "fixed", "off")
POLICY_MODES = ("adaptive", "fixed", "confidence")
WARMUP_PROMPT = "Say hello."


# On/off settings a mode may add after `@`, each the server's --[no-]speculative-NAME flag.
MODE_OPTIONS = ("corpus", "lookup")


def mode_flags(mode: str) -> list[str]:
    """A mode is `off`, or a speculation policy with an optional drafter of its own,
    POLICY[:ALGORITHM] (`adaptive`, `confidence:dspark`, `fixed:dspark`, `adaptive:eagle3`);
    without one it serves --algorithm. `@corpus=0` or `@lookup=0` after it turns that setting off
    (`adaptive:suffix@corpus=0`). Returns the server flags it adds."""
    if mode == "off":
        return ["--speculative-algorithm", "none"]
    base, *options = mode.split("@")
    policy, _, algorithm = base.partition(":")
    if policy not in POLICY_MODES:
        raise ValueError(f"a mode is off or POLICY[:ALGORITHM][@OPTION=0|1] with POLICY in {POLICY_MODES}, "
                         f"got {mode!r}")
    if algorithm:
        check_algorithm_name(algorithm)
    flags = ["--speculative-policy", policy] + (["--speculative-algorithm", algorithm] if algorithm else [])
    for option in options:
        key, _, value = option.partition("=")
        if key not in MODE_OPTIONS or value not in ("0", "1"):
            raise ValueError(f"bad option {option!r} in mode {mode!r}; use @OPTION=0|1 with OPTION in {MODE_OPTIONS}")
        flags.append(f"--{'' if value == '1' else 'no-'}speculative-{key}")
    return flags


def checked_mode(mode: str) -> str:
    """argparse type of --modes and --url: the mode itself, once mode_flags accepts it."""
    mode_flags(mode)
    return mode
SPEEDUP_DEFINITION = (
    "throughput = completion tokens of all requests at a concurrency / wall seconds from the first request "
    "to the last answer; per-user tok/s = mean over requests of (tokens - 1) / (last token time - first token "
    "time), the streaming speed a user sees; ITL = its inverse; speedups divide by the 'off' mode at the same "
    "concurrency; acceptance and tau (tokens per target forward, bonus included) from each response's spec field; "
    "k (verify_length) = draft tokens verified per target forward, the length the policy chose"
)


@dataclass
class RequestResult:
    prompt_index: int
    ttft: float
    e2e: float
    completion_tokens: int
    text: str
    spec: dict = field(default_factory=dict)
    error: str | None = None


@dataclass
class LevelResult:
    mode: str
    concurrency: int
    num_requests: int
    wall_seconds: float
    throughput: float
    per_user_tps: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    itl_ms: float
    acceptance_rate: float
    tau: float
    errors: int
    verify_length: float = 0.0  # draft tokens verified per target forward (what the policy chose)
    speedup: float | None = None
    per_user_speedup: float | None = None


# ---- the client ------------------------------------------------------------------------------


async def _one_request(http, url: str, model: str, prompt: str, index: int, max_tokens: int,
                       sampling: dict | None = None) -> RequestResult:
    """One streamed chat request; greedy, or with `sampling`'s fields (temperature, top_p) and a
    seed per prompt, so every mode draws for the same seeds."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream_options": {"include_usage": True}}
    if sampling:
        body.update(sampling, seed=index)
    t0 = time.perf_counter()
    ttft, last, text, usage, spec = None, None, "", {}, {}
    try:
        async for event in chat_events(http, url, body):
            if "error" in event:
                return RequestResult(index, 0.0, 0.0, 0, text, error=event["error"]["message"])
            piece = event_text(event)
            if piece:
                now = time.perf_counter()
                ttft = now - t0 if ttft is None else ttft
                last = now
                text += piece
            usage = event.get("usage") or usage
            spec = event.get("spec") or spec
    except ServerError as err:
        return RequestResult(index, 0.0, 0.0, 0, "", error=str(err))
    except Exception as err:  # a failed request is reported in the table, not a crashed sweep
        return RequestResult(index, 0.0, 0.0, 0, text, error=repr(err))
    end = time.perf_counter()
    return RequestResult(index, ttft or end - t0, (last or end) - t0, usage.get("completion_tokens", 0), text, spec)


async def run_level(url: str, model: str, prompts: list[str], concurrency: int, num_requests: int,
                    max_tokens: int, sampling: dict | None = None) -> tuple[float, list[RequestResult]]:
    """`concurrency` users send `num_requests` requests in total (prompt i = prompts[i % len];
    sampling: as _one_request's)."""
    import httpx  # lazy: ~0.2 s to import; only the sweep's client needs it

    todo = list(range(num_requests))
    results: list[RequestResult] = []

    async def user(http):
        while todo:
            i = todo.pop(0)
            results.append(await _one_request(http, url, model, prompts[i % len(prompts)], i, max_tokens, sampling))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(user(http) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return wall, sorted(results, key=lambda r: r.prompt_index)


def summarize(mode: str, concurrency: int, wall: float, results: list[RequestResult]) -> LevelResult:
    ok = [r for r in results if r.error is None and r.completion_tokens > 0]
    tokens = sum(r.completion_tokens for r in ok)
    speeds = [(r.completion_tokens - 1) / (r.e2e - r.ttft) for r in ok if r.completion_tokens > 1 and r.e2e > r.ttft]
    ttfts = sorted(r.ttft for r in ok) or [0.0]
    drafted = sum(r.spec.get("num_draft_tokens", 0) for r in ok)
    accepted = sum(r.spec.get("num_accepted_tokens", 0) for r in ok)
    forwards = sum(r.spec.get("num_target_forwards", 0) for r in ok)
    per_user = statistics.mean(speeds) if speeds else 0.0
    return LevelResult(
        mode=mode, concurrency=concurrency, num_requests=len(results), wall_seconds=round(wall, 3),
        throughput=tokens / wall if wall > 0 else 0.0, per_user_tps=per_user,
        ttft_p50_ms=1000 * ttfts[len(ttfts) // 2], ttft_p95_ms=1000 * ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
        itl_ms=1000 / per_user if per_user else 0.0,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        tau=tokens / forwards if forwards else 1.0,
        errors=len(results) - len(ok),
        verify_length=drafted / forwards if forwards else 0.0,
    )


def slice_count(requests: int, concurrency: int, alternations: int) -> int:
    """How many slices run_alternating cuts a level into: at most one per `concurrency` requests."""
    return max(1, min(alternations, requests // max(1, concurrency)))


def run_alternating(urls: dict[str, str], model: str, prompts: list[str], concurrency: int, max_tokens: int,
                    alternations: int, progress=None, sampling: dict | None = None
                    ) -> dict[str, tuple[float, list[RequestResult]]]:
    """One level's requests in `alternations` consecutive slices (each at least `concurrency`
    requests), every mode running each slice in turn, the first mode rotating from slice to
    slice: on a shared machine whose speed drifts over seconds, every mode then meets the same
    drift. Per mode: the slices' summed wall seconds and all their results. progress(mode) is
    called after each run of a slice."""
    n = len(prompts)
    slices = slice_count(n, concurrency, alternations)
    bounds = [n * j // slices for j in range(slices + 1)]
    modes = list(urls)
    totals: dict[str, tuple[float, list[RequestResult]]] = {m: (0.0, []) for m in modes}
    for j in range(slices):
        start, end = bounds[j], bounds[j + 1]
        for mode in modes[j % len(modes):] + modes[: j % len(modes)]:
            wall, results = asyncio.run(run_level(urls[mode], model, prompts[start:end], concurrency, end - start,
                                                  max_tokens, sampling))
            for r in results:
                r.prompt_index += start
            total, kept = totals[mode]
            totals[mode] = (total + wall, kept + results)
            if progress is not None:
                progress(mode)
    return totals


def run_sweep(urls: dict[str, str], model: str, prompts: list[str], concurrencies: list[int],
              requests_per_user: int, max_tokens: int, min_requests: int = 4, save=None,
              alternations: int = 1, sampling: dict | None = None) -> dict:
    """Sweep every concurrency, modes in turn (alternating over slices of each level's requests
    when `alternations` > 1: run_alternating); returns the report (levels, identity, settings).
    With `sampling` (temperature > 0) the modes' answers differ by design, so no identity is
    compared: exactness under sampling is what `tandem audit` checks.
    `save(report)` is called after each concurrency, so an interrupted sweep keeps what it measured."""
    levels: dict[int, dict[str, LevelResult]] = {}
    texts: dict[str, dict[tuple[int, int], str]] = {m: {} for m in urls}

    # Greedy answers are compared with off's, or without an off mode with the first mode's; a sweep
    # of one mode compares nothing.
    against = "off" if "off" in texts else next(iter(texts))

    def report() -> dict:
        reference = texts[against]
        identity = {} if sampling or len(texts) < 2 else {
            mode: {"compared": len(set(t) & set(reference)),
                   "mismatches": sum(1 for key, text in t.items() if key in reference and reference[key] != text)}
            for mode, t in texts.items() if mode != against
        }
        return {
            "model": model, "modes": list(urls), "concurrency": concurrencies,
            "requests_per_user": requests_per_user, "max_tokens": max_tokens, "num_prompts": len(prompts),
            "alternations": alternations, "sampling": sampling or {"temperature": 0},
            "definitions": SPEEDUP_DEFINITION,
            "levels": {str(c): {m: asdict(r) for m, r in per.items()} for c, per in levels.items()},
            "identity": identity, "identity_reference": against if identity else None,
        }

    sizes = [max(min_requests, c * requests_per_user) for c in concurrencies]
    if sum(sizes) > len(prompts):
        print(f"note: {sum(sizes)} requests over {len(prompts)} prompts: prompts repeat across levels, and a "
              "drafter that remembers earlier answers (suffix) will look better than it is", flush=True)
    steps = progress(total=sum(slice_count(n, c, alternations) for c, n in zip(concurrencies, sizes)) * len(urls),
                 desc="bench serve", unit="run")
    offset = 0
    for c, n in zip(concurrencies, sizes):
        # Each level takes fresh prompts (all modes the same ones), so no level replays another's.
        level_prompts = [prompts[(offset + i) % len(prompts)] for i in range(n)]
        offset += n
        levels[c] = {}

        def ran(mode: str, c=c) -> None:
            steps.set_postfix_str(f"concurrency {c}, {mode}", refresh=False)
            steps.update()

        runs = run_alternating(urls, model, level_prompts, c, max_tokens, alternations, progress=ran,
                               sampling=sampling)
        for mode, (wall, results) in runs.items():
            levels[c][mode] = summarize(mode, c, wall, results)
            texts[mode].update({(c, r.prompt_index): r.text for r in results if r.error is None})
        base = levels[c].get("off")
        for res in levels[c].values():
            if base is not None and base.throughput:
                res.speedup = res.throughput / base.throughput
                res.per_user_speedup = res.per_user_tps / base.per_user_tps if base.per_user_tps else None
        if save is not None:
            save(report())
    steps.close()
    return report()


# ---- report ----------------------------------------------------------------------------------


def print_table(report: dict) -> None:
    width = max([9, *(len(m) for m in report["modes"])])
    head = (f"{'conc':>4} {'mode':{width}} {'tok/s':>8} {'speedup':>7} {'user tok/s':>10} {'user x':>6} "
            f"{'TTFT p50':>9} {'ITL ms':>7} {'accept':>6} {'tau':>5} {'k':>4} {'err':>3}")
    print(head)
    print("-" * len(head))
    for c, per in report["levels"].items():
        for mode, r in per.items():
            sp = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
            usp = f"{r['per_user_speedup']:.2f}x" if r["per_user_speedup"] is not None else "-"
            print(f"{c:>4} {mode:{width}} {r['throughput']:8.1f} {sp:>7} {r['per_user_tps']:10.1f} {usp:>6} "
                  f"{r['ttft_p50_ms']:7.0f}ms {r['itl_ms']:7.1f} {r['acceptance_rate']:6.2f} {r['tau']:5.2f} "
                  f"{r.get('verify_length', 0.0):4.2f} {r['errors']:3d}")
    against = report.get("identity_reference", "off")
    for mode, ident in report["identity"].items():
        if mode != against:
            print(f"{mode}: {ident['mismatches']} of {ident['compared']} answers differ from {against!r} "
                  "(greedy: expect 0)")
    if len(report["modes"]) == 1 and not report["sampling"].get("temperature"):
        other = "a speculative mode" if report["modes"] == ["off"] else "`off`"
        print(f"one mode only: no answers to compare (add {other} to --modes for the greedy identity check)")


def plot(report: dict, path: str) -> None:
    try:
        import matplotlib  # lazy: optional dependency (plots only)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: after matplotlib.use("Agg")
    except ImportError:
        print("matplotlib not installed: skipping the plot")
        return
    cs = [int(c) for c in report["levels"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"adaptive": "tab:blue", "fixed": "tab:orange", "off": "tab:green"}
    for mode in report["modes"]:
        rows = [report["levels"][str(c)][mode] for c in cs]
        color = colors.get(mode)
        if mode != "off" and all(r["speedup"] is not None for r in rows):
            ax1.plot(cs, [r["speedup"] for r in rows], marker="o", color=color, label=f"{mode}: throughput")
            ax1.plot(cs, [r["per_user_speedup"] or 0 for r in rows], marker="x", linestyle="--", color=color,
                     label=f"{mode}: per user")
        ax2.plot(cs, [r["per_user_tps"] for r in rows], marker="o", color=color, label=mode)
    ax1.axhline(1.0, color="grey", linewidth=1)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrent users")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_ylabel("speedup vs speculation off")
    ax1.set_title("Speculation speedup vs load")
    ax2.set_ylabel("tokens/s per user (decode)")
    ax2.set_title(f"Per-user speed, {report['model']}")
    stamp_machine(fig, report.get("machine"))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# ---- launching servers -----------------------------------------------------------------------


def launch_server(mode: str, args, log_dir: Path) -> tuple[subprocess.Popen, str]:
    """Start the server of one mode and wait until /health answers."""
    server_args = ["--max-running-requests", str(args.max_running_requests), "--max-model-len", str(args.max_model_len),
                   "--speculative-num-draft-tokens", str(args.num_draft_tokens)]
    if args.algorithm:
        server_args += ["--speculative-algorithm", args.algorithm]
    if args.threads:
        server_args += ["--threads", str(args.threads)]
    if args.reprofile and mode != "off":
        server_args += ["--reprofile"]
    server_args += mode_flags(mode)  # after --algorithm: a mode's own drafter wins
    return start_server(args.model, server_args, log_dir / f"server-{mode}.log", mode)


def bench_serve(args) -> dict:
    if args.prompts_file:
        chosen = load_prompt_file(args.prompts_file, args.num_prompts)
    else:  # round-robin over the (chosen) Spec-Bench subtasks
        chosen = [p for p in spread_prompts(10**6) if not args.categories or p.category in args.categories]
        chosen = chosen[: args.num_prompts]
    if not chosen:
        raise ValueError(f"no prompts in categories {args.categories}")
    prompts = [p.text for p in chosen]
    given = dict(_parse_url(u) for u in args.url)
    procs = []
    # SIGTERM (e.g. `kill`) must still run the finally below, which stops the launched servers.
    launching = any(m not in given for m in args.modes)
    previous = signal.signal(signal.SIGTERM, _exit_on_signal) if launching else None
    try:
        urls = {}
        for mode in args.modes:
            if mode in given:
                urls[mode] = given[mode]
            else:
                print(f"starting the {mode} server ...", flush=True)
                proc, urls[mode] = launch_server(mode, args, Path(args.out).parent)
                procs.append(proc)
        model = args.served_model or args.model
        for url in urls.values():  # warm-up: first-request costs off the clock (not a sweep prompt)
            asyncio.run(run_level(url, model, [WARMUP_PROMPT], 1, 1, 8))
        steal = StealMeter()
        machine = {**machine_info(), "torch_threads": args.threads or os.cpu_count()}  # the servers' threads
        settings = {"algorithm": args.algorithm, "num_draft_tokens": args.num_draft_tokens, "note": args.note,
                    "max_running_requests": args.max_running_requests, "categories": args.categories,
                    "launched": [m for m in urls if m not in given], "threads": args.threads, "machine": machine}

        def save(report):
            share = steal.share()
            if share is not None:  # the sweep so far
                machine["steal"] = round(share, 4)
            if args.out:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps({**report, **settings}, indent=2))

        sampling = {"temperature": args.temperature, "top_p": args.top_p} if args.temperature > 0 else None
        report = {**run_sweep(urls, model, prompts, args.concurrency, args.requests_per_user, args.max_tokens,
                              save=save, alternations=args.alternations, sampling=sampling), **settings}
    finally:
        for proc in procs:
            stop_server(proc)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print_table(report)
    notice = steal_notice(report["machine"].get("steal"))
    if notice:
        print(notice)
    if args.out:
        print(f"wrote {args.out}")
    plot_path = Path(args.out).with_suffix(".png") if args.plot is None and args.out else args.plot
    if plot_path:
        plot(report, str(plot_path))
    return report


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


def _parse_url(spec: str) -> tuple[str, str]:
    mode, sep, rest = spec.partition("=http")  # a mode may hold '=' itself (`adaptive:suffix@corpus=0`)
    if not sep:
        raise ValueError(f"--url takes MODE=URL with URL like http://host:port (or .../v1), got {spec!r}")
    return checked_mode(mode), api_base("http" + rest)


def add_serve_bench_parser(kinds) -> None:
    p = kinds.add_parser("serve", help="concurrency sweep against the server: speculation adaptive / fixed / off")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--algorithm", default=None, help="drafter (default: the model's default drafter)")
    p.add_argument("--num-draft-tokens", type=at_least(1), default=4)
    p.add_argument("--modes", nargs="+", default=list(MODES), type=checked_mode,
                   help="off, or POLICY[:ALGORITHM] with POLICY adaptive, fixed or confidence and a drafter of the "
                        "mode's own (default --algorithm), e.g. confidence:dspark fixed:dspark adaptive:eagle3 off")
    p.add_argument("--url", action="append", default=[],
                   help="MODE=URL of an already running server for that mode (repeatable); other modes are launched")
    p.add_argument("--served-model", default=None, help="model id the given servers expect (default: --model)")
    p.add_argument("--concurrency", type=at_least(1), nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--requests-per-user", type=at_least(1), default=2)
    p.add_argument("--num-prompts", type=at_least(1), default=80,
                   help="Spec-Bench prompts, round-robin over subtasks; each level takes fresh ones")
    p.add_argument("--categories", nargs="+", default=None, choices=SPEC_BENCH_SUBTASKS, metavar="SUBTASK",
                   help=f"Spec-Bench subtasks to draw from ({' '.join(SPEC_BENCH_SUBTASKS)})")
    p.add_argument("--prompts-file", default=None, help="your own prompts (.jsonl or one per line)")
    p.add_argument("--max-tokens", type=at_least(1), default=128)
    p.add_argument("--temperature", type=number_in(0, 2), default=0.0,
                   help="0: greedy, every mode's answers compared with off's; > 0: sampled with a seed per request "
                        "(no identity check: `tandem audit` checks exactness under sampling)")
    p.add_argument("--top-p", type=number_in(0, 1, low_open=True), default=1.0, help="with --temperature > 0")
    p.add_argument("--alternations", type=at_least(1), default=1,
                   help="split each level's requests into this many slices and run the modes in turn on each "
                        "(rotating which goes first): on a noisy machine every mode then sees the same drift")
    p.add_argument("--max-running-requests", type=at_least(1), default=SERVE_MAX_RUNNING_REQUESTS,
                   help="launched servers' running slots (default: tandem serve's)")
    p.add_argument("--note", default=None,
                   help="what the report should say about this run (e.g. which build a --url server runs)")
    p.add_argument("--max-model-len", type=at_least(16), default=2048)
    p.add_argument("--threads", type=at_least(1), default=None)
    p.add_argument("--reprofile", action="store_true", help="re-measure the adaptive server's cost curve")
    p.add_argument("--out", default="results/serve/bench_serve.json")
    p.add_argument("--plot", default=None, help="the PNG (default: --out with .png; '' for none)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    if args.top_p != 1.0 and args.temperature == 0:
        raise ValueError("--top-p filters sampling; it takes --temperature > 0 (greedy answers ignore it)")
    if args.algorithm:
        check_algorithm_name(args.algorithm)
    report = bench_serve(args)
    # A greedy mismatch means speculation changed an answer, and a failed request leaves a figure
    # without its answer: either is a failure, which the exit status says.
    failed = sum(r["errors"] for per in report["levels"].values() for r in per.values())
    if failed:
        print(f"{failed} requests failed (the `err` column; the servers' logs say why)", file=sys.stderr)
    return 1 if failed or any(v["mismatches"] for v in report["identity"].values()) else 0
