"""`tandem bench spec`: speculative decoding Spec-Bench style, every method side by side in one run.

Rows: the Spec-Bench subtasks and overall. Configurations: tandem plain decoding (the baseline),
tandem with each drafter on the same loaded weights, and transformers `generate` (plain, prompt
lookup, assisted generation with a smaller same-tokenizer model when one exists). Batch 1, EOS may
stop a request (Spec-Bench's protocol). Each prompt runs every configuration before the next prompt
starts, so machine noise lands on all of them alike. As in Spec-Bench, tokens/s is the mean of the
per-prompt tokens/s and a speedup is the ratio of two such means.
"""

from __future__ import annotations

import gc
import logging
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable

import torch

from tandem.config import EngineConfig, SamplingParams, SpecConfig
from tandem.types import SpecStats

PLAIN = "plain"
OVERALL = "overall"
HF_PLD = "prompt_lookup"
HF_ASSISTED = "assisted"
WARMUP_TOKENS = 8
WARMUP_TEXT = "Say hello and name three colours."
DEFINITIONS = {
    "tau": "mean acceptance length: tokens committed per target forward, including the recovered/bonus "
           "token (plain decoding has tau = 1; a request's prefill counts as one forward)",
    "acceptance_rate": "accepted draft tokens / drafted tokens",
    "acceptance_per_position": "P(draft token i passes | draft tokens before it passed), over the rounds "
                               "that graded position i",
    "drafted_acceptance": "P(the drafter proposes token i and it passes | tokens before it passed, the "
                          "budget allowed i): what expected_tau(., k) needs; an empty or short draft counts "
                          "as a failure",
    "tokens_per_second": "mean over prompts of (generated tokens / wall seconds, prefill included)",
    "speedup": "tokens_per_second over that of the same engine's plain decoding on the same prompts",
}


# ---- methods -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    """A tandem drafter to benchmark: a registry name, the file it needs (if any) and its k
    (None: the run's default)."""

    algorithm: str
    draft_path: str | None = None
    num_draft_tokens: int | None = None

    @property
    def label(self) -> str:
        name = self.algorithm
        if self.draft_path:
            name += f"({os.path.basename(os.path.normpath(self.draft_path))})"
        return name if self.num_draft_tokens is None else f"{name}@k={self.num_draft_tokens}"


def parse_methods(items: list[str]) -> list[Method]:
    """`ngram`, `suffix`, `draft_model=PATH` ...: space- or comma-separated, any registered name."""
    from tandem.drafters import available_drafters

    known = available_drafters()
    methods = []
    for item in (part for text in items for part in text.split(",")):
        item = item.strip()
        if not item:
            continue
        name, _, path = item.partition("=")
        if name not in known:
            raise ValueError(f"unknown drafter {name!r} in --methods; registered: {', '.join(known)}")
        if name == PLAIN:
            raise ValueError("plain decoding is always the baseline; do not list it in --methods")
        methods.append(Method(name, path or None))
    if not methods:
        raise ValueError("--methods is empty; name at least one drafter")
    labels = [m.label for m in methods]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--methods lists a drafter twice: {', '.join(labels)}")
    return methods


def target_info(loaded):
    from tandem.drafters import TargetInfo

    eos = set(loaded.config.eos_token_ids)
    if loaded.tokenizer.eos_token_id is not None:
        eos.add(loaded.tokenizer.eos_token_id)
    return TargetInfo.of(loaded, tuple(sorted(eos)))


def default_methods(loaded) -> tuple[list[Method], dict[str, str]]:
    """Every registered drafter that can be built with no extra files (no draft path), and for the
    others the reason they were left out (their own construction error)."""
    from tandem.drafters import available_drafters, create_drafter

    target = target_info(loaded)
    usable, skipped = [], {}
    for name in available_drafters():
        try:
            create_drafter(SpecConfig(algorithm=name), target)
        except (ValueError, FileNotFoundError) as err:
            skipped[name] = str(err)
        else:
            usable.append(Method(name))
    return usable, skipped


# ---- what one run records ------------------------------------------------------------------------


@dataclass
class DraftProfile:
    """Draft accounting taken around the drafter: per draft position, how often the position was
    reachable (the budget allowed it and every earlier draft token passed) and how often a draft
    token there passed; plus the time spent proposing and the positions asked for."""

    rounds: int = 0
    requested: int = 0
    seconds: float = 0.0
    reached: list[int] = field(default_factory=list)
    passed: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # lengths[n] = rounds that drafted n tokens

    def record(self, budget: int, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.requested += budget
        _grow(self.lengths, min(drafted, budget) + 1)
        self.lengths[min(drafted, budget)] += 1
        # Worked example: budget 4, accepted 2 -> positions 0, 1, 2 were reachable, 0 and 1 passed.
        reachable = min(budget, accepted + 1)
        _grow(self.reached, budget)
        _grow(self.passed, budget)
        for i in range(reachable):
            self.reached[i] += 1
        for i in range(min(accepted, budget)):
            self.passed[i] += 1

    def merge(self, other: "DraftProfile") -> None:
        self.rounds += other.rounds
        self.requested += other.requested
        self.seconds += other.seconds
        for mine, theirs in ((self.reached, other.reached), (self.passed, other.passed), (self.lengths, other.lengths)):
            _grow(mine, len(theirs))
            for i, v in enumerate(theirs):
                mine[i] += v

    def acceptance(self, k: int | None = None) -> list[float]:
        """drafted_acceptance per position, padded with 0 to k (a position never reached has no
        evidence that the drafter ever gets there)."""
        k = len(self.reached) if k is None else k
        return [self.passed[i] / self.reached[i] if i < len(self.reached) and self.reached[i] else 0.0
                for i in range(k)]

    @property
    def seconds_per_position(self) -> float:
        """Drafter time per requested draft position (the draft cost model is linear in k)."""
        return self.seconds / self.requested if self.requested else 0.0

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "requested_positions": self.requested, "seconds": round(self.seconds, 4),
                "reached_per_position": list(self.reached), "passed_per_position": list(self.passed),
                "drafted_lengths": list(self.lengths),
                "drafted_acceptance": [round(a, 4) for a in self.acceptance()]}


def _grow(counts: list[int], n: int) -> None:
    if len(counts) < n:
        counts.extend([0] * (n - len(counts)))


class _ProbedDrafter:
    """Stands in for the engine's drafter: times `propose` and pairs each request's draft budget
    with the accepted count `observe` reports, into the current DraftProfile."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self._budgets: dict[str, int] = {}
        self.profile = DraftProfile()

    def propose(self, batch):
        t = time.perf_counter()
        drafts = self._inner.propose(batch)
        self.profile.seconds += time.perf_counter() - t
        for inp in batch:
            self._budgets[inp.request_id] = inp.max_draft_tokens
        return drafts

    def observe(self, outcomes) -> None:
        for o in outcomes:
            budget = self._budgets.pop(o.request_id, 0)
            if budget:
                self.profile.record(budget, o.num_drafted, o.num_accepted)
        self._inner.observe(outcomes)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@dataclass
class SpecCase:
    """One benchmark prompt, already chat-templated and tokenized with the target's tokenizer."""

    category: str
    prompt_ids: list[int]
    question_id: int | None = None


@dataclass
class Run:
    """One configuration on one prompt."""

    token_ids: list[int]
    seconds: float
    spec: SpecStats | None = None
    profile: DraftProfile | None = None


@dataclass
class _Config:
    name: str
    run: Callable[[list[int], int, int], Run]  # (prompt ids, max new tokens, seed) -> Run


# ---- the configurations ------------------------------------------------------------------------


def _tandem_config(name: str, loaded, method: Method | None, num_draft_tokens: int, max_model_len: int,
                   temperature: float) -> _Config:
    from tandem.llm import LLM

    if method is None:
        spec = SpecConfig(num_draft_tokens=num_draft_tokens)
    else:
        spec = SpecConfig(algorithm=method.algorithm, num_draft_tokens=method.num_draft_tokens or num_draft_tokens,
                          draft_model_path=method.draft_path)
    llm = LLM.from_loaded(loaded, EngineConfig(model=loaded.name, max_model_len=max_model_len, max_num_seqs=1, spec=spec))
    probe = None
    if llm.engine.drafter is not None:
        probe = llm.engine.drafter = _ProbedDrafter(llm.engine.drafter)

    def run(prompt_ids: list[int], max_new: int, seed: int) -> Run:
        params = SamplingParams(temperature=temperature, max_tokens=max_new, seed=seed)
        if probe is not None:
            probe.profile = DraftProfile()
        t = time.perf_counter()
        out = llm.generate(prompt_ids, params)[0]
        seconds = time.perf_counter() - t
        return Run(out.token_ids, seconds, out.spec, probe.profile if probe else None)

    return _Config(name, run)


def _hf_config(name: str, model, temperature: float, **extra) -> _Config:
    """transformers `generate` with the same sampling as tandem's (no top-k/top-p filters);
    `extra` selects prompt lookup or assisted generation."""
    if temperature > 0:
        gen = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        gen = dict(do_sample=False)
    gen.update(extra, pad_token_id=_hf_pad_id(model))

    def run(prompt_ids: list[int], max_new: int, seed: int) -> Run:
        ids = torch.tensor([prompt_ids])
        torch.manual_seed(seed)
        with torch.inference_mode():
            t = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, **gen)
            seconds = time.perf_counter() - t
        return Run([int(x) for x in out[0, ids.shape[1]:]], seconds)

    return _Config(name, run)


def _hf_pad_id(model) -> int:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    return eos[0] if isinstance(eos, (list, tuple)) else int(eos)


@dataclass
class Baselines:
    """The transformers side: its model, prompt-lookup length, and an assistant model for
    assisted generation (None, with the reason, when there is none)."""

    model: object
    pld_tokens: int = 10
    assistant: object = None
    assistant_name: str | None = None
    assistant_reason: str = ""

    def configs(self, temperature: float) -> list[_Config]:
        configs = [_hf_config(PLAIN, self.model, temperature),
                   _hf_config(HF_PLD, self.model, temperature, prompt_lookup_num_tokens=self.pld_tokens)]
        if self.assistant is not None:
            configs.append(_hf_config(HF_ASSISTED, self.model, temperature, assistant_model=self.assistant))
        return configs

    def describe(self) -> dict:
        assisted = {"model": self.assistant_name, "applicable": self.assistant is not None}
        if self.assistant is not None:
            cfg = self.assistant.generation_config
            assisted.update(num_assistant_tokens=cfg.num_assistant_tokens,
                            num_assistant_tokens_schedule=cfg.num_assistant_tokens_schedule)
        else:
            assisted["reason"] = self.assistant_reason
        return {"dtype": str(next(self.model.parameters()).dtype).replace("torch.", ""),
                "prompt_lookup_num_tokens": self.pld_tokens, "assisted": assisted}


# ---- the core -------------------------------------------------------------------------------------


def run_spec_bench(
    loaded,
    cases: list[SpecCase],
    *,
    methods: list[Method],
    num_draft_tokens: int = 4,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int = 0,
    baselines: Baselines | None = None,
    warmup_ids: list[int] | None = None,
    progress: bool = True,
) -> dict:
    """Run every configuration on every case (interleaved per case) and return the report.

    `loaded` is a LoadedModel shared by all tandem configurations (weights loaded once). Prompt i
    uses seed `seed + i` in every configuration. `warmup_ids` (default: the first case's prompt)
    warms each configuration once with a few tokens before timing; it should not be a measured
    prompt, since suffix decoding keeps earlier outputs in its global trie.
    """
    if not cases:
        raise ValueError("no prompts to benchmark")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    ks = [num_draft_tokens] + [m.num_draft_tokens for m in methods if m.num_draft_tokens]
    longest = max(len(c.prompt_ids) for c in cases + ([SpecCase("", warmup_ids)] if warmup_ids else []))
    max_model_len = max(2048, longest + max_new_tokens + max(ks) + 2)
    configs = [_tandem_config(PLAIN, loaded, None, num_draft_tokens, max_model_len, temperature)]
    configs += [_tandem_config(m.label, loaded, m, num_draft_tokens, max_model_len, temperature) for m in methods]
    hf_configs = baselines.configs(temperature) if baselines else []

    warm = warmup_ids or cases[0].prompt_ids
    for cfg in configs + hf_configs:
        cfg.run(warm, WARMUP_TOKENS, seed)
    gc.collect()

    runs: dict[str, list[Run]] = {cfg.name: [] for cfg in configs}
    hf_runs: dict[str, list[Run]] = {cfg.name: [] for cfg in hf_configs}
    from tqdm.auto import tqdm

    for i, case in enumerate(tqdm(cases, desc="prompts", unit="prompt", disable=not progress)):
        for cfg in configs:
            runs[cfg.name].append(cfg.run(case.prompt_ids, max_new_tokens, seed + i))
        for cfg in hf_configs:
            hf_runs[cfg.name].append(cfg.run(case.prompt_ids, max_new_tokens, seed + i))

    report = {
        "model": loaded.name,
        "quantization": loaded.quantization,
        "dtype": str(loaded.dtype).replace("torch.", ""),
        "temperature": temperature,
        "seed": seed,
        "num_draft_tokens": num_draft_tokens,
        "max_new_tokens": max_new_tokens,
        "num_prompts": len(cases),
        "methods": [{"label": m.label, "algorithm": m.algorithm, "draft_path": m.draft_path,
                     "num_draft_tokens": m.num_draft_tokens or num_draft_tokens} for m in methods],
        "transformers": baselines.describe() if baselines else None,
        "definitions": DEFINITIONS,
        "machine": machine_info(),
    }
    report.update(_tables(cases, runs, hf_runs, temperature))
    return report


def _summary(picked: list[Run], baseline: dict | None) -> dict:
    per_prompt = [len(r.token_ids) / r.seconds for r in picked if r.seconds > 0]
    row = {
        "tokens": sum(len(r.token_ids) for r in picked),
        "seconds": sum(r.seconds for r in picked),
        "tokens_per_second": statistics.fmean(per_prompt) if per_prompt else 0.0,
    }
    if baseline is not None:
        row["speedup"] = row["tokens_per_second"] / baseline["tokens_per_second"] if baseline["tokens_per_second"] else 0.0
    if picked and picked[0].spec is not None:
        stats = SpecStats()
        for r in picked:
            stats.merge(r.spec)
        row.update(tau=stats.mean_acceptance_length, acceptance_rate=stats.acceptance_rate,
                   acceptance_per_position=stats.acceptance_per_position,
                   accepted_per_position=list(stats.accepted_per_position), spec=stats.as_dict())
    if picked and picked[0].profile is not None:
        profile = DraftProfile()
        for r in picked:
            profile.merge(r.profile)
        row.update(drafted_acceptance=profile.acceptance(), draft_seconds=profile.seconds,
                   draft_seconds_per_position=profile.seconds_per_position, draft=profile.as_dict())
    return row


def _identity(reference: list[Run], other: list[Run], cases: list[SpecCase]) -> dict:
    """Prompts whose greedy output differs from the reference, with the first differing position."""
    diffs = []
    for i, (a, b) in enumerate(zip(reference, other)):
        if a.token_ids != b.token_ids:
            pos = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                       min(len(a.token_ids), len(b.token_ids)))
            diffs.append({"index": i, "category": cases[i].category, "question_id": cases[i].question_id,
                          "first_difference": pos, "reference_tokens": a.token_ids[pos : pos + 8],
                          "other_tokens": b.token_ids[pos : pos + 8]})
    return {"mismatches": len(diffs), "prompts": len(reference), "details": diffs}


def _tables(cases, runs, hf_runs, temperature) -> dict:
    categories = list(dict.fromkeys(c.category for c in cases))
    groups = {cat: [i for i, c in enumerate(cases) if c.category == cat] for cat in categories}
    groups[OVERALL] = list(range(len(cases)))
    table = {}
    for cat, idx in groups.items():
        plain = _summary([runs[PLAIN][i] for i in idx], None)
        row: dict = {"num_prompts": len(idx), "tandem": {PLAIN: plain}}
        for name in runs:
            if name != PLAIN:
                row["tandem"][name] = _summary([runs[name][i] for i in idx], plain)
        if hf_runs:
            hf_plain = _summary([hf_runs[PLAIN][i] for i in idx], None)
            hf_plain["vs_tandem_plain"] = hf_plain["tokens_per_second"] / plain["tokens_per_second"]
            row["transformers"] = {PLAIN: hf_plain}
            for name in hf_runs:
                if name != PLAIN:
                    row["transformers"][name] = _summary([hf_runs[name][i] for i in idx], hf_plain)
        table[cat] = row
    all_runs = {**{f"tandem {n}": r for n, r in runs.items()}, **{f"transformers {n}": r for n, r in hf_runs.items()}}
    out = {
        "categories": table,
        "prompts": [
            {"category": c.category, "question_id": c.question_id, "prompt_tokens": len(c.prompt_ids),
             "generated": {name: len(r[i].token_ids) for name, r in all_runs.items()},
             "seconds": {name: round(r[i].seconds, 4) for name, r in all_runs.items()}}
            for i, c in enumerate(cases)
        ],
    }
    # Under sampling the methods consume randomness differently, so outputs legitimately differ;
    # exactness is then `tandem audit`'s job.
    if temperature == 0:
        out["identity"] = {name: _identity(runs[PLAIN], r, cases) for name, r in runs.items() if name != PLAIN}
        out["identity_transformers"] = {name: _identity(hf_runs[PLAIN], r, cases)
                                        for name, r in hf_runs.items() if name != PLAIN}
    else:
        out["identity"] = out["identity_transformers"] = None
    return out


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


# ---- the command ----------------------------------------------------------------------------------


def load_transformers(model_name: str):
    """The float copy in tandem's cache (the GGUF dequantised once), fp32, as `bench base` uses."""
    from transformers import AutoModelForCausalLM

    from tandem.model.loader import _ensure_gguf_float_weights, _ensure_gguf_metadata, resolve_model

    src = resolve_model(model_name)
    if src.gguf_path is not None:
        _ensure_gguf_metadata(src)
        _ensure_gguf_float_weights(src)
    return AutoModelForCausalLM.from_pretrained(str(src.hf_dir), dtype=torch.float32).eval()


def _vocab(model_name: str) -> dict[str, int]:
    from transformers import AutoTokenizer

    from tandem.model.loader import _ensure_gguf_metadata, resolve_model

    src = resolve_model(model_name)
    if src.gguf_path is not None:
        _ensure_gguf_metadata(src)
    return AutoTokenizer.from_pretrained(str(src.hf_dir)).get_vocab()


def pick_assistant(model_name: str, requested: str) -> tuple[str | None, str]:
    """The assistant for transformers' assisted generation: `requested` if given, or with `auto` a
    built-in model with a smaller GGUF and the target's exact tokenizer. (None, why) if there is none."""
    from tandem.model.loader import BUILTIN_MODELS, resolve_model

    if requested == "none":
        return None, "disabled with --hf-assistant none"
    if requested != "auto":
        return requested, ""
    if model_name not in BUILTIN_MODELS:
        return None, (f"{model_name} is not a built-in model, so no smaller same-tokenizer model is known; "
                      "pass --hf-assistant PATH")
    size = resolve_model(model_name).gguf_path.stat().st_size
    smaller = [n for n in BUILTIN_MODELS if n != model_name and resolve_model(n).gguf_path.stat().st_size < size]
    if not smaller:
        return None, (f"no built-in model is smaller than {model_name} (the others: "
                      f"{', '.join(n for n in BUILTIN_MODELS if n != model_name)}); assisted generation needs a "
                      "smaller model with the same tokenizer: pass --hf-assistant PATH")
    vocab = _vocab(model_name)
    same = [n for n in smaller if _vocab(n) == vocab]
    if not same:
        return None, (f"the smaller built-in models ({', '.join(smaller)}) use another tokenizer than {model_name}; "
                      "assisted generation needs the same tokenizer: pass --hf-assistant PATH")
    return same[0], ""


def bench_spec(args) -> dict:
    from tandem.bench.prompts import spec_bench_prompts
    from tandem.llm import LLM
    from tandem.model.loader import load_model

    if args.limit < 1:
        raise ValueError(f"--limit must be >= 1 (prompts per subtask), got {args.limit}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    methods = parse_methods(args.methods) if args.methods else None
    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype=args.dtype, quantization=args.quantization)
    skipped: dict[str, str] = {}
    if methods is None:
        methods, skipped = default_methods(loaded)
    # Encoding only: LLM.encode applies the chat template exactly as `generate(chat=True)` does.
    encoder = LLM.from_loaded(loaded, EngineConfig(model=loaded.name, max_num_seqs=1))
    chat = loaded.tokenizer.chat_template is not None
    prompts = spec_bench_prompts(per_category=args.limit, categories=args.categories)
    cases = [SpecCase(p.category, encoder.encode(p.text, chat=chat), p.question_id) for p in prompts]
    warmup_ids = encoder.encode(WARMUP_TEXT, chat=chat)
    del encoder
    baselines = None
    if not args.skip_transformers:
        baselines = Baselines(load_transformers(args.model), args.hf_pld_tokens)
        name, why = pick_assistant(args.model, args.hf_assistant)
        if name is not None:
            baselines.assistant, baselines.assistant_name = load_transformers(name), name
        baselines.assistant_reason = why
    mode = "greedy" if args.temperature == 0 else f"temperature {args.temperature}, seeded"
    print(f"{len(cases)} Spec-Bench prompts ({args.limit} per subtask), {mode}, batch 1, up to {args.max_new_tokens} "
          f"new tokens; tandem {loaded.quantization}/{str(loaded.dtype).replace('torch.', '')}, k = {args.num_draft_tokens}, "
          f"methods: {', '.join(m.label for m in methods)}")
    for name, why in skipped.items():
        print(f"  (left out {name}: {why})")
    # The engine's periodic "poor drafter" warnings would break up the progress bar; tau is in the table.
    engine_log = logging.getLogger("tandem.engine")
    level = engine_log.level
    engine_log.setLevel(logging.ERROR)
    try:
        report = run_spec_bench(
            loaded, cases, methods=methods, num_draft_tokens=args.num_draft_tokens,
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
            baselines=baselines, warmup_ids=warmup_ids,
        )
    finally:
        engine_log.setLevel(level)
    from tandem.bench.base import tandem_cost_curve

    report["cost_curve"] = tandem_cost_curve(loaded)
    report["limit_per_subtask"] = args.limit
    report["skipped_methods"] = skipped
    report["wall_seconds"] = round(time.perf_counter() - t0, 1)
    print_table(report)
    print_identity(report)
    print(f"total wall time {report['wall_seconds']:.0f} s")
    write_outputs(report, args.json, args.plots)
    return report


def write_outputs(report: dict, json_path: str | None, plots_dir: str | None) -> None:
    if json_path:
        from tandem.bench.base import save_report

        save_report(report, json_path)
    if plots_dir:
        from tandem.bench.plots import plot_spec_report

        for path in plot_spec_report(report, plots_dir):
            print(f"wrote {path}")


# ---- output ---------------------------------------------------------------------------------------


def _rows(report: dict, category: str) -> list[tuple[str, dict]]:
    """(label, row) of every configuration in a category: tandem first, then transformers."""
    row = report["categories"][category]
    out = [(f"tandem {name}", r) for name, r in row["tandem"].items()]
    out += [(f"transformers {name}", r) for name, r in row.get("transformers", {}).items()]
    return out


def print_table(report: dict) -> None:
    mode = "greedy" if report["temperature"] == 0 else f"temperature {report['temperature']}"
    print(f"\nOverall: {report['model']} ({report['quantization']}/{report['dtype']}), {mode}, "
          f"{report['num_prompts']} prompts, k = {report['num_draft_tokens']}, up to {report['max_new_tokens']} new tokens")
    head = f"{'configuration':34} {'tau':>5} {'acc':>5}  {'acceptance per position':24} {'tok/s':>7} {'speedup':>8}"
    print(head)
    print("-" * len(head))
    for label, r in _rows(report, OVERALL):
        tau = f"{r['tau']:5.2f}" if "tau" in r else f"{'-':>5}"
        acc = f"{r['acceptance_rate']:5.2f}" if r.get("spec", {}).get("num_draft_tokens") else f"{'-':>5}"
        per_pos = " ".join(f"{a:.2f}" for a in r.get("acceptance_per_position", [])[:6]) or "-"
        speed = f"{r['speedup']:7.2f}x" if "speedup" in r else f"{'1.00x':>8}"
        print(f"{label:34} {tau} {acc}  {per_pos:24} {r['tokens_per_second']:7.1f} {speed}")
    assisted = (report.get("transformers") or {}).get("assisted")
    if assisted and not assisted["applicable"]:
        print(f"{'transformers assisted':34} not applicable: {assisted['reason']}")
    hf = report["categories"][OVERALL].get("transformers")
    if hf:
        print(f"(transformers plain runs at {hf[PLAIN]['vs_tandem_plain']:.2f}x tandem plain's tokens/s)")

    labels = [label for label, _ in _rows(report, OVERALL) if not label.endswith(f" {PLAIN}")]
    for title, key, fmt in (("Speedup over the same engine's plain decoding", "speedup", "{:.2f}x"),
                            ("tau (tokens per target forward)", "tau", "{:.2f}")):
        shown = [lb for lb in labels if key in dict(_rows(report, OVERALL))[lb]]
        if not shown:
            continue
        names = [lb.removeprefix("tandem ").replace("transformers ", "hf ") for lb in shown]
        widths = [max(8, len(n) + 2) for n in names]
        print(f"\n{title}, per subtask")
        print(f"{'subtask':16}{'n':>4}" + "".join(f"{n:>{w}}" for n, w in zip(names, widths)))
        for cat in report["categories"]:
            rows = dict(_rows(report, cat))
            print(f"{cat:16}{report['categories'][cat]['num_prompts']:>4}"
                  + "".join(f"{fmt.format(rows[lb][key]):>{w}}" for lb, w in zip(shown, widths)))
    print("\ntau = tokens committed per target forward incl. the bonus/recovered token; acc = accepted / drafted; "
          "acceptance per position = P(pass | earlier passed); tok/s = mean of per-prompt tokens/s")


def print_identity(report: dict) -> None:
    if report["identity"] is None:
        print("sampling run: greedy identity is not checked (use `tandem audit` for exactness under sampling)")
        return
    parts = [f"{m} {v['mismatches']}/{v['prompts']}" for m, v in report["identity"].items()]
    print("greedy identity vs tandem plain (prompts with different token ids): " + (", ".join(parts) or "-"))
    for m, v in report["identity"].items():
        for d in v["details"]:
            print(f"  MISMATCH {m}: {d['category']} question {d['question_id']}, first difference at token "
                  f"{d['first_difference']}: plain {d['reference_tokens']} vs {m} {d['other_tokens']}")
    for name, v in (report.get("identity_transformers") or {}).items():
        print(f"transformers {name} vs its plain generate: {v['mismatches']}/{v['prompts']} prompts differ")
