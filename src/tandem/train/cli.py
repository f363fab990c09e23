"""`tandem train`: prompts -> self-distilled answers -> captured hidden states -> a trained head in --out
(for --method suffix: the answers themselves, as suffix decoding's corpus).

Every stage is cached under --data-dir and resumable, so the command can be stopped and rerun
(with --resume for the optimisation) across sessions.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch

from tandem.config import DEVICES, DTYPES, QUANTIZATIONS, SpecConfig
from tandem.drafters.corpus import DEFAULT_CORPUS_TOKENS
from tandem.drafters.heads.base import TargetParts, head_methods
from tandem.drafters.heads.draft_model import llama_export_problem
from tandem.drafters.heads.io import (TARGET_SHAPES, build_head, check_target_shapes, load_head, read_head_config,
                                      save_head, shape_differences, with_article)
from tandem.flags import at_least
from tandem.llm import LLM, configure_threads
from tandem.model.catalogue import DEFAULT_MODEL
from tandem.model.loader import LoadedModel, load_model, model_config
from tandem.paths import cache_root
from tandem.train.capture import CapturedData, capture_in_memory, engine_forward_factory, sequences, write_captures
from tandem.train.data import DistillConfig, PromptSplit, distill, load_prompts
from tandem.train.hf_backend import distill_hf, hf_forward_factory, load_hf_target
from tandem.train.suffix_corpus import export_corpus
from tandem.train.trainer import (CHECKPOINT, CHECKPOINT_INFO, PRECISIONS, TrainConfig, TrainResult, auto_precision,
                                  calibrate, fit_eval_k, train)

log = logging.getLogger("tandem.train")

RECORD = "training_record.json"


def default_prompt_files() -> list[Path]:
    """The training prompt sets shipped with tandem (see src/tandem/data/SOURCES.md)."""
    return sorted((Path(__file__).resolve().parents[1] / "data" / "train").glob("*.json*"))


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default, unless it has none or its help already says what it is."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a draft head (medusa, eagle, eagle3, mtp, draft_model, dflash, dspark) or a suffix corpus for a target",
                       formatter_class=_DefaultsFormatter)
    p.add_argument("--target", default=DEFAULT_MODEL, help="the target model (built-in name, HF directory or .gguf)")
    p.add_argument("--method", required=True,
                   help="draft-head method (medusa, eagle, eagle3, mtp, draft_model, dflash, dspark), or suffix: "
                        "a corpus of the target's answers for suffix decoding")
    p.add_argument("--prompts", nargs="+", default=None,
                   help="prompt files (.json/.jsonl: turns, question, instruction/input, prompt, or JSON strings); "
                        "default: the training sets shipped in tandem/data/train")
    p.add_argument("--out", required=True, help="directory for checkpoints, metrics and the exported head")
    _add_data_args(p)
    _add_optimisation_args(p)
    _add_capture_args(p)
    _add_method_args(p)
    p.set_defaults(func=cmd_train)


def _check_directory(flag: str, path: Path) -> None:
    """Refuse, before anything runs, a directory flag naming a file, a path below a file, or a
    place this user cannot write (a run must not fail after an hour of training). Creates nothing."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file, not a directory")
    existing = next(parent for parent in (path, *path.absolute().parents) if parent.exists())
    if not existing.is_dir():
        raise ValueError(f"{flag} {path} lies below {existing}, which is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path} cannot be written: {existing} is not writable")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    """The self-distillation stage: which prompts, how the target answers them, where they are cached."""
    p.add_argument("--data-dir", default=None,
                   help="cache of answers and hidden states (default: $TANDEM_CACHE_DIR/train/<target>)")
    p.add_argument("--num-prompts", type=int, default=1000, help="training prompts (after the held-out ones)")
    p.add_argument("--held-out", type=int, default=48, help="prompts kept out of training for evaluation")
    p.add_argument("--max-new-tokens", type=int, default=160, help="length bound of the target's answers")
    p.add_argument("--temperature", type=float, default=0.0, help="temperature of the target's answers (0 = greedy)")
    p.add_argument("--generation-batch", type=int, default=None,
                   help="prompts answered together (default: 32 on the engine, 256 on transformers)")
    p.add_argument("--backend", default="auto", choices=("auto", "tandem", "transformers"),
                   help="what runs the target in the data stages: tandem's engine, or a padded transformers "
                        "batch (greedy only; built for GPUs); auto: transformers on cuda, else tandem")
    p.add_argument("--max-data-minutes", type=float, default=None,
                   help="stop answering new training prompts after this long and train on those answered "
                        "(a rerun continues; 0 = only answers already cached)")
    p.add_argument("--data-only", action="store_true",
                   help="stop after the answers and hidden states are cached (e.g. to train several heads on them)")


def _add_optimisation_args(p: argparse.ArgumentParser) -> None:
    """The optimisation: steps, batches, learning rate, evaluation, checkpoints, and where to start from."""
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--max-minutes", type=float, default=None, help="wall-time budget of this run (then checkpoint)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per optimiser step")
    p.add_argument("--precision", default="auto", choices=("auto",) + PRECISIONS,
                   help="bf16-mixed: the loss under bfloat16 autocast, weights and optimiser state in float32; "
                        "auto: bf16-mixed on a CPU with AMX bf16, float32 elsewhere")
    p.add_argument("--max-prompt-context", type=int, default=128,
                   help="prompt tokens kept before each answer in training batches (the loss is on answers; "
                        "long prompts would pad every row of their batch); 0 = the whole prompt")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 5%% of --steps")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--eval-k", type=int, default=5,
                   help="draft positions scored by the held-out evaluation (at most what the head drafts: medusa's "
                        "heads, mtp's modules, a block's drafts)")
    p.add_argument("--resume", action="store_true", help="continue from --out/checkpoint.pt")
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from the weights (and options) of an exported head of the same method and target, "
                        "e.g. a shipped one, instead of a fresh head: fine-tuning on new prompts")


def _add_capture_args(p: argparse.ArgumentParser) -> None:
    """Where training runs, how the hidden states are captured, and the exported weights' dtype."""
    p.add_argument("--device", default="cpu", choices=DEVICES)
    p.add_argument("--capture-quantization", default="auto", choices=QUANTIZATIONS,
                   help="target weights for the capture forwards (answers always come from the serving configuration; "
                        "none: a dense copy of the same weights; on a CPU the block kernels are faster)")
    p.add_argument("--capture-dtype", default="auto", choices=("auto",) + DTYPES, help="activation dtype of the capture")
    p.add_argument("--capture-in-memory", action="store_true",
                   help="keep the hidden states in --device memory instead of disk shards (recomputed by every run; "
                        "for a GPU with room for tokens x layers x hidden x 2 bytes); --data-only then caches the "
                        "answers only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=at_least(1), default=None,
                   help="CPU threads of every stage (default: all cores); give two runs side by side 1 each")
    p.add_argument("--corpus-tokens", type=int, default=DEFAULT_CORPUS_TOKENS,
                   help="--method suffix: the answer tokens the corpus keeps (the first training answers)")
    p.add_argument("--capture-layers", type=int, nargs="*", default=[],
                   help="extra target layers to store with the head's (one capture can then serve other methods)")
    p.add_argument("--export-dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="dtype of the exported weights (bfloat16 halves the file)")


def _add_method_args(p: argparse.ArgumentParser) -> None:
    """Options of the head's constructor, named or KEY=VALUE."""
    g = p.add_argument_group("method options (passed to the head; see docs/training.md)")
    g.add_argument("--num-heads", type=int, default=None, help="medusa heads")
    g.add_argument("--depth", type=int, default=None, help="mtp modules (draft positions)")
    g.add_argument("--draft-vocab-size", type=int, default=None,
                   help="eagle3, dflash and dspark reduced draft vocabulary: the most frequent ids of the training "
                        "answers")
    g.add_argument("--num-layers", type=int, default=None, help="draft_model decoder layers")
    g.add_argument("--head-option", action="append", default=[], metavar="KEY=VALUE",
                   help="any other constructor option of the head (VALUE parsed as JSON when it parses)")


def method_options(args) -> dict:
    named = (("num_heads", args.num_heads), ("depth", args.depth), ("draft_vocab_size", args.draft_vocab_size),
             ("num_layers", args.num_layers))
    options = {k: v for k, v in named if v is not None}
    for item in args.head_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--head-option takes KEY=VALUE, got {item!r}")
        try:
            options[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            options[key.replace("-", "_")] = value
    return options


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(name).name) or "model"


def _data_dir(args, target_name: str) -> Path:
    return Path(args.data_dir) if args.data_dir else cache_root() / "train" / _slug(target_name)


def _capture_plan(answers_dir: Path, needed: tuple[int, ...], extra: list[int]) -> tuple[Path, tuple[int, ...]]:
    """(directory, layers) of the capture to use: an existing one holding every needed layer,
    else a new one for the needed + extra layers."""
    for meta in sorted(answers_dir.glob("capture-*/train/meta.json")):
        have = tuple(json.loads(meta.read_text())["layers"])
        if set(needed) <= set(have):
            return meta.parent.parent, have
    layers = tuple(sorted(set(needed) | set(extra)))
    return answers_dir / ("capture-" + "_".join(map(str, layers))), layers


def cmd_train(args) -> int:
    t_start = time.perf_counter()
    cfg = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps, eval_every=args.eval_every, checkpoint_every=args.checkpoint_every,
        eval_k=args.eval_k, max_minutes=args.max_minutes, seed=args.seed, device=args.device,
        precision=auto_precision(args.device) if args.precision == "auto" else args.precision,
    )
    options = method_options(args)
    backend = _check_train_args(args, options)
    configure_threads(args.threads)
    files = [Path(f) for f in args.prompts] if args.prompts else default_prompt_files()
    split = load_prompts(files, num_prompts=args.num_prompts, held_out=args.held_out, seed=args.seed)
    deadline = None if args.max_data_minutes is None else time.monotonic() + 60 * args.max_data_minutes

    # 1. Self-distillation: the target answers the prompts (the held-out ones first, always all of them).
    answer = _distill_tandem if backend == "tandem" else _distill_transformers
    loaded, forward_model, dcfg, answers_dir, held_records, train_records = answer(args, split, deadline)
    if not train_records:
        raise ValueError("no training prompt is answered yet; raise --max-data-minutes")
    if args.method == "suffix":  # a corpus, not a head: nothing to capture or optimise
        return _export_suffix_corpus(args, loaded.name, loaded.config.vocab_size, files, split, dcfg,
                                     train_records, held_records, t_start)

    # 2. The head, and the hidden states it needs.
    torch.manual_seed(args.seed)
    target = TargetParts.from_loaded(loaded)
    head = _initial_head(args, target, loaded, options, train_records)
    cfg = fit_eval_k(cfg, head)
    layers = tuple(head.hidden_layers)
    hidden = _hidden_states(args, loaded.name, forward_model, answers_dir, train_records, held_records, layers)
    del forward_model  # a transformers copy gives its memory back before training
    if hidden is None:  # --data-only
        return 0
    data, held, capture_setting = hidden

    # 3. Optimise, evaluate, export. SIGTERM (a scheduler's stop) ends it as Ctrl-C does.
    terminated = []

    def on_sigterm(signum, frame):
        terminated.append(signum)
        raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if main_thread else None
    try:
        result = train(head, target, data, held, cfg, args.out, resume=args.resume, eval_first=bool(args.init_from))
    except KeyboardInterrupt:
        kept = (Path(args.out) / CHECKPOINT).exists()
        print(f"tandem train: {'terminated' if terminated else 'interrupted'}; "
              + (f"{Path(args.out) / CHECKPOINT} keeps the last checkpoint{_checkpoint_step(args.out)}: --resume "
                 "continues from it" if kept else "no checkpoint was written yet"), file=sys.stderr)
        return 143 if terminated else 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    calibration = calibrate(head, target, held, cfg.device, cfg.batch_size)
    record = {
        "target": loaded.name,
        "method": args.method,
        "method_options": head.config_dict() if args.init_from else options,  # a fine-tuned head keeps its own
        "data": {
            "prompt_files": [f.name for f in files],
            "train_prompts": len(train_records),
            "held_out_prompts": len(split.held_out),
            "train_sequences": data.num_sequences,
            "train_answer_tokens": sum(len(r["answer_ids"]) for r in train_records),
            "held_out_sequences": held.num_sequences,
            "distillation": asdict(dcfg),
            "hidden_layers": list(layers),
            "capture": capture_setting,
            "chat_template": getattr(loaded.tokenizer, "chat_template", None) is not None,  # applied to the prompts
        },
        "training": {**asdict(cfg), "init_from": args.init_from, "max_prompt_context": args.max_prompt_context or None,
                     "steps_done": result.step, "finished": result.finished, "train_seconds": round(result.seconds, 1),
                     "last_loss": result.last_loss},
        "held_out": asdict(result.eval) if result.eval else None,
        **({"calibration": calibration} if calibration else {}),
        "command_seconds": round(time.perf_counter() - t_start, 1),
    }
    dtype = torch.bfloat16 if args.export_dtype == "bfloat16" else torch.float32
    save_head(head.cpu(), args.out, loaded.name, extra_record=record, dtype=dtype, tokenizer=loaded.tokenizer)
    Path(args.out, RECORD).write_text(json.dumps(record, indent=1) + "\n")
    _print_result(args, loaded.name, result, cfg.steps)
    return 0


def _export_suffix_corpus(args, target_name: str, vocab_size: int, files: list[Path], split: PromptSplit,
                          dcfg: DistillConfig, train_records: list[dict], held_records: list[dict],
                          t_start: float) -> int:
    record = {
        "target": target_name,
        "method": "suffix",
        "data": {"prompt_files": [f.name for f in files], "train_prompts": len(train_records),
                 "held_out_prompts": len(split.held_out), "distillation": asdict(dcfg)},
    }
    k = SpecConfig().num_draft_tokens
    record = export_corpus(args.out, target_name, vocab_size, train_records, held_records, args.corpus_tokens, k, record)
    record["command_seconds"] = round(time.perf_counter() - t_start, 1)
    Path(args.out, RECORD).write_text(json.dumps(record, indent=1) + "\n")
    held = record["held_out"]
    corpus = record["corpus"]
    print(f"suffix corpus for {target_name}: {corpus['answers']} answers, {corpus['tokens']} tokens; written to {args.out}")
    print(f"held-out replay ({held['with_corpus']['answers']} answers, k = {k}): tau {held['with_corpus']['tau']:.3f} "
          f"with the corpus, {held['without_corpus']['tau']:.3f} without; acceptance per position "
          + " ".join(f"{a:.3f}" for a in held["with_corpus"]["acceptance"]))
    return 0


def _check_train_args(args, options: dict) -> str:
    """Reject flag combinations that cannot work before anything is loaded; returns the backend."""
    if args.method != "suffix" and args.method not in head_methods():
        raise ValueError(f"unknown method {args.method!r}: a draft head ({', '.join(head_methods())}) or suffix "
                         "(a corpus for suffix decoding)")
    if args.max_prompt_context < 0:
        raise ValueError(f"--max-prompt-context must be >= 0 (0 = the whole prompt), got {args.max_prompt_context}")
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1 (training prompts), got {args.num_prompts}")
    if args.held_out < 1:
        raise ValueError(f"--held-out must be >= 1: the held-out answers measure the head, got {args.held_out}")
    _check_directory("--out", Path(args.out))
    if args.data_dir:
        _check_directory("--data-dir", Path(args.data_dir))
    if args.resume and not (Path(args.out) / CHECKPOINT).exists():
        raise FileNotFoundError(f"--resume: no checkpoint at {Path(args.out) / CHECKPOINT}; start without --resume")
    if args.resume:
        _check_resumable(args)
    if args.method == "draft_model":  # its export needs a llama-like target: known before any answering
        problem = llama_export_problem(model_config(args.target))
        if problem:
            raise ValueError(problem)
    if args.method == "suffix" and (args.init_from or args.resume or args.capture_in_memory):
        raise ValueError("--method suffix writes a corpus of answers: there is no head to --init-from, --resume "
                         "or capture for")
    if args.corpus_tokens < 1:
        raise ValueError(f"--corpus-tokens must be >= 1, got {args.corpus_tokens}")
    if args.init_from:
        record = read_head_config(args.init_from)  # also: a clear error when there is no head
        if record["method"] != args.method:
            raise ValueError(f"--init-from {args.init_from} holds {with_article(record['method'])} head, "
                             f"not {args.method}")
        # before any answering: a head for another target is refused from the target's config
        check_target_shapes(record, model_config(args.target), args.target, args.init_from)
        if options:
            raise ValueError(f"--init-from {args.init_from}: the head keeps its own options; drop {sorted(options)}")
    if args.max_data_minutes is not None and args.max_data_minutes < 0:
        raise ValueError(f"--max-data-minutes must be >= 0, got {args.max_data_minutes}")
    backend = args.backend if args.backend != "auto" else ("transformers" if args.device == "cuda" else "tandem")
    if backend == "transformers" and args.temperature != 0:
        raise ValueError("--backend transformers answers greedily only; use --backend tandem for --temperature > 0")
    if backend == "transformers" and (args.capture_quantization, args.capture_dtype) != ("auto", "auto"):
        raise ValueError("--capture-quantization / --capture-dtype set the tandem backend's capture; "
                         "the transformers backend always runs the dense float32 weights")
    if not args.resume and not args.data_only and (Path(args.out) / CHECKPOINT).exists():
        raise ValueError(f"--out {args.out} holds a run already ({CHECKPOINT}): continue it with --resume, or "
                         "give another --out (or remove that directory) to start afresh")
    return backend


def _checkpoint_info(out: str) -> dict | None:
    """--out's checkpoint.json (method, target, step), None where there is none or it is damaged."""
    try:
        info = json.loads((Path(out) / CHECKPOINT_INFO).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _checkpoint_step(out: str) -> str:
    """' (step N)' from the checkpoint's info file, '' where it cannot be read."""
    step = (_checkpoint_info(out) or {}).get("step")
    return f" (step {step})" if isinstance(step, int) else ""


def _check_resumable(args) -> None:
    """Before any answering: a checkpoint of another method or for another target (from the
    target's config alone) cannot be resumed. The checkpoint itself is checked again on loading
    (trainer._resume), also for head options."""
    try:
        info = _checkpoint_info(args.out)
        method, want = info["method"], {k: info["target"][k] for k in ("model_name", *TARGET_SHAPES)}
    except (KeyError, TypeError):  # none (a run from before it) or damaged: _resume checks
        return
    if method != args.method:
        raise ValueError(f"--resume: {args.out} holds {with_article(method)} run, not {args.method}; resume it with "
                         f"--method {method}, or train into another --out")
    diffs = shape_differences(want, model_config(args.target))
    if diffs:
        raise ValueError(f"--resume: {args.out} trains a head for {want['model_name']!r}, not for {args.target} "
                         f"({'; '.join(diffs)}); resume with --target {want['model_name']}, or train into another "
                         "--out")


def _distill_tandem(args, split: PromptSplit, deadline: float | None):
    """Answers from tandem's engine, in the serving configuration: the distribution drafts are
    verified against. Returns (loaded target, the model of the capture forwards, distillation
    config, answers directory, held-out records, training records)."""
    batch = args.generation_batch or 32
    llm = LLM(args.target, device=args.device, max_num_seqs=batch, max_model_len=1024, threads=args.threads)
    loaded = llm.loaded
    dcfg = DistillConfig(target=loaded.name, quantization=loaded.quantization, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, seed=args.seed)
    answers_dir = _data_dir(args, loaded.name) / f"answers-t{args.temperature:g}-n{args.max_new_tokens}-s{args.seed}"
    held_records = distill(llm, split.held_out, answers_dir, dcfg, shard_size=batch)
    train_records = distill(llm, split.train, answers_dir, dcfg, shard_size=batch, deadline=deadline)
    del llm  # frees the engine's KV cache
    forward_model = loaded  # runs the capture forwards
    if (args.capture_quantization, args.capture_dtype) != ("auto", "auto"):
        forward_model = load_model(args.target, dtype=args.capture_dtype, quantization=args.capture_quantization,
                                   device=args.device)
    return loaded, forward_model, dcfg, answers_dir, held_records, train_records


def _distill_transformers(args, split: PromptSplit, deadline: float | None):
    """Answers from the same weights, dense float32, through transformers; returns what
    _distill_tandem returns (the capture forwards run the transformers model)."""
    batch = args.generation_batch or 256
    loaded = load_model(args.target, dtype="float32", quantization="none", device="cpu")
    forward_model, hf_tokenizer = load_hf_target(args.target, args.device)
    eos = set(loaded.config.eos_token_ids) | ({hf_tokenizer.eos_token_id} if hf_tokenizer.eos_token_id is not None else set())
    dcfg = DistillConfig(target=loaded.name, quantization="transformers-float32", max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, seed=args.seed)
    answers_dir = _data_dir(args, loaded.name) / f"answers-transformers-t0-n{args.max_new_tokens}-s{args.seed}"
    held_records = distill_hf(forward_model, hf_tokenizer, eos, split.held_out, answers_dir, dcfg, batch_size=batch)
    train_records = distill_hf(forward_model, hf_tokenizer, eos, split.train, answers_dir, dcfg, batch_size=batch,
                               deadline=deadline)
    return loaded, forward_model, dcfg, answers_dir, held_records, train_records


def _initial_head(args, target: TargetParts, loaded: LoadedModel, options: dict, train_records: list[dict]):
    """The head to train: an exported one (--init-from), or a fresh one with the method options."""
    if args.init_from:
        return load_head(args.init_from, target).train()
    build_options = dict(options)
    if "draft_vocab_size" in options:  # the reduced vocabulary = the most frequent answer tokens
        V = loaded.config.vocab_size
        counts = torch.zeros(V)
        for r in train_records:
            counts += torch.bincount(torch.tensor(r["answer_ids"], dtype=torch.long), minlength=V)[:V]
        build_options["token_counts"] = counts
    try:
        return build_head(args.method, target, **build_options)
    except TypeError as err:
        raise ValueError(f"--method {args.method} does not take options {sorted(options)}: {err}") from err


def _print_result(args, target_name: str, result: TrainResult, steps: int) -> None:
    ev = result.eval
    state = "finished" if result.finished else f"stopped at step {result.step}/{steps} (continue with --resume)"
    if result.step > steps:  # resumed with a smaller --steps: nothing more was trained
        state = f"finished (the checkpoint had {result.step} steps, more than --steps {steps}: none were added)"
    print(f"{args.method} head for {target_name}: {state}; exported to {args.out}")
    if ev is not None:
        print(f"held-out ({ev.positions} positions): tau {ev.tau:.3f} (engine-like chain tau {ev.chain_tau:.3f}), "
              "acceptance per position "
              + " ".join(f"{a:.3f}" for a in ev.acceptance))


def _hidden_states(args, target_name: str, model, answers_dir: Path, train_records: list[dict],
                   held_records: list[dict], layers: tuple[int, ...]):
    """The target's hidden states over the answered sequences: (train data, held-out data, capture
    setting), or None when --data-only stops after caching them. model: a tandem LoadedModel (the
    engine backend) or a transformers causal LM."""
    if isinstance(model, LoadedModel):  # the engine: few sequences per forward suit a CPU
        batch, num_layers = 8, model.config.num_layers
        factory = engine_forward_factory(model, batch)
        setting = {"quantization": model.quantization, "dtype": str(model.dtype).removeprefix("torch.")}
    else:
        batch, num_layers = 32, len(model.model.layers)
        factory = hf_forward_factory(model)
        setting = {"quantization": "transformers", "dtype": "float32"}
    context = args.max_prompt_context or None
    train_seqs, held_seqs = sequences(train_records), sequences(held_records)
    if args.capture_in_memory:
        if args.data_only:
            print(f"answers for {target_name} cached in {answers_dir}: {len(train_records)} training and "
                  f"{len(held_records)} held-out (hidden states are captured in memory by each training run)")
            return None
        data = capture_in_memory(factory, train_seqs, layers, args.device, context, batch_size=batch,
                                 desc="capture (train)")
        held = capture_in_memory(factory, held_seqs, layers, args.device, context, batch_size=batch,
                                 desc="capture (held out)")
        return data, held, {**setting, "stored": "memory"}
    cap_dir, cap_layers = _capture_plan(answers_dir, layers, args.capture_layers)
    train_paths = write_captures(target_name, num_layers, factory, train_seqs, cap_dir / "train", cap_layers,
                                 batch_size=batch, desc="capture (train)")
    held_paths = write_captures(target_name, num_layers, factory, held_seqs, cap_dir / "held_out", cap_layers,
                                batch_size=batch, desc="capture (held out)")
    if args.data_only:
        print(f"data for {target_name} cached in {cap_dir.parent}: {len(train_records)} training and "
              f"{len(held_records)} held-out answers, hidden layers {list(cap_layers)}")
        return None
    data, held = CapturedData(train_paths, layers, context), CapturedData(held_paths, layers, context)
    if args.device == "cuda":  # batches are assembled on the GPU
        data, held = data.to_device("cuda"), held.to_device("cuda")
    return data, held, {**setting, "stored": "disk"}
