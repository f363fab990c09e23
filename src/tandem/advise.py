"""`tandem advise`: should this model speculate, with which drafter, and how many draft tokens?

Measures the target's forward cost curve and each drafter's acceptance per draft position on a
sample of the user's prompts, predicts tau and speedup for every k (and every concurrency) with
`scheduler.cost_model`, checks the predictions against measured runs, and turns what it finds
into plain-language warnings.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import asdict, dataclass, field

import torch

from tandem.bench.base import save_report
from tandem.bench.kernel_report import measure_bandwidth, model_weight_bytes
from tandem.bench.prompts import load_prompt_file, spread_prompts
from tandem.bench.spec import (
    DEFINITIONS,
    OVERALL,
    WARMUP_TEXT,
    Method,
    SpecCase,
    default_methods,
    machine_info,
    machine_line,
    parse_methods,
    run_spec_bench,
)
from tandem.bench.steal import StealMeter
from tandem.config import DTYPES, QUANTIZATIONS, EngineConfig
from tandem.flags import at_least
from tandem.llm import LLM, configure_threads
from tandem.model.cost import forward_cost_curve
from tandem.model.catalogue import DEFAULT_MODEL
from tandem.model.loader import load_model
from tandem.paths import check_not_an_input
from tandem.scheduler.cost_model import CostCurve, best_k, break_even_batch, expected_tau, speedup

K_MAX = 8
ADVISE_CURVE_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32, 64)
MAX_BATCH = 64
LOW_TAU = 2.0  # the seed's rule: a drafter that cannot reach tau 2 needs replacing, not a larger k
SLOW_BASE_FRACTION = 0.5  # a step slower than twice the bandwidth limit is overhead-bound
EXPENSIVE_VERIFY = 2.0  # verifying 4 drafts should cost well under 2x one forward
REFERENCE_K = 4
NOISY = 0.3  # measured speedup more than 30% off the prediction


@dataclass
class Advice:
    """One plain-language finding; `subject` is a drafter label or "target"."""

    kind: str
    subject: str
    message: str


@dataclass
class DrafterAdvice:
    """What the measurements say about one drafter (speedups over plain decoding, batch 1)."""

    label: str
    k_measured: int
    acceptance: list[float]  # drafted acceptance per position (see DEFINITIONS)
    expected_tau: dict[int, float]
    draft_seconds_per_position: float
    best_k: int
    predicted_best: float
    predicted_at_k_measured: float
    measured_at_k_measured: float
    measured_tau: float
    break_even_batch: int | None
    measured_best: float | None = None
    warnings: list[Advice] = field(default_factory=list)


def draft_cost_model(seconds_per_position: float, lengths: list[int] | None = None, curve: CostCurve | None = None):
    """A cost_model DraftCost: drafting time (linear in k and the batch, measured per requested
    position), plus the correction for drafts shorter than k. cost_model prices every round at a
    full (k + 1)-token forward; a drafter that often finds nothing (n-gram, suffix) or drafts
    adaptively verifies fewer tokens, so with its measured draft lengths (lengths[n] = rounds that
    drafted n tokens at the largest k) a round costs the mean of curve(B * (1 + min(n, k))) instead.
    The correction is negative: it is the verification such a drafter does not pay for."""
    rounds = sum(lengths) if lengths and curve is not None else 0

    def cost(k: int, batch: int) -> float:
        drafting = batch * k * seconds_per_position
        if not rounds:
            return drafting
        verify = sum(c * curve(batch * (1 + min(n, k))) for n, c in enumerate(lengths)) / rounds
        return drafting + verify - curve(batch * (k + 1))

    return cost


def analyse_drafter(label: str, acceptance: list[float], curve: CostCurve, k_measured: int,
                    draft_seconds_per_position: float, measured_speedup: float, measured_tau: float,
                    k_max: int = K_MAX, draft_lengths: list[int] | None = None) -> DrafterAdvice:
    """Predictions for one drafter from its measured acceptance profile and draft lengths (pure:
    no timing)."""
    cost = draft_cost_model(draft_seconds_per_position, draft_lengths, curve)
    k, best = best_k(acceptance, curve, 1, k_max, cost)
    advice = DrafterAdvice(
        label=label, k_measured=k_measured, acceptance=list(acceptance),
        expected_tau={j: expected_tau(acceptance, j) for j in range(1, k_max + 1)},
        draft_seconds_per_position=draft_seconds_per_position, best_k=k, predicted_best=best,
        predicted_at_k_measured=speedup(expected_tau(acceptance, k_measured), k_measured, 1, curve, cost),
        measured_at_k_measured=measured_speedup, measured_tau=measured_tau,
        break_even_batch=break_even_batch(acceptance, curve, k_max, MAX_BATCH, cost),
    )
    return advice


def drafter_warnings(a: DrafterAdvice, curve: CostCurve) -> list[Advice]:
    out = []
    k_max = max(a.expected_tau)
    tau_max = a.expected_tau[k_max]
    if tau_max < LOW_TAU:
        half = a.expected_tau[max(1, k_max // 2)]
        out.append(Advice("low_tau", a.label, (
            f"{a.label}: expected tau is {tau_max:.2f} even at k = {k_max} ({half:.2f} at k = {max(1, k_max // 2)}); "
            f"under {LOW_TAU:.0f}, more draft tokens barely move it: swap the drafter (a trained head or a "
            "same-tokenizer draft model fitted to this target) instead of raising k")))
    off = [(k, p, m) for k, p, m in ((a.k_measured, a.predicted_at_k_measured, a.measured_at_k_measured),
                                     (a.best_k, a.predicted_best, a.measured_best)) if k and m]
    if any(abs(m / p - 1) > NOISY for _, p, m in off):
        k, p, m = max(off, key=lambda x: abs(x[2] / x[1] - 1))
        out.append(Advice("noisy", a.label, (
            f"{a.label}: at k = {k} the measured speedup {m:.2f}x is far from the predicted {p:.2f}x: the "
            "machine was busy or the sample is small; rerun on a quiet machine, or with more --limit prompts, "
            "before trusting these numbers")))
    if a.best_k == 0:
        step = curve(1) * 1000
        drafting = a.draft_seconds_per_position * 1000
        out.append(Advice("no_gain", a.label, (
            f"{a.label}: no draft length up to {k_max} is predicted to beat plain decoding here "
            f"(at k = {a.k_measured}: predicted {a.predicted_at_k_measured:.2f}x, measured "
            f"{a.measured_at_k_measured:.2f}x; drafting costs {drafting:.2f} ms per token against a "
            f"{step:.1f} ms forward): leave speculation off with this drafter")))
    return out


def setup_warnings(loaded, curve: CostCurve, bandwidth_gb_s: float, weight_bytes: int,
                   threads: int, cores: int) -> list[Advice]:
    """Findings about the target's configuration: a slow base path, expensive verification, and
    dtype/thread settings that cost speed."""
    out = []
    step = curve(1)
    floor = weight_bytes / (bandwidth_gb_s * 1e9)
    dense_fp32 = loaded.quantization == "none" and loaded.dtype == torch.float32
    if dense_fp32:
        fix = "a quantized path: --quantization native for GGUF models, int8 or int4 for float checkpoints"
    else:
        fix = "fewer, fused operations per layer; compare `tandem bench base` across configurations"
    if floor / step < SLOW_BASE_FRACTION:
        out.append(Advice("slow_base", "target", (
            f"the base path is slow: one decode forward takes {step * 1000:.1f} ms, while reading its "
            f"{weight_bytes / 1e6:.0f} MB of weights at the measured {bandwidth_gb_s:.1f} GB/s takes "
            f"{floor * 1000:.1f} ms ({floor / step:.0%} of the bandwidth limit), so per-operation overhead, not "
            f"memory, limits decoding. Fix the base configuration first ({fix}): every speedup here is "
            "relative to it")))
    verify = curve(REFERENCE_K + 1) / step
    if verify > EXPENSIVE_VERIFY:
        out.append(Advice("expensive_verify", "target", (
            f"verifying {REFERENCE_K} draft tokens costs {verify:.2f}x one forward with {loaded.quantization} weights "
            f"and {str(loaded.dtype).replace('torch.', '')} activations: a drafter needs tau above {verify:.2f} "
            "at k = 4 just to break even. On CPUs the int4/int8 weight-only kernels with bf16 activations keep "
            "this near 1.2-1.4x; dense bf16 without native bf16 support makes it worst")))
    if dense_fp32:
        out.append(Advice("dtype", "target", (
            "dense fp32 weights on CPU read 4 bytes per parameter each step: a quantized configuration "
            "(--quantization native / int8 / int4) reads 4-8x fewer bytes and is the first thing to try")))
    if threads < cores:
        out.append(Advice("threads", "target", (
            f"torch uses {threads} of {cores} available cores: leave --threads unset (or pass --threads {cores}) "
            "unless other work keeps the other cores busy (then fewer threads avoid waiting on busy cores, "
            "which can cost far more than the cores gain)")))
    return out


# ---- measuring ---------------------------------------------------------------------------------------


def run_advise(loaded, cases: list[SpecCase], methods: list[Method], warmup_ids: list[int], *, k_max: int = K_MAX,
               max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0,
               curve_sizes=ADVISE_CURVE_SIZES, progress: bool = True) -> dict:
    """Measure and predict; returns the advisor's report (what `--json` writes). warmup_ids: the
    prompt each configuration warms up on (run_spec_bench's: no measured prompt)."""
    if not methods:
        raise ValueError("no drafters to assess; pass --drafters NAME[=PATH] ...")
    _check_settings(k_max, temperature)
    steal = StealMeter()
    bandwidth = measure_bandwidth()
    weight_bytes = model_weight_bytes(loaded.model)
    curve = CostCurve.from_points(forward_cost_curve(loaded, sizes=curve_sizes)).monotone()
    common = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, progress=progress,
                  warmup_ids=warmup_ids)

    def measure(ms: list[Method]) -> dict:
        return _measure(loaded, cases, ms, k_max, common)

    advice = _profile_drafters(measure, methods, curve, k_max)
    _recheck_best_k(measure, methods, advice, k_max)
    for a in advice:
        a.warnings = drafter_warnings(a, curve)
    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    warnings = setup_warnings(loaded, curve, bandwidth, weight_bytes, threads, cores)
    for a in advice:
        warnings += a.warnings
    return {
        "model": loaded.name, "quantization": loaded.quantization, "dtype": str(loaded.dtype).replace("torch.", ""),
        "num_prompts": len(cases), "max_new_tokens": max_new_tokens, "temperature": temperature, "k_max": k_max,
        "threads": threads, "cores": cores, "bandwidth_gb_s": bandwidth, "weight_bytes": weight_bytes,
        "bandwidth_limit_seconds": weight_bytes / (bandwidth * 1e9),
        "cost_curve": curve.as_points(), "max_batch_checked": MAX_BATCH,
        "drafters": [{k: v for k, v in asdict(a).items() if k != "warnings"} for a in advice],
        "recommendation": recommendation(advice),
        "warnings": [asdict(w) for w in warnings],
        "definitions": {**DEFINITIONS, "predicted speedup": (
            "tau(k) * cost(1) / (mean over rounds of cost(1 + min(drafted, k)) + k * drafting seconds per "
            "token), cost = measured forward seconds over n new tokens, drafted = the measured draft "
            "lengths; at concurrency B: cost(B) and cost(B * (1 + min(drafted, k)))")},
        "machine": machine_info(steal),
    }


def _measure(loaded, cases: list[SpecCase], methods: list[Method], k_max: int, common: dict) -> dict:
    """tandem's overall rows of one `run_spec_bench` over `methods` at k_max."""
    quiet = logging.getLogger("tandem.engine")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the engine's own low-tau warning: the advisor reports it below
    try:
        return run_spec_bench(loaded, cases, methods=methods, num_draft_tokens=k_max, **common)["categories"][OVERALL]["tandem"]
    finally:
        quiet.setLevel(level)


def _profile_drafters(measure, methods: list[Method], curve: CostCurve, k_max: int) -> list[DrafterAdvice]:
    """Every drafter measured at k_max in one run, and the predictions from its acceptance profile."""
    profiled = measure([Method(m.algorithm, m.draft_path, k_max) for m in methods])
    advice = []
    for m in methods:
        row = profiled[Method(m.algorithm, m.draft_path, k_max).label]
        advice.append(analyse_drafter(m.label, row["drafted_acceptance"] + [0.0] * (k_max - len(row["drafted_acceptance"])),
                                      curve, k_max, row["draft_seconds_per_position"], row["speedup"], row["tau"], k_max,
                                      row["draft"]["drafted_lengths"]))
    return advice


def _recheck_best_k(measure, methods: list[Method], advice: list[DrafterAdvice], k_max: int) -> None:
    """Check the prediction at each drafter's best k with a second measured run (sets measured_best)."""
    recheck = [Method(m.algorithm, m.draft_path, a.best_k) for m, a in zip(methods, advice) if 0 < a.best_k != k_max]
    rows = measure(recheck) if recheck else {}
    for m, a in zip(methods, advice):
        if a.best_k == k_max:
            a.measured_best = a.measured_at_k_measured
        elif a.best_k == 0:
            a.measured_best = 1.0
        else:
            a.measured_best = rows[Method(m.algorithm, m.draft_path, a.best_k).label]["speedup"]


def recommendation(advice: list[DrafterAdvice]) -> str:
    good = [a for a in advice if a.best_k > 0]
    if not good:
        return "leave speculation off: no drafter measured here beats plain decoding"
    a = max(good, key=lambda x: x.predicted_best)
    name = a.label.split("(")[0]
    return (f"--speculative-algorithm {name} --speculative-num-draft-tokens {a.best_k} "
            f"(predicted {a.predicted_best:.2f}x, measured {a.measured_best:.2f}x at batch 1)")


def print_advice(report: dict) -> None:
    mode = "greedy" if report["temperature"] == 0 else f"temperature {report['temperature']}"
    curve = CostCurve.from_points(report["cost_curve"])
    print(f"\n{report['model']} ({report['quantization']}/{report['dtype']}), {report['num_prompts']} prompts, {mode}, "
          f"up to {report['max_new_tokens']} new tokens, {report['threads']} threads of {report['cores']} cores")
    cpu = machine_line(report.get("machine", {}))
    if cpu:
        print(cpu)
    print(f"base path: a forward takes {curve(1) * 1000:.1f} ms for 1 token, {curve(REFERENCE_K + 1) * 1000:.1f} ms for "
          f"{REFERENCE_K + 1} ({curve(REFERENCE_K + 1) / curve(1):.2f}x); reading the {report['weight_bytes'] / 1e6:.0f} MB of "
          f"weights at {report['bandwidth_gb_s']:.1f} GB/s takes {report['bandwidth_limit_seconds'] * 1000:.1f} ms")
    for d in report["drafters"]:
        k = d["k_measured"]
        print(f"\n{d['label']}")
        print("  acceptance per position (drafted and passed): " + " ".join(f"{x:.2f}" for x in d["acceptance"]))
        print(f"  expected tau for k = 1..{len(d['expected_tau'])}: "
              + " ".join(f"{t:.2f}" for t in d["expected_tau"].values()))
        print(f"  at k = {k}: tau measured {d['measured_tau']:.2f}; speedup predicted {d['predicted_at_k_measured']:.2f}x, "
              f"measured {d['measured_at_k_measured']:.2f}x")
        if d["best_k"]:
            print(f"  best k = {d['best_k']}: speedup predicted {d['predicted_best']:.2f}x, measured {d['measured_best']:.2f}x")
        else:
            print("  best k = 0: speculation is predicted not to pay")
        be = d["break_even_batch"]
        if be is None:
            print(f"  speculation keeps paying up to concurrency {report['max_batch_checked']} (the largest checked)")
        else:
            print(f"  speculation stops paying at concurrency >= {be}")
    print(f"\nrecommendation: {report['recommendation']}")
    if report["warnings"]:
        print("\nwarnings:")
        for w in report["warnings"]:
            print(f"  - {w['message']}")


# ---- the command ------------------------------------------------------------------------------------


def add_advise_parser(sub) -> None:
    p = sub.add_parser("advise", help="measure drafters on your prompts: best k, predicted vs measured speedup, warnings")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto", choices=("auto",) + DTYPES)
    p.add_argument("--quantization", default="auto", choices=QUANTIZATIONS)
    p.add_argument("--threads", type=at_least(1), default=None)
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="your prompts: .jsonl with prompt/text/turns fields, or one prompt per line "
                        "(default: Spec-Bench, spread over its subtasks)")
    p.add_argument("--drafters", nargs="+", default=None, metavar="NAME[=PATH]",
                   help="drafters to assess, e.g. ngram suffix draft_model=PATH "
                        "(default: every registered drafter that needs no extra files)")
    p.add_argument("--limit", type=int, default=6, help="number of prompts to sample")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k-max", type=int, default=K_MAX, help="largest draft length measured and considered")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    p.set_defaults(func=cmd_advise)


def _check_settings(k_max: int, temperature: float) -> None:
    if k_max < 1:
        raise ValueError(f"--k-max must be >= 1, got {k_max}")
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {temperature}")


def cmd_advise(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    _check_settings(args.k_max, args.temperature)  # before the model loads and the machine is measured
    if args.json and args.prompts:
        check_not_an_input(args.json, [args.prompts], "--json")
    prompts = load_prompt_file(args.prompts, args.limit) if args.prompts else spread_prompts(args.limit)
    methods = parse_methods(args.drafters, "--drafters") if args.drafters else None
    if methods and (trees := [m.label for m in methods if m.eagle_topk > 1 or m.num_draft_tokens or m.num_steps]):
        raise ValueError(f"advise chooses each drafter's chain length itself; drop the @ options of {', '.join(trees)} "
                         "(compare trees and fixed lengths with `tandem bench spec --methods`)")
    configure_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype, quantization=args.quantization)
    if methods is None:
        methods, skipped = default_methods(loaded)
        for name, why in skipped.items():
            print(f"(not assessed: {name}: {why})")
    # Encoding only: LLM.encode applies the chat template exactly as `generate(chat=True)` does.
    encoder = LLM.from_loaded(loaded, EngineConfig(model=loaded.name, max_num_seqs=1))
    chat = loaded.tokenizer.chat_template is not None
    cases = [SpecCase(p.category, encoder.encode(p.text, chat=chat), p.question_id) for p in prompts]
    warmup_ids = encoder.encode(WARMUP_TEXT, chat=chat)
    del encoder
    print(f"measuring the cost curve and {', '.join(m.label for m in methods)} at k = {args.k_max} "
          f"on {len(cases)} prompts ...")
    report = run_advise(loaded, cases, methods, warmup_ids, k_max=args.k_max, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, seed=args.seed)
    print_advice(report)
    if args.json:
        save_report(report, args.json)
    return 0

