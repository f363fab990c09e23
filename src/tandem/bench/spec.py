"""`tandem bench spec`: speculative decoding Spec-Bench style, every configuration side by side in one run.

Rows: Spec-Bench categories and overall. Configurations: tandem plain decoding (the baseline), tandem
with each drafting method on the same loaded weights, and transformers `generate` fp32 plain vs its
prompt-lookup decoding. Greedy, batch 1, EOS may stop a request (Spec-Bench's protocol), so tokens/s
comes from the tokens actually generated. Speedup = (total tokens / total seconds) of a configuration
over that of its own plain baseline, per category: a ratio of aggregate rates, not Spec-Bench's mean of
per-prompt speedups. Each prompt runs every configuration before the next prompt starts, so machine
noise lands on all of them alike.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from tandem.config import EngineConfig, SamplingParams, SpecConfig
from tandem.types import SpecStats

PLAIN = "plain"
HF_PLAIN = "hf_plain"
HF_PLD = "hf_pld"
OVERALL = "overall"
WARMUP_TOKENS = 8
WARMUP_TEXT = "Say hello and name three colours."
SPEEDUP_DEFINITION = (
    "per category and configuration: total generated tokens / total wall seconds (prefill included), "
    "divided by the same for its plain baseline (tandem plain, or transformers plain generate)"
)


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
    spec: SpecStats = field(default_factory=SpecStats)


@dataclass
class _Config:
    name: str
    run: Callable[[list[int], int], Run]  # (prompt ids, max new tokens) -> Run


# ---- the configurations ------------------------------------------------------------------------


def _tandem_config(name: str, loaded, algorithm: str | None, num_draft_tokens: int, max_model_len: int) -> _Config:
    from tandem.llm import LLM

    spec = SpecConfig(algorithm=algorithm, num_draft_tokens=num_draft_tokens)
    llm = LLM.from_loaded(loaded, EngineConfig(model=loaded.name, max_model_len=max_model_len, max_num_seqs=1, spec=spec))

    def run(prompt_ids: list[int], max_new: int) -> Run:
        params = SamplingParams(temperature=0.0, max_tokens=max_new)
        t = time.perf_counter()
        out = llm.generate(prompt_ids, params)[0]
        return Run(out.token_ids, time.perf_counter() - t, out.spec)

    return _Config(name, run)


def _hf_config(name: str, model, pld_tokens: int | None) -> _Config:
    """transformers `generate`, greedy; with pld_tokens set, its prompt-lookup decoding
    (`prompt_lookup_num_tokens`: candidates copied from an n-gram match in the context)."""
    gen = dict(do_sample=False, pad_token_id=_hf_pad_id(model))
    if pld_tokens:
        gen["prompt_lookup_num_tokens"] = pld_tokens

    def run(prompt_ids: list[int], max_new: int) -> Run:
        ids = torch.tensor([prompt_ids])
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


# ---- the core -------------------------------------------------------------------------------------


def run_spec_bench(
    loaded,
    cases: list[SpecCase],
    *,
    methods: list[str],
    num_draft_tokens: int = 4,
    max_new_tokens: int = 128,
    hf_model=None,
    hf_pld_tokens: int = 10,
    warmup_ids: list[int] | None = None,
    progress: bool = True,
) -> dict:
    """Run every configuration on every case (interleaved per case) and return the report.

    `loaded` is a LoadedModel shared by all tandem configurations (weights loaded once); `hf_model`
    an optional transformers model for the transformers rows. `warmup_ids` (default: the first
    case's prompt) warms each configuration once with a few tokens before timing; it should not be
    a measured prompt, since suffix decoding keeps earlier outputs in its global trie.
    """
    if not cases:
        raise ValueError("no prompts to benchmark")
    longest = max(len(c.prompt_ids) for c in cases + ([SpecCase("", warmup_ids)] if warmup_ids else []))
    max_model_len = max(2048, longest + max_new_tokens + num_draft_tokens + 2)
    configs = [_tandem_config(PLAIN, loaded, None, num_draft_tokens, max_model_len)]
    configs += [_tandem_config(m, loaded, m, num_draft_tokens, max_model_len) for m in methods]
    if hf_model is not None:
        configs += [_hf_config(HF_PLAIN, hf_model, None), _hf_config(HF_PLD, hf_model, hf_pld_tokens)]

    warm = warmup_ids or cases[0].prompt_ids
    for cfg in configs:
        cfg.run(warm, WARMUP_TOKENS)
    gc.collect()

    runs: dict[str, list[Run]] = {cfg.name: [] for cfg in configs}
    from tqdm import tqdm

    for case in tqdm(cases, desc="prompts", unit="prompt", disable=not progress):
        for cfg in configs:
            runs[cfg.name].append(cfg.run(case.prompt_ids, max_new_tokens))

    return _report(cases, runs, methods, num_draft_tokens, max_new_tokens, hf_pld_tokens if hf_model is not None else None, loaded)


def _summary(picked: list[Run], baseline: dict | None) -> dict:
    tokens = sum(len(r.token_ids) for r in picked)
    seconds = sum(r.seconds for r in picked)
    stats = SpecStats()
    for r in picked:
        stats.merge(r.spec)
    row = {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
        "tau": stats.mean_acceptance_length,
        "acceptance_rate": stats.acceptance_rate,
        "spec": stats.as_dict(),
    }
    if baseline is not None:
        row["speedup"] = row["tokens_per_second"] / baseline["tokens_per_second"] if baseline["tokens_per_second"] else 0.0
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


def _report(cases, runs, methods, k, max_new, hf_pld_tokens, loaded) -> dict:
    categories = list(dict.fromkeys(c.category for c in cases))
    groups = {cat: [i for i, c in enumerate(cases) if c.category == cat] for cat in categories}
    groups[OVERALL] = list(range(len(cases)))
    table = {}
    for cat, idx in groups.items():
        row: dict = {"num_prompts": len(idx)}
        plain = _summary([runs[PLAIN][i] for i in idx], None)
        row["tandem"] = {PLAIN: plain}
        for m in methods:
            row["tandem"][m] = _summary([runs[m][i] for i in idx], plain)
        if HF_PLAIN in runs:
            hf_plain = _summary([runs[HF_PLAIN][i] for i in idx], None)
            row["transformers"] = {PLAIN: hf_plain, "pld": _summary([runs[HF_PLD][i] for i in idx], hf_plain)}
        table[cat] = row
    identity = {m: _identity(runs[PLAIN], runs[m], cases) for m in methods}
    report = {
        "model": loaded.name,
        "quantization": loaded.quantization,
        "dtype": str(loaded.dtype).replace("torch.", ""),
        "methods": list(methods),
        "num_draft_tokens": k,
        "max_new_tokens": max_new,
        "num_prompts": len(cases),
        "hf_pld_tokens": hf_pld_tokens,
        "speedup_definition": SPEEDUP_DEFINITION,
        "categories": table,
        "identity": identity,
        "prompts": [
            {"category": c.category, "question_id": c.question_id, "prompt_tokens": len(c.prompt_ids),
             "generated": {name: len(r[i].token_ids) for name, r in runs.items()},
             "seconds": {name: round(r[i].seconds, 4) for name, r in runs.items()}}
            for i, c in enumerate(cases)
        ],
    }
    if HF_PLD in runs:
        report["identity_transformers_pld"] = _identity(runs[HF_PLAIN], runs[HF_PLD], cases)
    return report


# ---- the command ----------------------------------------------------------------------------------


def _load_transformers(model_name: str):
    """The float copy in tandem's cache (the GGUF dequantised once), fp32, as `bench base` uses."""
    from transformers import AutoModelForCausalLM

    from tandem.model.loader import _ensure_gguf_float_weights, _ensure_gguf_metadata, resolve_model

    src = resolve_model(model_name)
    if src.gguf_path is not None:
        _ensure_gguf_metadata(src)
        _ensure_gguf_float_weights(src)
    return AutoModelForCausalLM.from_pretrained(str(src.hf_dir), dtype=torch.float32).eval()


def bench_spec(args) -> dict:
    from tandem.bench.prompts import spec_bench_prompts
    from tandem.llm import LLM
    from tandem.model.loader import load_model

    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype=args.dtype, quantization=args.quantization)
    # Encoding only: LLM.encode applies the chat template exactly as `generate(chat=True)` does.
    encoder = LLM.from_loaded(loaded, EngineConfig(model=loaded.name, max_num_seqs=1))
    prompts = spec_bench_prompts(per_category=args.per_category, categories=args.categories)
    cases = [SpecCase(p.category, encoder.encode(p.text, chat=True), p.question_id) for p in prompts]
    warmup_ids = encoder.encode(WARMUP_TEXT, chat=True)
    del encoder
    hf_model = None if args.skip_transformers else _load_transformers(args.model)
    print(f"{len(cases)} Spec-Bench prompts ({args.per_category} per category), greedy, batch 1, up to "
          f"{args.max_new_tokens} new tokens; tandem {loaded.quantization}/{str(loaded.dtype).replace('torch.', '')}, "
          f"k = {args.num_draft_tokens}" + ("" if hf_model is None else f"; transformers fp32, PLD {args.hf_pld_tokens} tokens"))
    # The engine's periodic "poor drafter" warnings would break up the progress bar; tau is in the table.
    engine_log = logging.getLogger("tandem.engine")
    level = engine_log.level
    engine_log.setLevel(logging.ERROR)
    try:
        report = run_spec_bench(
            loaded, cases, methods=args.methods, num_draft_tokens=args.num_draft_tokens,
            max_new_tokens=args.max_new_tokens, hf_model=hf_model, hf_pld_tokens=args.hf_pld_tokens,
            warmup_ids=warmup_ids,
        )
    finally:
        engine_log.setLevel(level)
    report["wall_seconds"] = round(time.perf_counter() - t0, 1)
    print_table(report)
    print_identity(report)
    print(f"total wall time {report['wall_seconds']:.0f} s")
    if args.out:
        from tandem.bench.base import save_report

        save_report(report, args.out)
    if args.plot:
        plot_spec(report, args.plot)
    return report


# ---- output ---------------------------------------------------------------------------------------


def print_table(report: dict) -> None:
    methods = report["methods"]
    has_hf = report["hf_pld_tokens"] is not None
    cell = 28  # tau acc tok/s speedup
    top = f"{'':16}{'':>4} {'tandem':>8} " + "".join(f"  {m + ' k=' + str(report['num_draft_tokens']):^{cell}}" for m in methods)
    sub = f"{'category':16}{'n':>4} {'plain':>8} " + "".join(f"  {'tau':>5} {'acc':>5} {'tok/s':>7} {'x':>7}" for _ in methods)
    if has_hf:
        top += f"  {'transformers fp32 (PLD ' + str(report['hf_pld_tokens']) + ')':^25}"
        sub += f"  {'plain':>7} {'PLD':>7} {'x':>9}"
    print(top)
    print(sub)
    print("-" * len(sub))
    for cat, row in report["categories"].items():
        if cat == OVERALL:
            print("-" * len(sub))
        line = f"{cat:16}{row['num_prompts']:>4} {row['tandem'][PLAIN]['tokens_per_second']:8.1f} "
        for m in methods:
            r = row["tandem"][m]
            line += f"  {r['tau']:5.2f} {r['acceptance_rate']:5.2f} {r['tokens_per_second']:7.1f} {r['speedup']:6.2f}x"
        if has_hf:
            hf = row["transformers"]
            line += f"  {hf[PLAIN]['tokens_per_second']:7.1f} {hf['pld']['tokens_per_second']:7.1f} {hf['pld']['speedup']:8.2f}x"
        print(line)
    print("tau = tokens committed per target forward incl. the bonus/recovered token (prefill counted as one); "
          "acc = accepted / drafted; x = tok/s over the plain baseline, tok/s = total tokens / total seconds")


def print_identity(report: dict) -> None:
    parts = [f"{m} {v['mismatches']}/{v['prompts']}" for m, v in report["identity"].items()]
    print("greedy identity vs tandem plain (prompts with different token ids): " + (", ".join(parts) or "-"))
    for m, v in report["identity"].items():
        for d in v["details"]:
            print(f"  MISMATCH {m}: {d['category']} question {d['question_id']}, first difference at token "
                  f"{d['first_difference']}: plain {d['reference_tokens']} vs {m} {d['other_tokens']}")
    hf = report.get("identity_transformers_pld")
    if hf:
        print(f"transformers PLD vs its plain generate: {hf['mismatches']}/{hf['prompts']} prompts differ")


def plot_spec(report: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: skipping the plot")
        return
    cats = list(report["categories"])
    methods = report["methods"]
    series = {f"tandem {m}": [report["categories"][c]["tandem"][m]["speedup"] for c in cats] for m in methods}
    if report["hf_pld_tokens"] is not None:
        series["transformers PLD"] = [report["categories"][c]["transformers"]["pld"]["speedup"] for c in cats]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    _grouped_bars(ax1, cats, series)
    ax1.axhline(1.0, color="black", lw=0.8, ls="--")
    ax1.set_ylabel("speedup over own plain decoding")
    ax1.set_title(f"Speedup, {report['model']}, greedy, batch 1, k={report['num_draft_tokens']}")
    _grouped_bars(ax2, cats, {f"tandem {m}": [report["categories"][c]["tandem"][m]["tau"] for c in cats] for m in methods})
    ax2.axhline(1.0, color="black", lw=0.8, ls="--")
    ax2.set_ylabel("tau (tokens per target forward)")
    ax2.set_title("Mean acceptance length (incl. bonus token)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def _grouped_bars(ax, cats: list[str], series: dict[str, list[float]]) -> None:
    width = 0.8 / max(1, len(series))
    for j, (name, values) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(cats))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(cats)))
    ax.set_xticklabels(cats, rotation=25, ha="right", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
