"""`tandem` command line: generate, serve, bench, audit (train/advise arrive with their issues)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."


def add_model_args(p: argparse.ArgumentParser) -> None:
    from tandem.config import QUANTIZATIONS
    from tandem.model.loader import DEFAULT_MODEL

    p.add_argument("--model", "--model-path", dest="model", default=DEFAULT_MODEL,
                   help="built-in name (smollm2-135m-instruct, gemma3-270m), HF directory or .gguf file")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="activation dtype (auto: bfloat16 for quantized weights, float32 for dense)")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                   help="auto: the GGUF's own 4-bit blocks on CPU; none: dense float weights")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: all cores)")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-algorithm", default=None, help="drafter name (e.g. ngram, suffix)")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=4,
                   help="draft tokens per round: a chain's length, a tree's node count (root not counted)")
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--speculative-num-steps", type=int, default=None,
                   help="draft depth (chains draft min(steps, draft tokens); trees default to 5); SGLang's flag")
    p.add_argument("--speculative-eagle-topk", type=int, default=1,
                   help="1: chain drafts; > 1: eagle/eagle3 draft EAGLE-2 trees with this many children per "
                        "expanded node and this many nodes expanded per depth")
    p.add_argument("--speculative-tree-lookup", action=argparse.BooleanOptionalAction, default=True,
                   help="trees also get a suffix-lookup branch (copies from the context)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_from_args(args):
    from tandem.config import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, max_tokens=args.max_new_tokens,
        seed=args.seed, stop=tuple(args.stop),
    )


def llm_from_args(args):
    from tandem.llm import LLM

    return LLM(
        args.model, dtype=args.dtype, quantization=args.quantization, device=args.device,
        max_model_len=args.max_model_len, threads=args.threads,
        speculative_algorithm=getattr(args, "speculative_algorithm", None),
        speculative_num_draft_tokens=getattr(args, "speculative_num_draft_tokens", 4),
        speculative_draft_model_path=getattr(args, "speculative_draft_model_path", None),
        speculative_num_steps=getattr(args, "speculative_num_steps", None),
        speculative_eagle_topk=getattr(args, "speculative_eagle_topk", 1),
        speculative_tree_lookup=getattr(args, "speculative_tree_lookup", True),
    )


def cmd_generate(args) -> int:
    params = sampling_from_args(args)
    llm = llm_from_args(args)
    if args.json:
        prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
        t0 = time.perf_counter()
        out = llm.generate(prompt, params, chat=args.chat)[0]
        seconds = time.perf_counter() - t0
        record = {
            "text": out.text,
            "token_ids": out.token_ids,
            "finish_reason": out.finish_reason,
            "usage": {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids)},
            "timing": {"seconds": round(seconds, 4), "tokens_per_second": round(len(out.token_ids) / seconds, 2)},
        }
        if llm.config.spec.algorithm:
            record["spec"] = out.spec.as_dict()
        print(json.dumps(record))
        return 0
    prompts = [args.prompt] if args.prompt is not None else None
    interactive = prompts is None and sys.stdin.isatty()
    if prompts is None and not interactive:
        prompts = [line.strip() for line in sys.stdin if line.strip()] or [DEFAULT_PROMPT]
    while True:
        if interactive:
            try:
                text = input("\n>>> ")
            except EOFError:
                return 0
            if not text.strip():
                continue
            prompts = [text]
        for prompt in prompts:
            t0 = time.perf_counter()
            for piece in llm.stream(prompt, params, chat=args.chat):
                print(piece, end="", flush=True)
            out = llm.last_output
            seconds = time.perf_counter() - t0
            line = f"\n[{len(out.token_ids)} tokens in {seconds:.2f} s: {len(out.token_ids) / seconds:.1f} tokens/s"
            if llm.config.spec.algorithm:
                line += f"; acceptance {out.spec.acceptance_rate:.2f}, tau {out.spec.mean_acceptance_length:.2f}"
            print(line + f"; finish: {out.finish_reason}]", file=sys.stderr, flush=True)
        if not interactive:
            return 0


def cmd_audit(args) -> int:
    from tandem.audit import run_audit

    if not args.speculative_algorithm:
        raise ValueError("audit needs --speculative-algorithm")
    params = sampling_from_args(args)
    llm = llm_from_args(args)
    prompt_ids = llm.encode(args.prompt, chat=args.chat)
    report = run_audit(llm.engine, prompt_ids, params, rounds=args.rounds, alpha=args.alpha, seed=args.seed or 0)
    print(report.render())
    return 0 if report.passed else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Lossless speculative decoding engine")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text (streams; --json for one JSON object)")
    add_model_args(gen)
    add_spec_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--prompt", default=None, help="prompt text (default: read stdin / interactive)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true")
    gen.set_defaults(func=cmd_generate)

    audit = sub.add_parser("audit", help="prove losslessness of a target + drafter statistically (exit 1 on failure)")
    add_model_args(audit)
    add_spec_args(audit)
    add_sampling_args(audit)
    audit.set_defaults(temperature=1.0)
    audit.add_argument("--prompt", default="Write a short story about a robot who learns to paint.")
    audit.add_argument("--chat", action="store_true")
    audit.add_argument("--rounds", type=int, default=4000, help="independent speculative rounds")
    audit.add_argument("--alpha", type=float, default=1e-3, help="family-wise significance level")
    audit.set_defaults(func=cmd_audit)

    from tandem.launch_server import add_serve_args, run_serve

    serve = sub.add_parser("serve", help="OpenAI-compatible server with continuous batching and adaptive speculation")
    add_serve_args(serve)
    serve.set_defaults(func=run_serve)

    from tandem.bench.cli import add_bench_parser

    add_bench_parser(sub)
    from tandem.train.cli import add_train_parser

    add_train_parser(sub)

    from tandem.advise import add_advise_parser

    add_advise_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"tandem: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
