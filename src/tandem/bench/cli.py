"""`tandem bench ...` argument parsing; the benchmarks themselves live beside this file."""

from __future__ import annotations

import argparse


def add_bench_parser(sub) -> None:
    from tandem.model.loader import DEFAULT_MODEL

    bench = sub.add_parser("bench", help="benchmarks (side by side, one run, ratios)")
    kinds = bench.add_subparsers(dest="bench", required=True)

    base = kinds.add_parser("base", help="plain decoding: tandem configurations vs transformers (and llama.cpp)")
    base.add_argument("--model", default=DEFAULT_MODEL)
    base.add_argument("--configs", nargs="+", default=["float32/none", "bfloat16/none", "bfloat16/int8", "bfloat16/int4", "native"],
                      help="DTYPE/QUANTIZATION pairs (or a quantization alone)")
    base.add_argument("--num-prompts", type=int, default=6)
    base.add_argument("--max-new-tokens", type=int, default=64)
    base.add_argument("--threads", type=int, default=None)
    base.add_argument("--skip-transformers", action="store_true")
    base.add_argument("--out", default="results/bench_base.json")
    base.add_argument("--plot", default="results/bench_base.png")
    base.set_defaults(func=_run_base)


def _run_base(args: argparse.Namespace) -> int:
    from tandem.bench.base import bench_base
    from tandem.llm import configure_threads

    configure_threads(args.threads)
    bench_base(args)
    return 0
