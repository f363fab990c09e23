"""`tandem bench ...` argument parsing; the benchmarks themselves live beside this file."""

from __future__ import annotations

import argparse

from tandem.bench.agent import add_agent_bench_parser
from tandem.bench.base import bench_base
from tandem.bench.burst import add_burst_bench_parser
from tandem.bench.prompts import SPEC_BENCH_SUBTASKS
from tandem.bench.replicas import add_replicas_bench_parser
from tandem.bench.results_doc import results_command
from tandem.bench.serve import add_serve_bench_parser
from tandem.bench.soak import add_soak_bench_parser
from tandem.bench.spec_merge import merge_command
from tandem.bench.spec_report import bench_spec
from tandem.config import DTYPES, QUANTIZATIONS
from tandem.flags import at_least
from tandem.llm import configure_threads
from tandem.model.catalogue import DEFAULT_MODEL


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks (side by side, one run, ratios)")
    kinds = bench.add_subparsers(dest="bench", required=True)
    _add_base_parser(kinds)
    _add_spec_parser(kinds)
    _add_spec_merge_parser(kinds)
    _add_results_parser(kinds)
    add_serve_bench_parser(kinds)
    add_burst_bench_parser(kinds)
    add_agent_bench_parser(kinds)
    add_soak_bench_parser(kinds)
    add_replicas_bench_parser(kinds)


def _add_base_parser(kinds) -> None:
    base = kinds.add_parser("base", help="plain decoding: tandem configurations vs transformers (and llama.cpp)")
    base.add_argument("--model", default=DEFAULT_MODEL)
    base.add_argument("--configs", nargs="+", default=["float32/none", "bfloat16/none", "bfloat16/int8", "bfloat16/int4", "bfloat16/native", "int8", "int4", "native"],
                      help="DTYPE/QUANTIZATION pairs (or a quantization alone)")
    base.add_argument("--num-prompts", type=at_least(1), default=6)
    base.add_argument("--max-new-tokens", type=at_least(1), default=64)
    base.add_argument("--threads", type=at_least(1), default=None)
    base.add_argument("--skip-transformers", action="store_true")
    base.add_argument("--skip-kernel-report", action="store_true",
                      help="skip the kernel section (bandwidth, int8 peak, floor, decode step, cost curve, bf16 reference)")
    base.add_argument("--require-llamacpp", action="store_true",
                      help="fail when llama-cpp-python is missing instead of leaving its line out")
    base.add_argument("--cpu-time", action="store_true",
                      help="time with the CPU time of one thread instead of wall time (for a shared host; implies --threads 1)")
    base.add_argument("--out", default="results/bench_base.json")
    base.add_argument("--plot", default="results/bench_base.png")
    base.set_defaults(func=_run_base)


def _add_spec_parser(kinds) -> None:
    spec = kinds.add_parser("spec", help="speculative decoding, Spec-Bench style: every drafter vs plain, "
                                         "transformers prompt lookup / assisted generation vs its plain generate")
    spec.add_argument("--model", default=DEFAULT_MODEL)
    spec.add_argument("--dtype", default="auto", choices=("auto",) + DTYPES)
    spec.add_argument("--quantization", default="auto", choices=QUANTIZATIONS)
    spec.add_argument("--methods", nargs="+", default=None, metavar="NAME[=PATH]",
                      help="drafters, comma- or space-separated, e.g. ngram,suffix,draft_model=PATH "
                           "(default: every registered drafter that needs no extra files)")
    spec.add_argument("--num-draft-tokens", "-k", type=at_least(1), default=4)
    spec.add_argument("--limit", type=at_least(1), default=3, help="first N prompts of each Spec-Bench subtask")
    spec.add_argument("--categories", nargs="+", default=None, choices=SPEC_BENCH_SUBTASKS, metavar="SUBTASK",
                      help=f"subset of {' '.join(SPEC_BENCH_SUBTASKS)}")
    spec.add_argument("--max-new-tokens", type=at_least(1), default=128)
    spec.add_argument("--temperature", type=float, default=0.0,
                      help="0 = greedy (identity checked); > 0 = seeded sampling, seed + prompt index per prompt")
    spec.add_argument("--seed", type=int, default=0)
    spec.add_argument("--hf-pld-tokens", type=int, default=10, help="transformers prompt_lookup_num_tokens")
    spec.add_argument("--hf-assistant", default="auto",
                      help="assistant model for transformers assisted generation: a model name/path, "
                           "auto (a smaller built-in model with the same tokenizer) or none")
    spec.add_argument("--threads", type=at_least(1), default=None)
    spec.add_argument("--skip-transformers", action="store_true")
    spec.add_argument("--json-object", action="store_true",
                      help="every answer must be a JSON object (structured output; with --skip-transformers)")
    spec.add_argument("--json", default="results/bench_spec.json", help="report path ('' to skip)")
    spec.add_argument("--plots", default="results/bench_spec", help="directory for the PNG plots ('' to skip)")
    spec.add_argument("--note", default="", help="what this run was (kept in the report, shown on the results page)")
    spec.set_defaults(func=_run_spec)


def _add_spec_merge_parser(kinds) -> None:
    merge = kinds.add_parser("spec-merge", help="merge `bench spec` reports of disjoint subtasks (a full suite run in "
                                                "parts, e.g. one --categories run per sitting) into one report")
    merge.add_argument("reports", nargs="+", help="report JSON files written by `tandem bench spec --json`")
    merge.add_argument("--json", default="results/bench_spec.json", help="merged report path ('' to skip)")
    merge.add_argument("--plots", default="results/bench_spec", help="directory for the PNG plots ('' to skip)")
    merge.set_defaults(func=_run_spec_merge)


def _add_results_parser(kinds) -> None:
    results = kinds.add_parser("results", help="rebuild results/README.md from the results/**/*.json files: per file "
                                               "its command, machine and headline tables")
    results.add_argument("--results-dir", default="results", help="directory searched for *.json reports")
    results.add_argument("--out", default="results/README.md", help="the page to write")
    results.add_argument("--check", action="store_true", help="write nothing; exit 1 if --out is not up to date")
    results.set_defaults(func=_run_results)


def _run_base(args: argparse.Namespace) -> int:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.cpu_time and args.threads != 1:
        print("--cpu-time: every engine runs on one thread (--threads 1)")
        args.threads = 1
    configure_threads(args.threads)
    bench_base(args)
    return 0


def _run_spec(args: argparse.Namespace) -> int:
    configure_threads(args.threads)
    report = bench_spec(args)
    # A greedy mismatch means a method changed the output: a bug, so the exit status says so.
    return 1 if any(v["mismatches"] for v in (report["identity"] or {}).values()) else 0


def _run_spec_merge(args: argparse.Namespace) -> int:
    return merge_command(args)


def _run_results(args: argparse.Namespace) -> int:
    return results_command(args)
