"""`tandem bench results`: results/README.md rebuilt from the results/**/*.json files, in one command.

One section per JSON file, in sorted path order: the command that produced it (rebuilt from the
file's own fields), the machine it records, and its headline numbers as markdown tables. The
report kinds tandem writes are recognised by their fields (KINDS below); a file of another kind
gets its top-level scalar fields, and one that does not parse gets a line saying so, never a
crash. The text depends on the files only (no clock, no host, no absolute path), so regenerating
an unchanged results directory gives the same bytes; tests/test_results_doc.py checks that the
checked-in results/README.md is up to date.

Pure JSON and text: nothing here imports torch or loads a model.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import Any, Callable

from tandem.model.catalogue import DEFAULT_MODEL  # the catalogue imports no torch
# What `--quantization auto --dtype auto` resolves to for the built-in GGUF models on a CPU: rebuilt
# commands leave these flags out when a report records exactly this.
AUTO_WEIGHTS = ("native", "float32")
SPEC_SUBTASKS = ("multi_turn", "translation", "summarization", "qa", "math_reasoning", "rag")
OVERALL = "overall"
PLAIN = "plain"

# The report kinds this page knows: what each one's file looks like, and the command that writes it.
KINDS = {
    "bench_spec": "tandem bench spec",
    "bench_spec_merged": "tandem bench spec-merge",
    "bench_base": "tandem bench base",
    "advise": "tandem advise",
    "bench_serve": "tandem bench serve",
}

# Reports written before a machine was recorded in them: what the notes of those runs said about it.
UNRECORDED_MACHINES = {
    "bench_base.json": "2 cores AMD EPYC (Zen 3, AVX2), torch 2.13.0, nothing else running (the run's notes)",
    "bench_base_quiet.json": "2 cores AMD EPYC (Zen 3, AVX2), torch 2.13.0, a quiet host (the run's notes)",
    "bench_base_cpu1.json": "2 cores AMD EPYC (Zen 3, AVX2), torch 2.13.0, a host shared with other jobs "
                            "(the run's notes)",
    "serve/bench_serve.json": "the project's shared 2-core CPU, load average 6-9 from other jobs (the run's notes; "
                              "`advise.json`, written 12 minutes earlier, records 2 cores AMD EPYC)",
}
# Reports began naming the kernel variant on this date (`machine.kernels`, `kernels.kernels`); a
# report without one was measured on tandem's previous kernels (one AVX2 kernel, five native calls
# per layer), before the design of docs/kernels.md.
KERNELS_RECORDED_SINCE = "2026-12-01"
PREVIOUS_KERNELS = (f"kernel variant not recorded: written before {KERNELS_RECORDED_SINCE}, so measured on tandem's "
                    "**previous kernels** (history; the current figures are in docs/kernels.md)")


# ---- formatting ----------------------------------------------------------------------------------


def _num(x: Any, digits: int = 2) -> str:
    if x is None or isinstance(x, bool) or not isinstance(x, (int, float)):
        return "-"
    return f"{x:.{digits}f}"


def _times(x: Any) -> str:
    return "-" if not isinstance(x, (int, float)) else f"{x:.2f}x"


def _seq(xs: Any, digits: int = 2) -> str:
    return " / ".join(_num(x, digits) for x in xs) if xs else "-"


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


LOOP_VARIABLE = "$cat"  # the subtask of a shell loop over sittings: left for the shell to expand


def _command(words: list[str], env: str = "") -> str:
    def quote(word: str) -> str:
        if not word:
            return "''"
        if LOOP_VARIABLE in word:  # unquoted where the rest of the word is shell-safe, else in double quotes
            return word if shlex.quote(word.replace(LOOP_VARIABLE, "x"))[0] != "'" else f'"{word}"'
        return shlex.quote(word)

    text = " ".join(quote(w) for w in words)
    return f"{env} {text}" if env else text


def _code(lines: list[str]) -> list[str]:
    return ["```bash", *lines, "```"]


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def _curve_ratio(curve: dict, n: int) -> float | None:
    base = curve.get("1")
    value = curve.get(str(n))
    return value / base if isinstance(base, (int, float)) and base and isinstance(value, (int, float)) else None


# ---- the page ------------------------------------------------------------------------------------


class Page:
    """What every section needs: where the files are, how to name and link them."""

    def __init__(self, results_dir: Path, out: Path) -> None:
        self.root = results_dir
        self.prefix = results_dir.resolve().name  # "results": commands name paths as run from the repository
        self.out_dir = out.resolve().parent
        self.files = sorted(results_dir.rglob("*.json"), key=lambda p: p.relative_to(results_dir).as_posix())
        self.data: dict[str, Any] = {}
        self.errors: dict[str, str] = {}
        for path in self.files:
            rel = self.rel(path)
            try:
                self.data[rel] = json.loads(path.read_text())
            except (OSError, ValueError) as err:
                self.errors[rel] = f"{type(err).__name__}: {err}"

    def rel(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    def shown(self, rel: str) -> str:
        """A results file as a command names it (from the repository root)."""
        return f"{self.prefix}/{rel}" if rel else self.prefix

    def link(self, rel: str, text: str | None = None) -> str:
        target = os.path.relpath((self.root / rel).resolve(), self.out_dir).replace(os.sep, "/")
        return f"[{text or rel}]({target})"

    def sibling_plots(self, rel: str) -> tuple[str | None, list[str]]:
        """The PNG next to a report (same stem) or the plot directory named like it, and its PNGs."""
        stem = rel[: -len(".json")]
        png = self.root / f"{stem}.png"
        if png.is_file():
            return f"{stem}.png", [f"{stem}.png"]
        folder = self.root / stem
        if folder.is_dir():
            return stem, sorted(self.rel(p) for p in folder.glob("*.png"))
        return None, []


def kind_of(data: Any) -> str:
    if not isinstance(data, dict):
        return "unknown"
    if isinstance(data.get("categories"), dict) and isinstance(data.get("methods"), list):
        return "bench_spec_merged" if data.get("merged_from") else "bench_spec"
    if isinstance(data.get("results"), list) and "bandwidth_gb_s" in data:
        return "bench_base"
    if isinstance(data.get("drafters"), list) and "recommendation" in data:
        return "advise"
    if isinstance(data.get("levels"), dict) and isinstance(data.get("modes"), list):
        return "bench_serve"
    return "unknown"


def _machine_line(page: Page, rel: str, machine: dict | None, kernels: str | None = None) -> str:
    if machine:
        parts = [str(machine.get("cpu", "CPU not recorded"))]
        if machine.get("cores") is not None:
            parts.append(f"{machine['cores']} cores")
        threads = machine.get("torch_threads", machine.get("threads"))
        if threads is not None:
            parts.append(f"{threads} torch threads")
        if machine.get("torch"):
            parts.append(f"torch {machine['torch']}")
        kernels = kernels or machine.get("kernels")
        text = ", ".join(parts)
        if machine.get("isa"):
            text += f" (instruction sets: {', '.join(machine['isa'])})"
    else:
        text = UNRECORDED_MACHINES.get(rel, "not recorded in the file")
    text += f"; kernels: {kernels}" if kernels else f"; {PREVIOUS_KERNELS}"
    if machine and machine.get("date"):
        text += f"; {machine['date']}"
    return f"Machine: {text}."


def _variant_env(machine: dict | None) -> str:
    """TANDEM_KERNELS=... when the recorded variant is not the one the recorded CPU picks by itself."""
    if not machine or not machine.get("kernels") or not machine.get("isa"):
        return ""
    ran = str(machine["kernels"]).removeprefix("tandem ")
    isa = set(machine["isa"])
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= isa:
        best = "avx512"
    elif "avx_vnni" in isa or {"avx512vl", "avx512_vnni"} <= isa:
        best = "vnni256"
    else:
        best = "avx2"
    known = ("avx512", "vnni256", "avx2", "torch")
    return f"TANDEM_KERNELS={ran}" if ran in known and ran != best else ""


# ---- bench spec ----------------------------------------------------------------------------------


def _method_arg(m: dict) -> str:
    label = str(m.get("label", m.get("algorithm", "?")))
    arg = str(m.get("algorithm", label.split("@")[0].split("(")[0]))
    if m.get("draft_path"):
        arg += f"={m['draft_path']}"
    if "@" in label:
        arg += "@" + label.split("@", 1)[1]
    return arg


def _subtasks(data: dict) -> list[str]:
    return [c for c in data["categories"] if c != OVERALL]


def _spec_words(data: dict, subtasks: list[str] | None, json_path: str, plots: str) -> list[str]:
    words = ["tandem", "bench", "spec"]
    if data.get("model") not in (None, DEFAULT_MODEL):
        words += ["--model", str(data["model"])]
    if (data.get("quantization"), data.get("dtype")) != AUTO_WEIGHTS:
        words += ["--quantization", str(data.get("quantization")), "--dtype", str(data.get("dtype"))]
    if data.get("limit_per_subtask") is not None:
        words += ["--limit", str(data["limit_per_subtask"])]
    if subtasks is not None and sorted(subtasks) != sorted(SPEC_SUBTASKS):
        words += ["--categories", *subtasks]
    words += ["--max-new-tokens", str(data.get("max_new_tokens"))]
    if data.get("num_draft_tokens", 4) != 4:
        words += ["--num-draft-tokens", str(data["num_draft_tokens"])]
    if data.get("temperature"):
        words += ["--temperature", f"{data['temperature']:g}"]
    if data.get("seed"):
        words += ["--seed", str(data["seed"])]
    hf = data.get("transformers")
    if not hf:
        words.append("--skip-transformers")
    else:
        if hf.get("prompt_lookup_num_tokens", 10) != 10:
            words += ["--hf-pld-tokens", str(hf["prompt_lookup_num_tokens"])]
        assisted = hf.get("assisted") or {}
        if assisted.get("applicable") and assisted.get("model"):
            words += ["--hf-assistant", str(assisted["model"])]
    machine = data.get("machine") or {}
    if machine.get("torch_threads") and machine.get("cores") and machine["torch_threads"] != machine["cores"]:
        words += ["--threads", str(machine["torch_threads"])]
    words += ["--methods", *[_method_arg(m) for m in data["methods"]]]
    return words + ["--json", json_path, "--plots", plots]


def _parts_dir(page: Page, rel: str, data: dict) -> str | None:
    """The directory (relative to the results dir) holding the parts a merged report names."""
    parts = data.get("merged_from") or []
    names = [p.get("report") for p in parts]
    candidates = sorted({page.rel(p.parent) if p.parent != page.root else "" for p in page.files
                         if p.name in names and page.rel(p) != rel})
    for folder in candidates:
        ok = True
        for part in parts:
            part_rel = f"{folder}/{part['report']}" if folder else part["report"]
            got = page.data.get(part_rel)
            if not isinstance(got, dict) or (got.get("machine") or {}).get("date") != part.get("date"):
                ok = False
                break
        if ok:
            return folder
    return None


def _merged_owner(page: Page, rel: str) -> str | None:
    """The merged report this one is a part of, if any."""
    folder = rel.rsplit("/", 1)[0] if "/" in rel else ""
    for other, data in sorted(page.data.items()):
        if other != rel and kind_of(data) == "bench_spec_merged" and _parts_dir(page, other, data) == folder:
            if any(p.get("report") == rel.rsplit("/", 1)[-1] for p in data["merged_from"]):
                return other
    return None


def _spec_row(name: str, row: dict, plain_tps: float | None = None) -> list[Any]:
    spec = row.get("spec") or {}
    draft = row.get("draft") or {}
    drafted = (spec.get("num_draft_tokens") / spec["num_drafts"]) if spec.get("num_drafts") else None
    draft_ms = (1000 * draft["seconds"] / draft["rounds"]) if draft.get("rounds") else None
    speedup = "1.00x" if name == f"tandem {PLAIN}" else _times(row.get("speedup"))
    if "vs_tandem_plain" in row:
        speedup = f"1.00x ({_times(row['vs_tandem_plain'])} tandem plain)"
    tau = row.get("tau")
    return [name, _num(tau), _num(row.get("acceptance_rate")) if drafted else "-",
            _seq(row.get("acceptance_per_position")), _num(drafted, 1), _num(draft_ms, 1),
            _num(row.get("tokens_per_second"), 1), speedup]


def _identity_line(data: dict) -> str:
    identity = data.get("identity")
    if identity is None:
        return ("Sampling (temperature > 0): outputs legitimately differ between methods, so no identity check "
                "(exactness under sampling is `tandem audit`'s job).")
    if not identity:
        return "Greedy identity with plain decoding: no method to compare."
    counts = {name: (v.get("mismatches"), v.get("prompts")) for name, v in identity.items()}
    hf = data.get("identity_transformers") or {}
    if len({c for c in counts.values()}) == 1:
        m, n = next(iter(counts.values()))
        text = f"Greedy identity with plain decoding: {m} mismatches of {n} prompts for every method"
    else:
        text = "Greedy identity with plain decoding (mismatches / prompts): " + ", ".join(
            f"{name} {m}/{n}" for name, (m, n) in counts.items())
    if hf:
        text += "; transformers " + ", ".join(f"{n} {v.get('mismatches')}/{v.get('prompts')}" for n, v in hf.items()) \
            + " against its plain `generate`"
    return text + "."


def _spec_command(page: Page, rel: str, data: dict, subtasks: list[str], plots: str) -> list[str]:
    """What was run: one `bench spec` run, or a loop of per-subtask runs and the `spec-merge` of them."""
    lines: list[str] = []
    merged = data.get("merged_from")
    owner = None if merged else _merged_owner(page, rel)
    n = data.get("num_prompts")
    what = f"{n} Spec-Bench prompts"
    if len(subtasks) == 1:
        what = f"the first {n} Spec-Bench prompts of subtask {subtasks[0]}"
    elif data.get("limit_per_subtask") is not None:
        what += f", the first {data['limit_per_subtask']} of each subtask"
    if merged:
        dates = sorted(str(p.get("date")) for p in merged)
        folder = _parts_dir(page, rel, data)
        lines.append(f"`{KINDS['bench_spec_merged']}` of {len(merged)} `{KINDS['bench_spec']}` runs, one sitting per "
                     f"subtask ({dates[0]} to {dates[-1]}): {what}.")
        lines.append("")
        part_json = page.shown(f"{folder}/{LOOP_VARIABLE}.json" if folder else f"{LOOP_VARIABLE}.json")
        loop = " ".join(s for p in merged for s in p.get("subtasks", []))
        words = _spec_words(data, [LOOP_VARIABLE], part_json, "")
        part_cmd = _command(words, _variant_env(data.get("machine")))
        parts = page.shown(f"{folder}/*.json") if folder is not None else " ".join(p["report"] for p in merged)
        merge_words = ["tandem", "bench", "spec-merge", "PARTS", "--json", page.shown(rel), "--plots", plots]
        lines += _code([f"for cat in {loop}; do", f"  {part_cmd}", "done",
                        _command(merge_words).replace("PARTS", parts)])
        if folder is None:
            lines.append("(the parts' directory is not in the results directory)")
    else:
        lines.append(f"`{KINDS['bench_spec']}`: {what}" + (f"; one part of {page.link(owner)}" if owner else "") + ".")
        lines.append("")
        lines += _code([_command(_spec_words(data, subtasks, page.shown(rel), plots), _variant_env(data.get("machine")))])
    return lines


def _spec_subtask_table(data: dict, subtasks: list[str], methods: list[str], overall: dict) -> list[str]:
    hf_names = [name for name in (overall.get("transformers") or {}) if name != PLAIN]
    lines = ["", "Per subtask (tau / speedup over tandem plain"
             + ("; transformers: speedup over its plain `generate`" if hf_names else "") + "):", ""]
    sub_header = ["subtask", "n", "plain tok/s", *methods, *[f"hf {n}" for n in hf_names]]
    if hf_names:
        sub_header.append("hf plain tok/s")
    sub_rows = []
    for cat in [*subtasks, OVERALL]:
        row = data["categories"][cat]
        t = row.get("tandem") or {}
        cells = [f"**{cat}**" if cat == OVERALL else cat, row.get("num_prompts"),
                 _num((t.get(PLAIN) or {}).get("tokens_per_second"), 1)]
        cells += [f"{_num((t.get(m) or {}).get('tau'))} / {_times((t.get(m) or {}).get('speedup'))}" for m in methods]
        hf = row.get("transformers") or {}
        cells += [_times((hf.get(n) or {}).get("speedup")) for n in hf_names]
        if hf_names:
            cells.append(_num((hf.get(PLAIN) or {}).get("tokens_per_second"), 1))
        sub_rows.append(cells)
    return lines + table(sub_header, sub_rows)


def _spec_curve_line(curve: dict) -> list[str]:
    if "1" not in curve:
        return []
    sizes = [n for n in (2, 4, 8, 16, 32) if str(n) in curve]
    return ["", f"Forward cost curve in the run: c({') / c('.join(map(str, sizes))}) = "
            + " / ".join(_num(_curve_ratio(curve, n)) for n in sizes)
            + f" x one token ({_num(1000 * curve['1'], 1)} ms)."]


def spec_section(page: Page, rel: str, data: dict) -> list[str]:
    subtasks = _subtasks(data)
    stem = rel[: -len(".json")]
    plots_rel, pngs = page.sibling_plots(rel)
    plots = page.shown(plots_rel) if plots_rel and plots_rel == stem else ""
    lines = _spec_command(page, rel, data, subtasks, plots)
    lines.append("")
    mode = "greedy" if not data.get("temperature") else f"temperature {data['temperature']:g} (seeded per prompt)"
    lines.append(_machine_line(page, rel, data.get("machine")))
    lines.append("")
    own_k = any("@" in str(m.get("label", "")) for m in data["methods"])
    lines.append(f"Target {data.get('model')} ({data.get('quantization')} weights, {data.get('dtype')} activations), "
                 f"{mode}, k = {data.get('num_draft_tokens')}{' where a method sets no shape' if own_k else ''}, up to {data.get('max_new_tokens')} new tokens, batch 1. "
                 + _identity_line(data))
    lines.append("")
    overall = data["categories"].get(OVERALL) or {}
    tandem = overall.get("tandem") or {}
    header = ["configuration", "tau", "acceptance rate", "acceptance per position", "drafted per round",
              "draft ms per round", "tok/s", "speedup"]
    rows = [_spec_row(f"tandem {name}", row) for name, row in tandem.items()]
    rows += [_spec_row(f"transformers {name}", row) for name, row in (overall.get("transformers") or {}).items()]
    lines.append(f"Overall ({overall.get('num_prompts')} prompts):")
    lines.append("")
    lines += table(header, rows)
    methods = [name for name in tandem if name != PLAIN]
    if len(subtasks) > 1:
        lines += _spec_subtask_table(data, subtasks, methods, overall)
    lines += _spec_curve_line(data.get("cost_curve") or {})
    if pngs:
        lines += ["", "Plots: " + ", ".join(page.link(p, p.rsplit("/", 1)[-1]) for p in pngs) + "."]
    return lines


# ---- bench base ----------------------------------------------------------------------------------


def _config_of(name: str) -> str | None:
    """`tandem QUANT/DTYPE (kernels)` -> the `--configs` entry DTYPE/QUANT."""
    m = re.match(r"tandem (\w+)/(\w+)", name)
    return f"{m.group(2)}/{m.group(1)}" if m else None


def _base_words(page: Page, rel: str, data: dict, plot_rel: str | None) -> list[str]:
    """The `tandem bench base` command that wrote the report."""
    results = data.get("results") or []
    kernels = data.get("kernels")
    words = ["tandem", "bench", "base"]
    if data.get("model") not in (None, DEFAULT_MODEL):
        words += ["--model", str(data["model"])]
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
    plot = page.shown(plot_rel) if plot_rel and plot_rel.endswith(".png") else ""
    return words + ["--out", page.shown(rel), "--plot", plot]


def _base_table(data: dict, results: list[dict]) -> list[str]:
    """One row per configuration, with its ratios to transformers and llama.cpp when they ran."""
    ref_hf = next((r.get("tokens_per_second") for r in results if str(r.get("name", "")).startswith("transformers")), None)
    ref_cpp = next((r.get("tokens_per_second") for r in results if str(r.get("name", "")).startswith("llama.cpp")), None)
    header = ["configuration", "tok/s"]
    if ref_hf:
        header.append("vs transformers")
    if ref_cpp:
        header.append("vs llama.cpp")
    header += ["weights read (MB)", "of the read-bandwidth limit", "greedy agreement (tokens)", "step ms",
               "cost c(2) / c(4) / c(8) / c(16) / c(32)"]
    rows = []
    for r in results:
        tps = r.get("tokens_per_second")
        cells = [r.get("name"), _num(tps, 1)]
        if ref_hf:
            cells.append(_times(tps / ref_hf) if isinstance(tps, (int, float)) else "-")
        if ref_cpp:
            cells.append(_times(tps / ref_cpp) if isinstance(tps, (int, float)) else "-")
        curve = r.get("cost_curve") or {}
        cells += [_num(r["weight_bytes"] / 1e6, 0) if r.get("weight_bytes") else "-",
                  f"{100 * r['bandwidth_fraction']:.0f}%" if isinstance(r.get("bandwidth_fraction"), (int, float)) else "-",
                  _num(r.get("agreement_tokens"), 1), _num(r.get("step_ms"), 1),
                  _seq([_curve_ratio(curve, n) for n in (2, 4, 8, 16, 32)]) if curve else "-"]
        rows.append(cells)
    lines = table(header, rows)
    if ref_hf or any(r.get("agreement_tokens") is not None for r in results):
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
        ["CPU", kernels.get("cpu")],
        ["instruction sets", ", ".join(kernels.get("isa") or []) or "-"],
        ["kernels, threads", f"{kernels.get('kernels')}, {kernels.get('threads')}"],
        ["read bandwidth", f"{_num(kernels.get('bandwidth_gb_s'), 1)} GB/s"],
        ["int8 peak (register loop)", f"{_num(kernels.get('int8_peak_gmac_s'), 0)} GMAC/s"],
        ["weights per step: tandem / the GGUF's own",
         f"{_num((kernels.get('tandem_bytes') or 0) / 1e6, 0)} / "
         f"{_num((kernels.get('gguf_bytes') or 0) / 1e6, 0) if kernels.get('gguf_bytes') else '-'} MB"],
        [f"decode step at a {kernels.get('context')}-token context",
         f"{_num(step)} ms" + (f" = {_times(step / floor)} the floor ({_num(floor)} ms)" if step and floor else "")],
        [" / ".join(f"c({n})" for n in sizes), _seq([curve.get(str(n)) for n in sizes])],
        ["each extra verified row (n = 1..16)",
         f"{_num(kernels.get('extra_row_ms'))} ms" + (
             f" = {100 * kernels['extra_row_efficiency']:.0f}% of the peak"
             if isinstance(kernels.get("extra_row_efficiency"), (int, float)) else "")],
        ["torch bf16 `F.linear` reference step", f"{_num(kernels.get('bf16_step_ms'), 1)} ms"
         + (f" (c(8) {_num(bf16.get('8'))})" if "8" in bf16 else "")],
    ]
    return ["", "Kernel section:", "", *table(["measured", "value"], krows)]


def base_section(page: Page, rel: str, data: dict) -> list[str]:
    results = data.get("results") or []
    kernels = data.get("kernels")
    plot_rel, pngs = page.sibling_plots(rel)
    words = _base_words(page, rel, data, plot_rel)
    machine = None
    if kernels:
        machine = {"cpu": kernels.get("cpu"), "isa": kernels.get("isa"), "threads": kernels.get("threads"),
                   "kernels": kernels.get("kernels")}
    lines = [f"`{KINDS['bench_base']}`: plain decoding of {data.get('model')}, greedy, batch 1, "
             f"{data.get('num_prompts')} Spec-Bench prompts (one per subtask, chat template where the model has one) x {data.get('max_new_tokens')} new tokens "
             f"(prefill included), {data.get('clock')} clock; read bandwidth {_num(data.get('bandwidth_gb_s'), 1)} GB/s "
             "measured in the run.", ""]
    lines += _code([_command(words, _variant_env(machine))])
    lines += ["", _machine_line(page, rel, machine), ""]
    lines += _base_table(data, results)
    if kernels:
        lines += _kernel_table(kernels)
    if pngs:
        lines += ["", "Plot: " + ", ".join(page.link(p, p.rsplit("/", 1)[-1]) for p in pngs) + "."]
    return lines


# ---- advise --------------------------------------------------------------------------------------


def advise_section(page: Page, rel: str, data: dict) -> list[str]:
    words = ["tandem", "advise"]
    if data.get("model") not in (None, DEFAULT_MODEL):
        words += ["--model", str(data["model"])]
    if (data.get("quantization"), data.get("dtype")) != AUTO_WEIGHTS:
        words += ["--quantization", str(data.get("quantization")), "--dtype", str(data.get("dtype"))]
    words += ["--limit", str(data.get("num_prompts")), "--max-new-tokens", str(data.get("max_new_tokens")),
              "--k-max", str(data.get("k_max"))]
    if data.get("threads") is not None and data.get("threads") != data.get("cores"):
        words += ["--threads", str(data["threads"])]
    if data.get("temperature"):
        words += ["--temperature", f"{data['temperature']:g}"]
    drafters = data.get("drafters") or []
    words += ["--drafters", *[str(d.get("label")) for d in drafters], "--json", page.shown(rel)]
    curve = data.get("cost_curve") or {}
    lines = [f"`{KINDS['advise']}`: which drafter, which k, and whether to speculate, measured on "
             f"{data.get('num_prompts')} Spec-Bench prompts (one per subtask), up to {data.get('max_new_tokens')} new "
             f"tokens, {data.get('model')} ({data.get('quantization')}/{data.get('dtype')}), {data.get('threads')} of "
             f"{data.get('cores')} cores.", ""]
    lines += _code([_command(words, _variant_env(data.get("machine")))])
    lines += ["", _machine_line(page, rel, data.get("machine")), ""]
    if "1" in curve:
        lines += [f"One decode forward {_num(1000 * curve['1'], 1)} ms; verifying 4 drafts "
                  f"{_times(_curve_ratio(curve, 5))} one forward; reading the "
                  f"{_num((data.get('weight_bytes') or 0) / 1e6, 0)} MB of weights at the measured "
                  f"{_num(data.get('bandwidth_gb_s'), 1)} GB/s takes {_num(1000 * (data.get('bandwidth_limit_seconds') or 0), 1)} ms.", ""]
    k_max = data.get("k_max")
    rows = []
    for d in drafters:
        taus = d.get("expected_tau") or {}
        best = d.get("best_k")
        rows.append([d.get("label"), _seq([taus[k] for k in sorted(taus, key=int)]),
                     f"{_times(d.get('predicted_at_k_measured'))} / {_times(d.get('measured_at_k_measured'))}",
                     _num(d.get("measured_tau")), "0 (do not speculate)" if best == 0 else best,
                     f"{_times(d.get('predicted_best'))} / {_times(d.get('measured_best'))}",
                     d.get("break_even_batch")])
    lines += table(["drafter", f"expected tau, k = 1..{k_max}", f"at k = {k_max}: predicted / measured speedup",
                    f"measured tau at k = {k_max}", "best k", "at best k: predicted / measured",
                    "stops paying at concurrency"], rows)
    lines += ["", f"Recommendation: \"{data.get('recommendation')}\"."]
    warnings = data.get("warnings") or []
    if warnings:
        lines.append("Warnings: " + ", ".join(f"`{w.get('kind')}` ({w.get('subject')})" for w in warnings) + ".")
    return lines


# ---- bench serve ---------------------------------------------------------------------------------


def serve_section(page: Page, rel: str, data: dict) -> list[str]:
    modes = list(data.get("modes") or [])
    words = ["tandem", "bench", "serve"]
    if data.get("model") not in (None, DEFAULT_MODEL):
        words += ["--model", str(data["model"])]
    if data.get("algorithm"):
        words += ["--algorithm", str(data["algorithm"])]
    if data.get("num_draft_tokens", 4) != 4:
        words += ["--num-draft-tokens", str(data["num_draft_tokens"])]
    if sorted(modes) != sorted(("adaptive", "fixed", "off")):
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
    plot_rel, pngs = page.sibling_plots(rel)
    words += ["--out", page.shown(rel), "--plot", page.shown(plot_rel) if plot_rel and plot_rel.endswith(".png") else ""]
    given = [m for m in modes if m not in (data.get("launched") or modes)]
    lines = [f"`{KINDS['bench_serve']}`: `tandem serve` under load, speculation {' / '.join(modes)} side by side; "
             f"{data.get('model')}, drafter {data.get('algorithm') or 'the model default'}, "
             f"k = {data.get('num_draft_tokens')}, greedy streamed chat requests of up to {data.get('max_tokens')} "
             f"tokens, {data.get('num_prompts')} Spec-Bench prompts"
             + (f" ({', '.join(data['categories'])})" if data.get("categories") else "") + ".", ""]
    lines += _code([_command(words)])
    if given:
        lines.append(f"(modes {', '.join(given)} ran on servers given with `--url`)")
    lines += ["", _machine_line(page, rel, data.get("machine")), ""]
    ref = "off" if "off" in modes else modes[0] if modes else None
    others = [m for m in modes if m != ref]
    header = ["users", f"{ref} tok/s", *[f"{m} x" for m in others], f"{ref} user tok/s",
              *[f"{m} user x" for m in others], *[f"{m} tau (acceptance)" for m in modes if m != "off"],
              f"TTFT p50 s ({ref})", "errors"]
    rows = []
    for level in sorted(data["levels"], key=lambda c: int(c) if str(c).isdigit() else 0):
        per = data["levels"][level]
        r = per.get(ref) or {}
        cells = [level, _num(r.get("throughput"), 1)]
        cells += [_times((per.get(m) or {}).get("speedup")) for m in others]
        cells.append(_num(r.get("per_user_tps"), 1))
        cells += [_times((per.get(m) or {}).get("per_user_speedup")) for m in others]
        cells += [f"{_num((per.get(m) or {}).get('tau'))} ({_num((per.get(m) or {}).get('acceptance_rate'))})"
                  for m in modes if m != "off"]
        ttft = r.get("ttft_p50_ms")
        cells.append(_num(ttft / 1000 if isinstance(ttft, (int, float)) else None, 1))
        cells.append(sum((per.get(m) or {}).get("errors") or 0 for m in modes))
        rows.append(cells)
    lines += table(header, rows)
    identity = data.get("identity") or {}
    if identity:
        lines += ["", "Same answers across modes (greedy): " + ", ".join(
            f"{m} {v.get('compared', 0) - v.get('mismatches', 0)}/{v.get('compared')}" for m, v in identity.items())
            + f". x = throughput over `{ref}` at the same concurrency; user tok/s = streaming speed after the first token."]
    if pngs:
        lines += ["", "Plot: " + ", ".join(page.link(p, p.rsplit("/", 1)[-1]) for p in pngs) + "."]
    return lines


# ---- anything else -------------------------------------------------------------------------------


def generic_section(page: Page, rel: str, data: Any) -> list[str]:
    known = ", ".join(f"`{c}`" for c in dict.fromkeys(KINDS.values()))
    if not isinstance(data, dict):
        size = f" of {len(data)} items" if isinstance(data, list) else ""
        return [f"Not a report this page knows ({known}): a JSON {type(data).__name__}{size}."]
    scalars = [[k, _cell(json.dumps(v) if isinstance(v, str) else v)] for k, v in data.items()
               if v is None or isinstance(v, (str, int, float, bool))]
    nested = [k for k, v in data.items() if isinstance(v, (dict, list))]
    lines = [f"Not a report this page knows ({known}); its top-level fields:", ""]
    if scalars:
        lines += table(["field", "value"], scalars)
    else:
        lines.append("(no scalar fields)")
    if nested:
        lines += ["", "Nested fields: " + ", ".join(f"`{k}`" for k in nested) + "."]
    machine = data.get("machine")
    if isinstance(machine, dict):
        lines += ["", _machine_line(page, rel, machine)]
    return lines


SECTIONS: dict[str, Callable[[Page, str, Any], list[str]]] = {
    "bench_spec": spec_section,
    "bench_spec_merged": spec_section,
    "bench_base": base_section,
    "advise": advise_section,
    "bench_serve": serve_section,
    "unknown": generic_section,
}


def render(results_dir: str | Path = "results", out: str | Path | None = None) -> str:
    """The whole page for `results_dir`, as `--out` (default results_dir/README.md) will hold it."""
    root = Path(results_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"no results directory {root}")
    page = Page(root, Path(out) if out is not None else root / "README.md")
    body: list[str] = []
    contents: list[str] = []
    for path in page.files:
        rel = page.rel(path)
        contents.append(f"- [{rel}](#{slug(rel)})")
        body += ["", f"## {rel}", ""]
        if rel in page.errors:
            body.append(f"Could not be read as JSON ({page.errors[rel]}).")
            continue
        data = page.data[rel]
        kind = kind_of(data)
        try:
            body += SECTIONS[kind](page, rel, data)
        except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as err:
            # A known kind with an unexpected shape: say so and fall back to the generic view.
            body += [f"(a `{kind}` report whose fields this page could not read: {type(err).__name__}: {err})", ""]
            body += generic_section(page, rel, data)
    algorithms = page.root.resolve().parent / "docs" / "algorithms.md"
    where = (f"[docs/algorithms.md]({os.path.relpath(algorithms, page.out_dir).replace(os.sep, '/')})"
             if algorithms.is_file() else "docs/algorithms.md")
    head = [
        "# Results",
        "",
        f"Generated by `tandem bench results` from the {len(page.files)} JSON files under `{page.prefix}/`: do not "
        "edit it by hand; rerun the command after adding or changing a result (the tests check it is up to date).",
        "",
        "One section per file, in path order: the command that produced it, rebuilt from the file's own fields "
        "(fields a file does not record, such as `--max-model-len` or a prompts file, are left at their defaults); "
        "the machine it records; its headline numbers. Files without a kernel variant were measured on tandem's "
        "previous kernels and stay as history. Every figure is a ratio within one run on a shared machine, not a "
        f"constant. **tau** = tokens committed per target forward, the recovered/bonus token included (plain "
        f"decoding has 1); **acceptance rate** = accepted / drafted draft tokens; **acceptance per position** i = "
        f"P(draft i passes | the ones before it passed); tok/s = mean over prompts, prefill included; speedup = over "
        f"the same engine's plain decoding on the same prompts ({where}).",
        "",
        *contents,
    ]
    return "\n".join(head + body).rstrip() + "\n"


def results_command(args) -> int:
    text = render(args.results_dir, args.out)
    out = Path(args.out)
    if getattr(args, "check", False):
        current = out.read_text() if out.is_file() else None
        if current != text:
            print(f"{out} is out of date: run `tandem bench results --results-dir {args.results_dir} --out {args.out}`")
            return 1
        print(f"{out} is up to date")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out} ({text.count(chr(10))} lines, {len(list(Path(args.results_dir).rglob('*.json')))} files)")
    return 0
