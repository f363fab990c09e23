"""A server's steady load in one process: B requests always in flight, a new one started as soon
as one ends, and where each round's time goes, for plain decoding and speculative modes in turn.

Each repetition decodes --requests Spec-Bench prompts not decoded before (round-robin over the
subtasks the scheduler benchmarks use, as `tandem bench serve` takes them), greedy, --max-tokens
each, through `Engine.add_request` / `step` as the server's engine thread does, and prints the
wall time, the rounds, the draft tokens verified and accepted per round and the engine's phases
in ms per round. For the confidence scheduler it also counts how many requests were asked for a
draft's source (`worth_asking`) and how many drafted.

    .venv/bin/python scripts/steady_load.py --batch 8 --threads 1 off confidence:dspark

A mode is `off` or POLICY:ALGORITHM, with `@lookup=0` or `@corpus=0` after it as in `tandem
bench serve` (confidence:dspark@lookup=0: the head alone). Timings are only comparable within one
run, and even there engines of one configuration can read a few percent apart on a shared host, so
each run also prints its *modelled* time: every round priced at the target's cached cost profile
for the rows it computed (the curve the policies price with), which depends only on what was
drafted and verified, and the ratio of the same repetition's `off` modelled time to it (drafting,
bookkeeping and the rest of a round are left out).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from tandem.bench.prompts import spread_prompts
from tandem.config import SamplingParams
from tandem.engine.engine import Engine
from tandem.llm import LLM
from tandem.model.kernels import cpu_name, kernel_description
from tandem.scheduler.profile import cost_curve_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_phases import timed

PHASES = ("_decode_round", "_verify_forward", "_propose", "_commit_round", "_learn", "_prefill")
CATEGORIES = ("multi_turn", "qa", "translation", "math_reasoning")


def count_rows(rows: list[int]) -> None:
    """Append the rows of every verification forward (ModelRunner.verify_rows) to `rows`."""
    inner = Engine._verify_forward

    def wrapper(self, *args, **kwargs):
        out, computed = inner(self, *args, **kwargs)
        rows.append(computed)
        return out, computed

    Engine._verify_forward = wrapper


def count_asking(llm: LLM, counts: Counter) -> None:
    """Count, per run, the requests worth_asking let through and those that drafted."""
    policy = llm.engine.policy
    worth, lengths = policy.worth_asking, policy.draft_lengths

    def counted_worth(batch):
        out = worth(batch)
        counts["asked"] += sum(out)
        return out

    def counted_lengths(slots):
        ks = lengths(slots)
        counts["drafted"] += sum(1 for k in ks if k)
        return ks

    policy.worth_asking, policy.draft_lengths = counted_worth, counted_lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modes", nargs="+", help="off, or POLICY:ALGORITHM[@OPTION=0|1] (confidence:dspark, ...)")
    parser.add_argument("--batch", type=int, default=8, help="requests in flight")
    parser.add_argument("--requests", type=int, default=48, help="requests per mode and repetition")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="kernel threads (a server's default is 1 on 2 cores)")
    args = parser.parse_args()
    if len(set(args.modes)) != len(args.modes):
        raise SystemExit("a mode named twice would decode its prompts again against its own earlier answers "
                         "(suffix decoding keeps them)")
    seconds, calls = defaultdict(float), Counter()
    for name in PHASES:
        timed(seconds, calls, name)
    rows: list[int] = []  # the rows each verification forward computed, this run
    count_rows(rows)
    # The prompts `tandem bench serve` sends: round-robin over these subtasks (the MT-Bench ones are
    # multi_turn there), so both measure the same mix.
    questions = [p.text for p in spread_prompts(10**6) if p.category in CATEGORIES][: args.requests * args.repeats]
    if len(questions) < args.requests * args.repeats:
        raise SystemExit(f"only {len(questions)} prompts: ask for fewer --requests or --repeats")
    llms, asking = {}, {}
    for mode in args.modes:
        spec = {}
        if mode != "off":
            base, *options = mode.split("@")  # confidence:dspark@lookup=0, as tandem bench serve's modes
            policy, _, algorithm = base.partition(":")
            spec = {"speculative_policy": policy, **({"speculative_algorithm": algorithm} if algorithm else {})}
            for option in options:
                key, _, value = option.partition("=")
                spec[f"speculative_{key}"] = value == "1"
        llms[mode] = LLM(max_num_seqs=max(32, args.batch), threads=args.threads, **spec)
        llms[mode].generate(questions[0], SamplingParams(temperature=0, max_tokens=16), chat=True)
        asking[mode] = Counter()
        if getattr(llms[mode].engine.policy, "prices_sources", False):
            count_asking(llms[mode], asking[mode])
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    first = next(iter(llms.values()))
    profile = cost_curve_for(first.loaded, first.config.device, args.threads)
    modelled_off = {}  # repetition -> off's modelled seconds
    print(f"{cpu_name()}, {kernel_description()}, {args.threads} kernel thread(s): {args.batch} requests in flight, "
          f"{args.requests} per run, {args.max_tokens} tokens each")
    for rep in range(args.repeats):
        batch_prompts = questions[rep * args.requests : (rep + 1) * args.requests]
        for mode in args.modes:
            engine: Engine = llms[mode].engine
            prompts = [llms[mode].encode(text, chat=True) for text in batch_prompts]
            seconds.clear()
            calls.clear()
            rows.clear()
            asking[mode].clear()
            drafted0, accepted0 = engine.stats.num_draft_tokens, engine.stats.num_accepted_tokens
            started, live, start = 0, 0, time.perf_counter()
            while started < len(prompts) or engine.has_work():
                while live < args.batch and started < len(prompts):
                    engine.add_request(prompts[started], greedy)
                    started += 1
                    live += 1
                live -= len({id(u.request) for u in engine.step() if u.request.finished})
            wall = time.perf_counter() - start
            rounds = max(1, calls["_decode_round"])
            phases = " ".join(f"{name[1:]} {seconds[name] / rounds * 1e3:.2f}" for name in PHASES if calls[name])
            verified = (engine.stats.num_draft_tokens - drafted0) / rounds
            accepted = (engine.stats.num_accepted_tokens - accepted0) / rounds
            asked = f"  asked {asking[mode]['asked']}, drafted {asking[mode]['drafted']}" if asking[mode] else ""
            modelled = sum(profile(n) for n in rows)
            if mode == "off":
                modelled_off[rep] = modelled
            ratio = f" ({modelled_off[rep] / modelled:.3f}x off)" if rep in modelled_off else ""
            print(f"run {rep + 1} {mode:22s} {wall:6.2f} s, modelled {modelled:.2f} s{ratio}, {rounds} rounds, draft "
                  f"tokens a round {verified:.2f} verified / {accepted:.2f} accepted; ms a round: {phases}{asked}",
                  flush=True)


if __name__ == "__main__":
    main()
