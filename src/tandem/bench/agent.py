"""`tandem bench agent`: an agent-style conversation against the server, prefix cache on and off.

Each turn re-sends the whole transcript plus a new tool output (a passage from Spec-Bench's RAG
prompts) and a question, and streams the answer (greedy). The report gives each turn's prompt
tokens and TTFT per server configuration, and the prefix-cache hits the server counted. Both
servers are launched here in turn with the same flags but the cache switch.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.bench.server_process import (
    ServerError,
    chat_events,
    event_text,
    start_with_flags,
    stop_server,
    write_report,
)
from tandem.bench.spec import machine_info
from tandem.bench.steal import StealMeter
from tandem.flags import at_least
from tandem.model.catalogue import DEFAULT_MODEL

QUESTIONS = Path(__file__).resolve().parents[1] / "data" / "spec_bench_question.jsonl"
SYSTEM = "You are an agent. Tools return passages; answer each question in one or two sentences."


@dataclass
class Turn:
    turn: int
    prompt_tokens: int
    ttft_s: float
    answer: str


def tool_outputs(turns: int, chars: int) -> list[str]:
    passages = [json.loads(line)["turns"][0] for line in QUESTIONS.read_text().splitlines()
                if line.strip() and json.loads(line)["category"] == "rag"]
    return [passages[i % len(passages)][:chars] for i in range(turns)]


def converse(url: str, model: str, turns: int, tool_chars: int, max_tokens: int) -> tuple[list[Turn], str | None]:
    """The turns answered, and why the conversation stopped early (None: it did not): a turn the
    server refuses (a transcript past the context, a model without a chat template) ends it."""
    return asyncio.run(_converse(url, model, turns, tool_chars, max_tokens))


async def _converse(url: str, model: str, turns: int, tool_chars: int,
                    max_tokens: int) -> tuple[list[Turn], str | None]:
    import httpx  # lazy: only the benchmark's client needs it

    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as http:
        for i, tool in enumerate(tool_outputs(turns, tool_chars)):
            messages.append({"role": "user", "content": f"Tool output {i + 1}:\n{tool}\n\nWhat does it say, briefly?"})
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                    "stream_options": {"include_usage": True}}
            t0, ttft, text, usage = time.perf_counter(), None, "", {}
            try:
                async for event in chat_events(http, url, body):
                    piece = event_text(event)
                    if piece and ttft is None:
                        ttft = time.perf_counter() - t0
                    text += piece
                    usage = event.get("usage") or usage
            except ServerError as err:
                return out, f"turn {i + 1}: {err}"
            out.append(Turn(i + 1, usage.get("prompt_tokens", 0), ttft or time.perf_counter() - t0, text))
            messages.append({"role": "assistant", "content": text})
    return out, None


def _prefix_hits(url: str) -> tuple[float, float]:
    import httpx  # lazy: only the benchmark's client needs it

    text = httpx.get(f"{url.removesuffix('/v1')}/metrics").text

    def value(name: str) -> float:
        m = re.search(rf"^{re.escape(name)}_total\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    return value("tandem:prefix_cache_queries"), value("tandem:prefix_cache_hits")


def bench_agent(args) -> dict:
    steal = StealMeter()
    runs = {}
    for label, flags in (("cache on", args.server_flags), ("cache off", f"{args.server_flags} --no-enable-prefix-caching")):
        print(f"starting `tandem serve {flags.strip()}` ...", flush=True)
        proc, url = start_with_flags(flags, args.model, Path(args.out).parent / f"server-agent-{label[-3:].strip()}.log")
        try:
            converse(url, args.model, 1, 200, 4)  # warm-up, off the clock
            turns, stopped = converse(url, args.model, args.turns, args.tool_chars, args.max_tokens)
            queried, hits = _prefix_hits(url)
            runs[label] = {"turns": [asdict(t) for t in turns], "prefix_queried_tokens": queried,
                           "prefix_hit_tokens": hits, "stopped": stopped}
        finally:
            stop_server(proc)
    report = {"model": args.model, "turns": args.turns, "tool_chars": args.tool_chars, "max_tokens": args.max_tokens,
              "server_flags": args.server_flags, "machine": machine_info(steal), "runs": runs}
    print_table(report)
    write_report(report, args.out)
    return report


def print_table(report: dict) -> None:
    on, off = report["runs"]["cache on"], report["runs"]["cache off"]
    print(f"agent conversation, {report['turns']} turns, each re-sending the transcript + a tool output; "
          f"{report['machine'].get('cpu', '')}")
    print(f"{'turn':>4} {'prompt tokens':>13} {'TTFT cache on':>13} {'cache off':>9} {'ratio':>6}")
    for a, b in zip(on["turns"], off["turns"]):
        print(f"{a['turn']:4d} {a['prompt_tokens']:13d} {a['ttft_s']:12.3f}s {b['ttft_s']:8.3f}s "
              f"{b['ttft_s'] / a['ttft_s']:5.1f}x")
    same = sum(a["answer"] == b["answer"] for a, b in zip(on["turns"], off["turns"]))
    print(f"prefix cache: {on['prefix_hit_tokens']:.0f} of {on['prefix_queried_tokens']:.0f} prompt tokens reused; "
          f"answers identical with and without it: {same}/{min(len(on['turns']), len(off['turns']))}")
    for label, run in report["runs"].items():
        if run.get("stopped"):
            print(f"{label}: the conversation stopped early, {run['stopped']}")


def add_agent_bench_parser(kinds) -> None:
    p = kinds.add_parser("agent", help="an agent-style conversation: TTFT per turn with the prefix cache on and off")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--server-flags", default="", help="`tandem serve` flags for both servers")
    p.add_argument("--turns", type=at_least(1), default=10)
    p.add_argument("--tool-chars", type=at_least(0), default=400,
                   help="characters of each tool output (10 turns of 400 fit SmolLM2's 2048-token context)")
    p.add_argument("--max-tokens", type=at_least(1), default=48)
    p.add_argument("--out", default="results/serve/bench_agent.json")
    p.set_defaults(func=_run)


def _run(args) -> int:
    report = bench_agent(args)
    runs = report["runs"]
    # Greedy answers must not depend on the cache: a difference is a bug; a conversation that
    # stopped early did not measure what was asked.
    same = all(a["answer"] == b["answer"] for a, b in zip(runs["cache on"]["turns"], runs["cache off"]["turns"]))
    return 0 if same and not any(run.get("stopped") for run in runs.values()) else 1
