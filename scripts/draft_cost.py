"""Drafting cost against the target's decode step, measured in one process.

For the default model (batch 1, a 300-token Spec-Bench summarization prompt): the target's decode
step (the time of 32 more generated tokens, best of 5), then for each drafter named on the
command line (METHOD:K, default eagle3:4 dflash:4 mtp:2 medusa:3, their shipped heads, without
the suffix lookup in front) the median time of a round that drafts 1 token and of one that
drafts K, in steady state (one new committed row per round). Prints the ms per draft token, the
cost of each further draft step and of a whole round, as fractions of the step.

    .venv/bin/python scripts/draft_cost.py eagle3:4 dflash:4

With --batch N: instead, N Spec-Bench chat prompts (qa, translation, math_reasoning) decoded
together through the engine (greedy, 96 tokens, fixed k, the head alone), and the drafter's time
per round while at least 3/4 of them run: what drafting for a batch costs, catch-ups included.

    .venv/bin/python scripts/draft_cost.py --batch 8 eagle3:4 dflash:4 dspark:4
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from tandem.config import EngineConfig, SamplingParams, SpecConfig
from tandem.drafters import DraftInput
from tandem.llm import LLM
from tandem.model.kernels import cpu_name, kernel_description
from tandem.model.kv_cache import KVCache
from tandem.model.runner import ModelRunner, SeqInput

QUESTIONS = Path(__file__).resolve().parents[1] / "src" / "tandem" / "data" / "spec_bench_question.jsonl"
GREEDY = SamplingParams(temperature=0)


def decode_step(llm: LLM, ids: list[int]) -> float:
    def seconds(n: int) -> float:
        t = time.perf_counter()
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t

    seconds(4)
    return min((seconds(33) - seconds(1)) / 32 for _ in range(5))


def round_times(loaded, method: str, k: int, ids: list[int], ctx: list[int]) -> tuple[float, float]:
    """Median seconds of a round drafting 1 token and of one drafting k."""
    # The head alone: with the lookup on, a round the lookup drafts never runs the head.
    spec = SpecConfig(method, k, lookup=False)
    drafter = LLM.from_loaded(loaded, EngineConfig(max_model_len=1024, spec=spec)).engine.drafter
    runner = ModelRunner(loaded.model, KVCache(loaded.config, 1, 1024, torch.float32))
    out = runner.forward([SeqInput(runner.cache.allocate(), ctx[:-1])], drafter.needs.hidden_layers)
    hidden = {layer: rows[0] for layer, rows in out.hidden.items()}  # rows for ctx[:-1]
    g, n = torch.Generator(), len(ids)
    drafter.propose([DraftInput("r", ctx[:n], n, k, GREEDY, g, {a: h[: n - 1] for a, h in hidden.items()})])
    times: dict[int, list[float]] = {1: [], k: []}
    for rep in range(36):
        budget, n = (1 if rep % 2 else k), n + 1
        inp = DraftInput("r", ctx[:n], len(ids), budget, GREEDY, g, {a: h[n - 2 : n - 1] for a, h in hidden.items()})
        t = time.perf_counter()
        drafter.propose([inp])
        times[budget].append(time.perf_counter() - t)
    return statistics.median(times[1]), statistics.median(times[k])


def batch_round(method: str, k: int, batch: int) -> tuple[float, int]:
    """Mean seconds of the drafter's rounds while >= 3/4 of `batch` requests run, and their count."""
    questions = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    prompts = [q["turns"][0] for q in questions if q.get("category") in ("qa", "translation", "math_reasoning")][:batch]
    llm = LLM(speculative_algorithm=method, speculative_num_draft_tokens=k, speculative_lookup=False,
              speculative_policy="fixed", max_num_seqs=batch)
    params = SamplingParams(temperature=0, max_tokens=96)
    llm.generate(prompts[:2], params, chat=True)
    drafter = llm.engine.drafter
    propose, spent = drafter.propose, []

    def timed(inputs):
        t = time.perf_counter()
        out = propose(inputs)
        if 4 * len(inputs) >= 3 * batch:
            spent.append(time.perf_counter() - t)
        return out

    drafter.propose = timed
    llm.generate(prompts, params, chat=True)
    return statistics.mean(spent), len(spent)


def main(args: list[str]) -> None:
    if args[:1] == ["--batch"]:
        batch = int(args[1])
        print(f"{cpu_name()}, {kernel_description()}, {torch.get_num_threads()} threads; {batch} requests")
        for item in args[2:] or ["eagle3:4", "dflash:4"]:
            method, _, k = item.partition(":")
            seconds, rounds = batch_round(method, int(k or 4), batch)
            print(f"{method:7} k={k or 4}: {1000 * seconds:.2f} ms per round of the whole batch ({rounds} rounds)")
        return
    base = LLM(max_model_len=1024)
    loaded = base.loaded
    questions = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    prompt = next(q["turns"][0] for q in questions if q.get("category") == "summarization")
    ids = loaded.tokenizer.encode(prompt)[:300]
    step = decode_step(base, ids)
    print(f"{cpu_name()}, {kernel_description()}, {torch.get_num_threads()} threads; context {len(ids)} tokens")
    print(f"target decode step: {1000 * step:.2f} ms")
    ctx = ids + base.generate([ids], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].token_ids
    for item in args or ["eagle3:4", "dflash:4", "mtp:2", "medusa:3"]:
        method, _, k = item.partition(":")
        k = int(k or 4)
        one, full = round_times(loaded, method, k, ids, ctx)
        further = (full - one) / (k - 1) if k > 1 else 0.0
        print(f"{method:7} k={k}: {1000 * full / k:.2f} ms per draft token ({full / k / step:.2f}x the step); "
              f"each further draft step {1000 * further:.2f} ms ({further / step:.2f}x); a round of {k}: "
              f"{1000 * full:.2f} ms ({full / step:.2f} steps)")


if __name__ == "__main__":
    main(sys.argv[1:])
