"""The results page's section for a `tandem advise` report: which drafter, which k, whether to speculate.

The command that wrote it, the forward cost it measured, one row per drafter (expected tau per k,
predicted against measured speedups, the best k and the concurrency where speculation stops paying),
and the recommendation with its warnings.
"""

from __future__ import annotations

from tandem.bench.results_format import bash_block, curve_ratio, num, seq, shell_line, table, times
from tandem.bench.results_page import KINDS, Page, machine_line, model_flags, variant_env


def _advise_words(page: Page, rel: str, data: dict) -> list[str]:
    """The `tandem advise` command that wrote the report."""
    words = ["tandem", "advise", *model_flags(data, weights=True)]
    words += ["--limit", str(data.get("num_prompts")), "--max-new-tokens", str(data.get("max_new_tokens")),
              "--k-max", str(data.get("k_max"))]
    if data.get("threads") is not None and data.get("threads") != data.get("cores"):
        words += ["--threads", str(data["threads"])]
    if data.get("temperature"):
        words += ["--temperature", f"{data['temperature']:g}"]
    drafters = data.get("drafters") or []
    return words + ["--drafters", *[str(d.get("label")) for d in drafters], "--json", page.shown(rel)]


def _cost_line(data: dict, curve: dict) -> list[str]:
    """One decode forward, verifying 4 drafts, and the bandwidth floor of reading the weights."""
    if "1" not in curve:
        return []
    return [f"One decode forward {num(1000 * curve['1'], 1)} ms; verifying 4 drafts "
            f"{times(curve_ratio(curve, 5))} one forward; reading the "
            f"{num((data.get('weight_bytes') or 0) / 1e6, 0)} MB of weights at the measured "
            f"{num(data.get('bandwidth_gb_s'), 1)} GB/s takes {num(1000 * (data.get('bandwidth_limit_seconds') or 0), 1)} ms.", ""]


def _drafter_table(data: dict) -> list[str]:
    k_max = data.get("k_max")
    rows = []
    for d in data.get("drafters") or []:
        taus = d.get("expected_tau") or {}
        best = d.get("best_k")
        rows.append([d.get("label"), seq([taus[k] for k in sorted(taus, key=int)]),
                     f"{times(d.get('predicted_at_k_measured'))} / {times(d.get('measured_at_k_measured'))}",
                     num(d.get("measured_tau")), "0 (do not speculate)" if best == 0 else best,
                     f"{times(d.get('predicted_best'))} / {times(d.get('measured_best'))}",
                     d.get("break_even_batch")])
    return table(["drafter", f"expected tau, k = 1..{k_max}", f"at k = {k_max}: predicted / measured speedup",
                  f"measured tau at k = {k_max}", "best k", "at best k: predicted / measured",
                  "stops paying at concurrency"], rows)


def advise_section(page: Page, rel: str, data: dict) -> list[str]:
    words = _advise_words(page, rel, data)
    curve = data.get("cost_curve") or {}
    lines = [f"`{KINDS['advise']}`: which drafter, which k, and whether to speculate, measured on "
             f"{data.get('num_prompts')} Spec-Bench prompts (one per subtask), up to {data.get('max_new_tokens')} new "
             f"tokens, {data.get('model')} ({data.get('quantization')}/{data.get('dtype')}), {data.get('threads')} of "
             f"{data.get('cores')} cores.", ""]
    lines += bash_block([shell_line(words, variant_env(data.get("machine")))])
    lines += ["", machine_line(rel, data.get("machine")), ""]
    lines += _cost_line(data, curve)
    lines += _drafter_table(data)
    lines += ["", f"Recommendation: \"{data.get('recommendation')}\"."]
    warnings = data.get("warnings") or []
    if warnings:
        lines.append("Warnings: " + ", ".join(f"`{w.get('kind')}` ({w.get('subject')})" for w in warnings) + ".")
    return lines
