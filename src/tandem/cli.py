"""`tandem` command line: generate, serve, bench, audit, train, advise."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from tandem.advise import add_advise_parser
from tandem.audit import run_audit
from tandem.bench.cli import add_bench_parser
from tandem.config import NO_SPECULATION
from tandem.flags import (
    add_model_args,
    add_sampling_args,
    add_spec_args,
    add_structured_output_args,
    flag_message,
    sampling_from_args,
    spec_from_args,
)
from tandem.launch_server import add_serve_args, run_serve
from tandem.llm import LLM
from tandem.train.cli import add_train_parser

DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."
AUDIT_INCONCLUSIVE = 3  # tandem audit's exit status when no check ran or no round drafted (2 is argparse's)


def llm_from_args(args):
    return LLM(
        args.model, dtype=args.dtype, quantization=args.quantization, device=args.device,
        max_model_len=args.max_model_len, threads=args.threads, kv_cache_dtype=args.kv_cache_dtype,
        spec=spec_from_args(args, args.speculative_algorithm),
    )


def _prompts_of(args) -> list[str] | None:
    """--prompt, else stdin's lines (a prompt each) where stdin is not a terminal; None on a
    terminal (the interactive loop; --json's example prompt)."""
    if args.prompt is not None:
        return [args.prompt]
    if sys.stdin.isatty():
        return None
    prompts = [line.strip() for line in sys.stdin if line.strip()]
    if not prompts:
        raise ValueError("no prompt: stdin held none (one prompt per line); give one, or --prompt TEXT")
    return prompts


def cmd_generate(args) -> int:
    params = sampling_from_args(args)
    prompts = _prompts_of(args)
    llm = llm_from_args(args)
    if params.structured_output is not None:  # compiled once here, so tokens/s times decoding alone
        llm.engine.grammars.check(params.structured_output)
    if args.json:  # a JSON object per prompt
        for prompt in prompts or [DEFAULT_PROMPT]:
            t0 = time.perf_counter()
            out = llm.generate(prompt, params, chat=args.chat)[0]
            seconds = time.perf_counter() - t0
            record = {
                "text": out.text,
                "token_ids": out.token_ids,
                "finish_reason": out.finish_reason,
                "usage": {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids)},
                "timing": {"seconds": round(seconds, 4),
                           "tokens_per_second": round(len(out.token_ids) / seconds, 2)},
            }
            if llm.config.spec.algorithm:
                record["spec"] = out.spec.as_dict()
            print(json.dumps(record), flush=True)
        return 0
    interactive = prompts is None
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
            line += f"; finish: {out.finish_reason}"
            room = llm.config.max_model_len - len(out.prompt_token_ids)
            if params.max_tokens > room:
                line += (f" (--max-new-tokens {params.max_tokens}: the context of {llm.config.max_model_len} tokens "
                         f"left room for {room})")
            print(line + "]", file=sys.stderr, flush=True)
        if not interactive:
            return 0


def cmd_audit(args) -> int:
    if not args.speculative_algorithm or args.speculative_algorithm.lower() in NO_SPECULATION:
        raise ValueError("audit needs a drafter: --speculative-algorithm NAME")
    params = sampling_from_args(args)
    llm = llm_from_args(args)
    prompt_ids = llm.encode(args.prompt, chat=args.chat)
    report = run_audit(llm.engine, prompt_ids, params, rounds=args.rounds, alpha=args.alpha, seed=args.seed or 0)
    print(report.render())
    return {"pass": 0, "fail": 1, "inconclusive": AUDIT_INCONCLUSIVE}[report.verdict]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Lossless speculative decoding engine")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text (streams; --json: a JSON object per prompt)")
    add_model_args(gen)
    add_spec_args(gen)
    add_sampling_args(gen)
    add_structured_output_args(gen)
    gen.add_argument("--prompt", default=None, help="prompt text (default: read stdin / interactive)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object per prompt (--prompt, or each line of stdin), a line each")
    gen.set_defaults(func=cmd_generate)

    audit = sub.add_parser("audit", help="prove losslessness of a target + drafter statistically (exit 1 on failure, "
                                         f"{AUDIT_INCONCLUSIVE} when nothing speculative could be tested)")
    add_model_args(audit)
    add_spec_args(audit)
    add_sampling_args(audit, temperature=1.0)
    audit.add_argument("--prompt", default="Write a short story about a robot who learns to paint.")
    audit.add_argument("--chat", action="store_true")
    audit.add_argument("--rounds", type=int, default=4000,
                       help="independent speculative rounds of a sampled audit (greedy: one generation of "
                            "--max-new-tokens, compared with plain decoding)")
    audit.add_argument("--alpha", type=float, default=1e-3, help="family-wise significance level")
    audit.set_defaults(func=cmd_audit)

    serve = sub.add_parser("serve", help="OpenAI-compatible server with continuous batching and adaptive speculation")
    add_serve_args(serve)
    serve.set_defaults(func=run_serve)

    add_bench_parser(sub)
    add_train_parser(sub)
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
        print(f"tandem: error: {flag_message(str(err))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tandem: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
