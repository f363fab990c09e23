"""The fused decoder with its weights in one buffer (kernels/arena.py) against the same decoder
with each layer's weights where packing left them, alternating in one process.

For the default model: a prompt of --prompt-tokens tokens, then for each repetition and each
decoder in turn (the order flips every repetition) forwards of --verify-sizes tokens after it,
best of 15 each. Prints each decoder's median time per size, the median per-repetition ratio
(> 1: the buffer is faster), and whether the prompt's logits are the same bits.

    .venv/bin/python scripts/weight_buffer_ab.py --threads 2 --prompt-tokens 300
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tandem.model.fused as fused
from tandem.llm import LLM
from tandem.model.fused import FusedDecoder
from tandem.model.kernels import cpu_name, kernel_description
from tandem.model.runner import SeqInput


def decoder(llm: LLM, in_one_buffer: bool) -> FusedDecoder:
    """A fresh decoder over freshly packed weights, placed in one buffer or left where packed."""
    for module in llm.loaded.model.modules():
        module.__dict__.pop("_blocks", None)  # block_linear's packed weights: packed again
    place = fused.place_contiguously
    if not in_one_buffer:
        fused.place_contiguously = lambda weights: None
    try:
        return FusedDecoder(llm.loaded.model, llm.engine.runner.fused.kernels)
    finally:
        fused.place_contiguously = place


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--verify-sizes", type=int, nargs="+", default=[1, 3, 5])
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    llm = LLM(max_model_len=2048, threads=args.threads)
    runner = llm.engine.runner
    if runner.fused is None:
        raise SystemExit("the block kernels do not run on this CPU (or TANDEM_KERNELS=torch)")
    decoders = {"scattered": decoder(llm, False), "one buffer": decoder(llm, True)}
    prompt = list(range(100, 100 + args.prompt_tokens))
    seq = runner.cache.allocate()
    logits = {}
    for name, dec in decoders.items():
        runner.fused = dec
        logits[name] = runner.forward([SeqInput(seq, prompt)]).logits
        runner.cache.truncate(seq, 0)
    runner.forward([SeqInput(seq, prompt)])
    times: dict[tuple[str, int], list[float]] = {}
    for rep in range(args.repeats):
        for name in (list(decoders) if rep % 2 else list(reversed(decoders))):
            runner.fused = decoders[name]
            for n in args.verify_sizes:
                best = float("inf")
                for _ in range(15):
                    start = time.perf_counter()
                    runner.forward([SeqInput(seq, list(range(200, 200 + n)), logits="all")], (), token_by_token=True)
                    best = min(best, time.perf_counter() - start)
                    runner.cache.truncate(seq, args.prompt_tokens)
                times.setdefault((name, n), []).append(best)
    print(f"{cpu_name()}, {kernel_description()}, {args.threads} threads; {args.prompt_tokens}-token context, "
          f"{args.repeats} alternating repetitions")
    for n in args.verify_sizes:
        a, b = times[("scattered", n)], times[("one buffer", n)]
        ratio = statistics.median(x / y for x, y in zip(a, b))
        print(f"{n} token(s): scattered {1000 * statistics.median(a):.2f} ms, one buffer "
              f"{1000 * statistics.median(b):.2f} ms, median ratio {ratio:.3f}")
    print("prompt logits the same bits:", torch.equal(logits["scattered"], logits["one buffer"]))


if __name__ == "__main__":
    main()
