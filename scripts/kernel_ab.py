"""Two versions of the block kernels side by side: a prompt's prefill and verification forwards
at its end, alternating the builds in one process, and whether their logits are the same bits.

For the default model with its default fp16 KV cache: each repetition runs, for every source in
turn, a prefill of --prompt-tokens tokens (768) and then forwards of --verify-sizes tokens (1, 3
and 5) after it (best of 5 each). Prints each build's best and median times and the median per-repetition ratio of the
first build's time to each other's (> 1: the other is faster).

    git show bbe9ed9:src/tandem/model/kernels/block_matmul.cpp > /tmp/before.cpp
    .venv/bin/python scripts/kernel_ab.py /tmp/before.cpp src/tandem/model/kernels/block_matmul.cpp
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from tandem.llm import LLM
from tandem.model.fused import FusedDecoder
from tandem.model.kernels import cpu_name, load_variant, selected_variant
from tandem.model.kv_cache import KVCache
from tandem.model.runner import ModelRunner, SeqInput


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="+", type=Path, help="versions of block_matmul.cpp (the first is the baseline)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--prompt-tokens", type=int, default=768, help="the context the verification forwards follow")
    parser.add_argument("--verify-sizes", type=int, nargs="+", default=[1, 3, 5],
                        help="tokens per verification forward after the prompt")
    args = parser.parse_args()
    variant = selected_variant()
    if variant is None:
        raise SystemExit("the block kernels do not run on this CPU (or TANDEM_KERNELS=torch)")
    loaded = LLM(max_model_len=2048).loaded
    runner = ModelRunner(loaded.model, KVCache(loaded.config, 1, 2048, torch.float32, storage=torch.float16))
    builds = {str(src): FusedDecoder(loaded.model, load_variant(variant, src.resolve())) for src in args.sources}
    prompt = list(range(100, 100 + args.prompt_tokens))
    times: dict[tuple[str, str], list[float]] = {}
    logits: dict[str, torch.Tensor] = {}
    for _ in tqdm(range(args.repeats), desc="alternating builds", unit="round"):
        for name, decoder in builds.items():
            runner.fused = decoder
            seq = runner.cache.allocate()
            start = time.perf_counter()
            out = runner.forward([SeqInput(seq, prompt)])
            times.setdefault(("prefill", name), []).append(time.perf_counter() - start)
            logits.setdefault(name, out.logits)
            for n in args.verify_sizes:
                best = float("inf")
                for _ in range(5):
                    start = time.perf_counter()
                    runner.forward([SeqInput(seq, list(range(200, 200 + n)), logits="all")])
                    best = min(best, time.perf_counter() - start)
                    runner.cache.truncate(seq, args.prompt_tokens)
                times.setdefault((f"verify {n}", name), []).append(best)
            runner.cache.release(seq)
    print(f"{cpu_name()}, kernels {variant}, {torch.get_num_threads()} threads; prompt {args.prompt_tokens} tokens, "
          f"verification forwards after it; {args.repeats} alternating repetitions")
    baseline = str(args.sources[0])
    for what in ["prefill", *(f"verify {n}" for n in args.verify_sizes)]:
        for name in builds:
            ts = times[(what, name)]
            line = f"{what:9} {name}: best {1000 * min(ts):.2f} ms, median {1000 * statistics.median(ts):.2f} ms"
            if name != baseline:
                ratio = statistics.median(a / b for a, b in zip(times[(what, baseline)], ts))
                line += f", median ratio baseline/this {ratio:.3f}"
            print(line)
    same = all(torch.equal(logits[baseline], other) for other in logits.values())
    print("prompt logits the same bits in every build:", same)


if __name__ == "__main__":
    main()
