"""The command-line flags `tandem generate`, `audit` and `serve` share (SGLang's names), built in
one place so their defaults and help live once."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tandem.config import (
    KV_CACHE_ALIASES,
    KV_CACHE_DTYPES,
    NO_SPECULATION,
    QUANTIZATIONS,
    SPEC_POLICIES,
    SamplingParams,
    SpecConfig,
    StructuredOutput,
)
from tandem.model.catalogue import DEFAULT_MODEL
from tandem.paths import read_user_text


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "--model-path", dest="model", default=DEFAULT_MODEL,
                   help="built-in name (smollm2-135m-instruct, gemma3-270m), HF directory or .gguf file")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="activation dtype (auto: float32 on CPU, except bfloat16 where torch's int4/int8 kernels "
                        "serve the weights; bfloat16 on CUDA)")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                   help="auto: the GGUF's own 4-bit blocks on CPU; none: dense float weights")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-dtype", default="auto", choices=[*KV_CACHE_DTYPES, *KV_CACHE_ALIASES],
                   help="what the KV cache stores (auto: fp16 where tandem's fused CPU kernels run the model, "
                        "else fp32 on CPU)")
    p.add_argument("--threads", type=at_least(1), default=None,
                   help="torch and kernel threads (default: all cores; tandem serve: all but one)")


def add_spec_args(p: argparse.ArgumentParser,
                  algorithm_help: str = "drafter name (e.g. ngram, suffix)") -> None:
    p.add_argument("--speculative-algorithm", default=None, help=algorithm_help)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=4,
                   help="draft tokens per round: a chain's length, a tree's node count (root not counted)")
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--speculative-num-steps", type=int, default=None,
                   help="draft depth (chains draft min(steps, draft tokens); trees default to 5); SGLang's flag")
    p.add_argument("--speculative-eagle-topk", type=int, default=1,
                   help="1: chain drafts; > 1: eagle/eagle3 draft EAGLE-2 trees with this many children per "
                        "expanded node and this many nodes expanded per depth")
    p.add_argument("--speculative-lookup", "--speculative-tree-lookup", dest="speculative_lookup",
                   action=argparse.BooleanOptionalAction, default=True,
                   help="eagle/eagle3/dflash/dspark also ask the suffix lookup (copies from the context): an "
                        "EAGLE tree grafts its draft on as a branch, a chain or block uses it instead of the "
                        "head's whenever it has one")
    p.add_argument("--speculative-corpus", dest="speculative_corpus", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="suffix decoding (and the lookup) also match the context against a corpus of the "
                        "target's own answers: the one tandem ships for the model, or for suffix the "
                        "--speculative-draft-model-path directory made by `tandem train --method suffix`")
    p.add_argument("--speculative-policy", default=None, choices=SPEC_POLICIES,
                   help="fixed: always --speculative-num-draft-tokens (default of generate and audit); adaptive "
                        "(default of serve): the draft length per request per step from load, cost curve and "
                        "acceptance; confidence (dspark's default everywhere): the verified prefixes admitted "
                        "across the batch from the drafter's calibrated confidences and the cost curve")
    p.add_argument("--speculative-min-survival", type=float, default=0.0,
                   help="cut a chain where the product of its drafter's confidences falls below this "
                        "(drafters that report confidences; 0: never)")


# Settings the command line sets from a flag of another name (the library's field names).
FIELD_FLAGS = {"max_num_seqs": "--max-running-requests", "drain_timeout_s": "--drain-timeout",
               "request_read_timeout_s": "--request-read-timeout", "max_tokens": "--max-new-tokens",
               "min_tokens": "--min-new-tokens"}


def flag_message(message: str) -> str:
    """An error about a setting, naming the flag that sets it where it starts with the setting's
    field name (max_model_len -> --max-model-len, max_num_seqs -> --max-running-requests)."""
    field, _, rest = message.partition(" ")
    if not field.isidentifier() or not rest.startswith("must"):
        return message
    return FIELD_FLAGS.get(field, "--" + field.replace("_", "-")) + " " + rest


def at_least(minimum: int):
    """An argparse type: an integer >= minimum (a bad value is refused while parsing, before any
    model loads or server starts)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def number_in(low: float, high: float, low_open: bool = False):
    """An argparse type: a finite number in [low, high] ((low, high] where low_open)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (low < value <= high if low_open else low <= value <= high):
            raise argparse.ArgumentTypeError(f"must be in {'(' if low_open else '['}{low:g}, {high:g}], got {text}")
        return value

    parse.__name__ = "number"
    return parse


def add_sampling_args(p: argparse.ArgumentParser, temperature: float = 0.0) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--min-new-tokens", type=int, default=0,
                   help="EOS cannot end the answer, nor a stop string, before this many tokens (vLLM's min_tokens)")
    p.add_argument("--temperature", type=float, default=temperature, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, over generated tokens, in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, over generated tokens, in [-2, 2]")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def add_structured_output_args(p: argparse.ArgumentParser) -> None:
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", default=None, metavar="FILE_OR_JSON",
                       help="the output must be JSON matching this schema (a file, or the schema's JSON text)")
    shape.add_argument("--json-object", action="store_true", help="the output must be a JSON object")
    shape.add_argument("--regex", default=None, help="the output must match this regular expression")
    shape.add_argument("--choice", action="append", default=None, help="the output must be one of these strings "
                                                                       "(repeatable)")
    shape.add_argument("--grammar", default=None, metavar="FILE", help="the output must match this Lark grammar")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, max_tokens=args.max_new_tokens, min_tokens=args.min_new_tokens,
        seed=args.seed, stop=tuple(args.stop), structured_output=structured_output_from_args(args),
    )


def structured_output_from_args(args: argparse.Namespace) -> StructuredOutput | None:
    """--json-schema / --json-object / --regex / --choice / --grammar, or None (also for a
    command without them)."""
    if not hasattr(args, "json_object"):
        return None
    if args.json_schema is not None:
        path = Path(args.json_schema)
        if path.is_file():
            text = read_user_text(path, "--json-schema")
            try:
                json.loads(text)
            except ValueError as err:
                raise ValueError(f"--json-schema {path}: the file is not JSON ({err})") from None
            return StructuredOutput(json=text)
        if not args.json_schema.lstrip().startswith("{"):
            raise ValueError(f"--json-schema {args.json_schema!r}: no such file, and not a JSON schema's text")
        return StructuredOutput(json=args.json_schema)
    if args.json_object:
        return StructuredOutput(json_object=True)
    if args.regex is not None:
        return StructuredOutput(regex=args.regex)
    if args.choice:
        return StructuredOutput(choice=tuple(args.choice))
    if args.grammar is not None:
        return StructuredOutput(grammar=read_user_text(args.grammar, "--grammar"))
    return None


def drafter_policy(algorithm: str | None) -> str | None:
    """The policy a drafter names for itself when --speculative-policy is not given
    (Drafter.serving_policy), or None."""
    if not algorithm:
        return None
    from tandem.drafters import (
        registry,  # the full table: importing tandem.drafters fills it
    )

    return getattr(registry.lookup(algorithm, "drafter"), "serving_policy", None)


def spec_from_args(args: argparse.Namespace, algorithm: str | None, default_policy: str | None = None) -> SpecConfig:
    """The --speculative-* flags as the SpecConfig of `algorithm` (None, none or off: no
    speculation). An unset --speculative-policy becomes the drafter's own (drafter_policy), else
    `default_policy` (None: SpecConfig's)."""
    if algorithm is not None and algorithm.lower() in NO_SPECULATION:
        algorithm = None  # before drafter_policy, which looks the drafter up
    if algorithm is None and getattr(args, "speculative_draft_model_path", None):
        raise ValueError("--speculative-draft-model-path names a drafter's files, and no drafter runs "
                         "(--speculative-algorithm is none or not given): drop the path, or name the drafter")
    policy = args.speculative_policy or drafter_policy(algorithm) or default_policy
    return SpecConfig.from_prefixed({**vars(args), "speculative_algorithm": algorithm, "speculative_policy": policy})
