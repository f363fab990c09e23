"""The results page's section for a `tandem bench serve` report: `tandem serve` under load, mode against mode.

The command that wrote it, one row per concurrency level (throughput of the reference mode and the
others' ratios to it, per-user streaming speed, tau and acceptance, time to first token, errors),
and how many answers agreed across modes.
"""

from __future__ import annotations

from tandem.bench.results_format import bash_block, num, shell_line, table, times
from tandem.bench.results_page import KINDS, Page, machine_line, model_flags

ALL_MODES = ("adaptive", "fixed", "off")


def _serve_words(page: Page, rel: str, data: dict, modes: list[str], plot_rel: str | None) -> list[str]:
    """The `tandem bench serve` command that wrote the report."""
    words = ["tandem", "bench", "serve", *model_flags(data)]
    if data.get("algorithm"):
        words += ["--algorithm", str(data["algorithm"])]
    if data.get("num_draft_tokens", 4) != 4:
        words += ["--num-draft-tokens", str(data["num_draft_tokens"])]
    if sorted(modes) != sorted(ALL_MODES):
        words += ["--modes", *modes]
    if data.get("threads") is not None:
        words += ["--threads", str(data["threads"])]
    if data.get("max_running_requests") is not None:
        words += ["--max-running-requests", str(data["max_running_requests"])]
    words += ["--max-tokens", str(data.get("max_tokens")), "--requests-per-user", str(data.get("requests_per_user")),
              "--concurrency", *[str(c) for c in data.get("concurrency") or []],
              "--num-prompts", str(data.get("num_prompts"))]
    if data.get("categories"):
        words += ["--categories", *data["categories"]]
    if (data.get("alternations") or 1) > 1:
        words += ["--alternations", str(data["alternations"])]
    sampling = data.get("sampling") or {}
    if sampling.get("temperature"):
        words += ["--temperature", str(sampling["temperature"])]
        if sampling.get("top_p", 1.0) != 1.0:
            words += ["--top-p", str(sampling["top_p"])]
    if data.get("note"):
        words += ["--note", data["note"]]
    return words + ["--out", page.shown(rel), "--plot", page.png_arg(plot_rel)]


def _of(per: dict, mode: str | None) -> dict:
    """One mode's measurements at one concurrency level ({} when the mode did not run there)."""
    return per.get(mode) or {}


def _level_table(data: dict, modes: list[str], ref: str | None) -> list[str]:
    """One row per concurrency level: `ref`'s speeds, the other modes' ratios to it, tau, TTFT, errors."""
    others = [m for m in modes if m != ref]
    spec_modes = [m for m in modes if m != "off"]
    header = ["users", f"{ref} tok/s", *[f"{m} x" for m in others], f"{ref} user tok/s",
              *[f"{m} user x" for m in others], *[f"{m} tau (acceptance)" for m in spec_modes],
              f"TTFT p50 s ({ref})", "errors"]
    rows = []
    for level in sorted(data["levels"], key=lambda c: int(c) if str(c).isdigit() else 0):
        per = data["levels"][level]
        r = _of(per, ref)
        cells = [level, num(r.get("throughput"), 1)]
        cells += [times(_of(per, m).get("speedup")) for m in others]
        cells.append(num(r.get("per_user_tps"), 1))
        cells += [times(_of(per, m).get("per_user_speedup")) for m in others]
        cells += [f"{num(_of(per, m).get('tau'))} ({num(_of(per, m).get('acceptance_rate'))})" for m in spec_modes]
        ttft = r.get("ttft_p50_ms")
        cells.append(num(ttft / 1000 if isinstance(ttft, (int, float)) else None, 1))
        cells.append(sum(_of(per, m).get("errors") or 0 for m in modes))
        rows.append(cells)
    return table(header, rows)


def serve_section(page: Page, rel: str, data: dict) -> list[str]:
    modes = list(data.get("modes") or [])
    plot_rel, pngs = page.sibling_plots(rel)
    words = _serve_words(page, rel, data, modes, plot_rel)
    given = [m for m in modes if m not in (data.get("launched") or modes)]
    lines = [f"`{KINDS['bench_serve']}`: `tandem serve` under load, speculation {' / '.join(modes)} side by side; "
             f"{data.get('model')}, drafter {data.get('algorithm') or 'the model default'}, "
             f"k = {data.get('num_draft_tokens')}, greedy streamed chat requests of up to {data.get('max_tokens')} "
             f"tokens, {data.get('num_prompts')} Spec-Bench prompts"
             + (f" ({', '.join(data['categories'])})" if data.get("categories") else "") + ".", ""]
    lines += bash_block([shell_line(words)])
    if given:
        lines.append(f"(modes {', '.join(given)} ran on servers given with `--url`)")
    if data.get("note"):
        lines += ["", f"Note: {data['note']}"]
    lines += ["", machine_line(rel, data.get("machine")), ""]
    ref = "off" if "off" in modes else modes[0] if modes else None
    lines += _level_table(data, modes, ref)
    identity = data.get("identity") or {}
    if identity:
        lines += ["", "Same answers across modes (greedy): " + ", ".join(
            f"{m} {v.get('compared', 0) - v.get('mismatches', 0)}/{v.get('compared')}" for m, v in identity.items())
            + f". x = throughput over `{ref}` at the same concurrency; user tok/s = streaming speed after the first token."]
    return lines + page.plots_line(pngs)
