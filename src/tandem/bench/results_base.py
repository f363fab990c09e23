"""The results page's section for a `tandem bench base` report: plain decoding, configuration by configuration.

The command that wrote it, one row per configuration (with its ratios to transformers and llama.cpp
when they ran) and, when the run measured it, the kernel section (bandwidth, peak, floor, step, cost
curve, bf16 reference).
"""

from __future__ import annotations

import re

from tandem.bench.results_format import bash_block, curve_ratio, num, seq, shell_line, table, times
from tandem.bench.results_page import KINDS, Page, machine_line, model_flags, variant_env

# The baselines a configuration's speed is divided by, when the run has them: the name a row starts with.
REFERENCES = (("transformers", "vs transformers"), ("llama.cpp", "vs llama.cpp"))


def _config_of(name: str) -> str | None:
    """`tandem QUANT/DTYPE (kernels)` -> the `--configs` entry DTYPE/QUANT."""
    m = re.match(r"tandem (\w+)/(\w+)", name)
    return f"{m.group(2)}/{m.group(1)}" if m else None


def _base_words(page: Page, rel: str, data: dict, plot_rel: str | None) -> list[str]:
    """The `tandem bench base` command that wrote the report."""
    results = data.get("results") or []
    kernels = data.get("kernels")
    words = ["tandem", "bench", "base", *model_flags(data)]
    configs = [c for c in (_config_of(str(r.get("name", ""))) for r in results) if c]
    if configs:
        words += ["--configs", *configs]
    words += ["--num-prompts", str(data.get("num_prompts")), "--max-new-tokens", str(data.get("max_new_tokens"))]
    names = [str(r.get("name", "")) for r in results]
    if not any(n.startswith("transformers") for n in names):
        words.append("--skip-transformers")
    if "kernels" in data and kernels is None:
        words.append("--skip-kernel-report")
    if data.get("clock") == "thread CPU time":
        words += ["--cpu-time", "--threads", "1"]
    elif data.get("threads") is not None:
        words += ["--threads", str(data["threads"])]
    return words + ["--out", page.shown(rel), "--plot", page.png_arg(plot_rel)]


def _reference_speed(results: list[dict], prefix: str):
    """tok/s of the first configuration whose name starts with `prefix`, if any ran."""
    return next((r.get("tokens_per_second") for r in results if str(r.get("name", "")).startswith(prefix)), None)


def _base_table(data: dict, results: list[dict]) -> list[str]:
    """One row per configuration, with its ratios to transformers and llama.cpp when they ran."""
    speeds = {prefix: _reference_speed(results, prefix) for prefix, _ in REFERENCES}
    refs = [(label, speeds[prefix]) for prefix, label in REFERENCES if speeds[prefix]]
    header = ["configuration", "tok/s", *[label for label, _ in refs],
              "weights read (MB)", "of the read-bandwidth limit", "greedy agreement (tokens)", "step ms",
              "cost c(2) / c(4) / c(8) / c(16) / c(32)"]
    rows = []
    for r in results:
        tps = r.get("tokens_per_second")
        cells = [r.get("name"), num(tps, 1)]
        cells += [times(tps / ref) if isinstance(tps, (int, float)) else "-" for _, ref in refs]
        curve = r.get("cost_curve") or {}
        cells += [num(r["weight_bytes"] / 1e6, 0) if r.get("weight_bytes") else "-",
                  f"{100 * r['bandwidth_fraction']:.0f}%" if isinstance(r.get("bandwidth_fraction"), (int, float)) else "-",
                  num(r.get("agreement_tokens"), 1), num(r.get("step_ms"), 1),
                  seq([curve_ratio(curve, n) for n in (2, 4, 8, 16, 32)]) if curve else "-"]
        rows.append(cells)
    lines = table(header, rows)
    if speeds["transformers"] or any(r.get("agreement_tokens") is not None for r in results):
        lines += ["", f"Greedy agreement: mean tokens before the first divergence from tandem fp32 (of "
                  f"{data.get('max_new_tokens')}); cost c(n) = a forward over n new tokens / one token."]
    return lines


def _kernel_table(kernels: dict) -> list[str]:
    """The kernel section `bench base` measured (bandwidth, peak, floor, step, cost curve, bf16 reference)."""
    curve = kernels.get("curve") or {}
    sizes = [n for n in (2, 4, 5, 8, 16) if str(n) in curve]
    step, floor = kernels.get("step_ms"), kernels.get("floor_ms")
    bf16 = kernels.get("bf16_curve") or {}
    krows = [
        ["CPU", kernels.get("cpu") + (f" ({kernels['cpu_model']})" if kernels.get("cpu_model") else "")
         if kernels.get("cpu") else None],
        ["instruction sets", ", ".join(kernels.get("isa") or []) or "-"],
        ["kernels, threads", f"{kernels.get('kernels')}, {kernels.get('threads')}"],
        ["read bandwidth", f"{num(kernels.get('bandwidth_gb_s'), 1)} GB/s"],
        ["int8 peak (register loop)", f"{num(kernels.get('int8_peak_gmac_s'), 0)} GMAC/s"],
        ["q4 GEMM over 8 rows, weights in L1", f"{num(kernels.get('q4_cached_gmac_s'), 0)} GMAC/s"
         if kernels.get("q4_cached_gmac_s") else "-"],
        ["weights per step: tandem / the GGUF's own",
         f"{num((kernels.get('tandem_bytes') or 0) / 1e6, 0)} / "
         f"{num((kernels.get('gguf_bytes') or 0) / 1e6, 0) if kernels.get('gguf_bytes') else '-'} MB"],
        [f"decode step at a {kernels.get('context')}-token context",
         f"{num(step)} ms" + (f" = {times(step / floor)} the floor ({num(floor)} ms)" if step and floor else "")],
        [" / ".join(f"c({n})" for n in sizes), seq([curve.get(str(n)) for n in sizes])],
        ["each extra verified row (n = 1..16)",
         f"{num(kernels.get('extra_row_ms'))} ms" + (
             f" = {100 * kernels['extra_row_efficiency']:.0f}% of the peak"
             if isinstance(kernels.get("extra_row_efficiency"), (int, float)) else "")],
        ["torch bf16 `F.linear` reference step", f"{num(kernels.get('bf16_step_ms'), 1)} ms"
         + (f" (c(8) {num(bf16.get('8'))})" if "8" in bf16 else "")],
    ]
    return ["", "Kernel section:", "", *table(["measured", "value"], krows)]


def base_section(page: Page, rel: str, data: dict) -> list[str]:
    results = data.get("results") or []
    kernels = data.get("kernels")
    plot_rel, pngs = page.sibling_plots(rel)
    words = _base_words(page, rel, data, plot_rel)
    machine = data.get("machine")  # recorded since 2026-12-07; the kernel report's before that
    if machine is None and kernels:
        machine = {"cpu": kernels.get("cpu"), "cpu_model": kernels.get("cpu_model"), "isa": kernels.get("isa"),
                   "threads": kernels.get("threads"), "kernels": kernels.get("kernels"), "steal": data.get("steal")}
    lines = [f"`{KINDS['bench_base']}`: plain decoding of {data.get('model')}, greedy, batch 1, "
             f"{data.get('num_prompts')} Spec-Bench prompts (one per subtask, chat template where the model has one) x {data.get('max_new_tokens')} new tokens "
             f"(prefill included), {data.get('clock')} clock; read bandwidth {num(data.get('bandwidth_gb_s'), 1)} GB/s "
             "measured in the run.", ""]
    lines += bash_block([shell_line(words, variant_env(machine))])
    lines += ["", machine_line(rel, machine), ""]
    lines += _base_table(data, results)
    if kernels:
        lines += _kernel_table(kernels)
    return lines + page.plots_line(pngs)
