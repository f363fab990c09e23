"""Where a round's time goes in the engine: drafting, the target's forward, grading, committing.

Decodes 8 Spec-Bench prompts (every tenth of the first 80) one at a time with the default model
and the given sampling, after one warm-up, and prints tokens per second, tau, and each phase of
`Engine` (_propose, _verify_forward, _grade, _commit_round) in ms per round. METHOD is `off`
(plain decoding) or a drafter; a head runs alone unless --lookup puts the suffix lookup in front
of it, under --policy (fixed, adaptive, or confidence: the scheduler).

    .venv/bin/python scripts/engine_phases.py off --temperature 1
    .venv/bin/python scripts/engine_phases.py eagle3 --temperature 0.8 --top-p 0.95
    .venv/bin/python scripts/engine_phases.py dspark --lookup --policy confidence --temperature 0

With --batch N: N prompts (every tenth of the first 10 N) decoded together, as a server with N
users would batch them; a round is then one step of the whole batch.

To compare two commits, run it under each one's sources (PYTHONPATH=<worktree>/src) in turn.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter, defaultdict
from pathlib import Path

from tandem.config import SamplingParams
from tandem.engine.engine import Engine
from tandem.llm import LLM
from tandem.model.kernels import cpu_name, kernel_description

QUESTIONS = Path(__file__).resolve().parents[1] / "src" / "tandem" / "data" / "spec_bench_question.jsonl"
PHASES = ("_propose", "_verify_forward", "_plain_draws", "_grade", "_commit_round")


def timed(seconds: defaultdict, calls: Counter, name: str) -> None:
    """Wrap Engine.<name> so every call adds its time to seconds[name]."""
    inner = getattr(Engine, name)

    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - start
            calls[name] += 1

    setattr(Engine, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("method", help="off, or a drafter (suffix, eagle3, dspark, ...)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1, help="prompts decoded together (default 1: one at a time)")
    parser.add_argument("--policy", default="fixed", help="fixed, adaptive or confidence (the scheduler)")
    parser.add_argument("--lookup", action="store_true", help="a head drafts behind the suffix lookup, as served")
    parser.add_argument("--threads", type=int, default=None, help="kernel threads (tandem serve runs 1 on 2 cores)")
    args = parser.parse_args()
    seconds, calls = defaultdict(float), Counter()
    phases = [name for name in PHASES if hasattr(Engine, name)]  # an older commit may lack one
    for name in (*phases, "_decode_round"):
        timed(seconds, calls, name)
    spec = {} if args.method == "off" else {"speculative_algorithm": args.method, "speculative_lookup": args.lookup,
                                            "speculative_policy": args.policy}
    llm = LLM(max_num_seqs=max(8, args.batch), threads=args.threads, **spec)
    count = max(8, args.batch)
    questions = [json.loads(line) for line in QUESTIONS.read_text().splitlines()][: 10 * count : 10]

    def params(seed: int, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              max_tokens=max_tokens, seed=seed)

    llm.generate(questions[0]["turns"][0], params(0, 16), chat=True)
    seconds.clear()
    calls.clear()
    start, cpu_start, tokens = time.perf_counter(), time.thread_time(), 0
    for first in range(0, len(questions), args.batch):
        group = questions[first : first + args.batch]
        outs = llm.generate([q["turns"][0] for q in group],
                            [params(first + i, args.max_tokens) for i in range(len(group))], chat=True)
        tokens += sum(len(out.token_ids) for out in outs)
    elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
    rounds = calls["_decode_round"]
    print(f"{cpu_name()}, {kernel_description()}: {args.method} ({args.policy} policy"
          f"{', behind the lookup' if args.lookup else ''}) at temperature {args.temperature}, top-p {args.top_p}, "
          f"top-k {args.top_k}")
    print(f"{tokens / elapsed:.1f} tok/s, {rounds} rounds (batch {args.batch}), "
          f"tokens per round {tokens / rounds:.2f}; this thread's CPU time {cpu / tokens * 1e3:.3f} ms a token "
          "(with --threads 1, all the work's: steadier than the wall clock on a shared host)")
    for name in phases:
        print(f"  {name:16s} {seconds[name] / rounds * 1e3:.3f} ms a round")


if __name__ == "__main__":
    main()
