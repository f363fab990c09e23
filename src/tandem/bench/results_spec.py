"""The results page's section for a `tandem bench spec` report, or a `tandem bench spec-merge` of several.

The command that wrote it (one run, or the per-subtask loop and the merge of its parts), the target and
decoding settings, the overall table (one row per tandem method and transformers baseline), the table
per subtask and the forward cost curve.
"""

from __future__ import annotations

from typing import Any

from tandem.bench.results_format import (LOOP_VARIABLE, bash_block, curve_ratio, num, seq, shell_line, table,
                                         times)
from tandem.bench.results_page import KINDS, Page, kind_of, machine_line, model_flags, variant_env

SPEC_SUBTASKS = ("multi_turn", "translation", "summarization", "qa", "math_reasoning", "rag")
OVERALL = "overall"
PLAIN = "plain"


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
    words = ["tandem", "bench", "spec", *model_flags(data, weights=True)]
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
    if data.get("structured_output") == "json_object":
        words.append("--json-object")
    machine = data.get("machine") or {}
    if machine.get("torch_threads") and machine.get("cores") and machine["torch_threads"] != machine["cores"]:
        words += ["--threads", str(machine["torch_threads"])]
    words += ["--methods", *[_method_arg(m) for m in data["methods"]]]
    if data.get("note"):
        words += ["--note", data["note"]]
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


def _spec_row(name: str, row: dict) -> list[Any]:
    spec = row.get("spec") or {}
    draft = row.get("draft") or {}
    # Tokens per non-empty draft; drafting time per round the drafter was asked (empty drafts included).
    drafted = (spec.get("num_draft_tokens") / spec["num_drafts"]) if spec.get("num_drafts") else None
    draft_ms = (1000 * draft["seconds"] / draft["rounds"]) if draft.get("rounds") else None
    speedup = "1.00x" if name == f"tandem {PLAIN}" else times(row.get("speedup"))
    if "vs_tandem_plain" in row:
        speedup = f"1.00x ({times(row['vs_tandem_plain'])} tandem plain)"
    tau = row.get("tau")
    return [name, num(tau), num(row.get("acceptance_rate")) if drafted else "-",
            seq(row.get("acceptance_per_position")), num(drafted, 1), num(draft_ms, 2),
            num(row.get("tokens_per_second"), 1), speedup]


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


def _prompts_text(data: dict, subtasks: list[str]) -> str:
    """Which prompts the report ran: all, the first of one subtask, or the first few of each."""
    n = data.get("num_prompts")
    if len(subtasks) == 1:
        return f"the first {n} Spec-Bench prompts of subtask {subtasks[0]}"
    if data.get("limit_per_subtask") is not None:
        return f"{n} Spec-Bench prompts, the first {data['limit_per_subtask']} of each subtask"
    return f"{n} Spec-Bench prompts"


def _merged_command(page: Page, rel: str, data: dict, what: str, plots: str) -> list[str]:
    """A merged report: the loop of per-subtask `bench spec` runs, then the `spec-merge` of their parts."""
    merged = data["merged_from"]
    dates = sorted(str(p.get("date")) for p in merged)
    folder = _parts_dir(page, rel, data)
    env = variant_env(data.get("machine"))
    if all(len(p.get("subtasks", [])) == 1 for p in merged):  # one sitting per subtask: a loop
        lines = [f"`{KINDS['bench_spec_merged']}` of {len(merged)} `{KINDS['bench_spec']}` runs, one sitting per "
                 f"subtask ({dates[0]} to {dates[-1]}): {what}.", ""]
        part_json = page.shown(f"{folder}/{LOOP_VARIABLE}.json" if folder else f"{LOOP_VARIABLE}.json")
        loop = " ".join(s for p in merged for s in p["subtasks"])
        runs = [f"for cat in {loop}; do", f"  {shell_line(_spec_words(data, [LOOP_VARIABLE], part_json, ''), env)}",
                "done"]
    else:  # parts over several subtasks each: one run per part
        lines = [f"`{KINDS['bench_spec_merged']}` of {len(merged)} `{KINDS['bench_spec']}` runs over disjoint "
                 f"subtasks ({dates[0]} to {dates[-1]}): {what}.", ""]
        runs = [shell_line(_spec_words(data, p.get("subtasks", []),
                                       page.shown(f"{folder}/{p['report']}" if folder else p["report"]), ""), env)
                for p in merged]
    if folder:  # the parts' own directory: all of it
        parts = page.shown(f"{folder}/*.json")
    else:  # beside other reports (or not in the results directory): each part by name
        parts = " ".join(page.shown(p["report"]) if folder == "" else p["report"] for p in merged)
    merge_words = ["tandem", "bench", "spec-merge", "PARTS", "--json", page.shown(rel), "--plots", plots]
    lines += bash_block([*runs, shell_line(merge_words).replace("PARTS", parts)])
    if folder is None:
        lines.append("(the parts' directory is not in the results directory)")
    return lines


def _spec_command(page: Page, rel: str, data: dict, subtasks: list[str], plots: str) -> list[str]:
    """What was run: one `bench spec` run, or a loop of per-subtask runs and the `spec-merge` of them."""
    what = _prompts_text(data, subtasks)
    if data.get("merged_from"):
        return _merged_command(page, rel, data, what, plots)
    owner = _merged_owner(page, rel)
    lines = [f"`{KINDS['bench_spec']}`: {what}" + (f"; one part of {page.link(owner)}" if owner else "") + ".", ""]
    words = _spec_words(data, subtasks, page.shown(rel), plots)
    return lines + bash_block([shell_line(words, variant_env(data.get("machine")))])


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
                 num((t.get(PLAIN) or {}).get("tokens_per_second"), 1)]
        cells += [f"{num((t.get(m) or {}).get('tau'))} / {times((t.get(m) or {}).get('speedup'))}" for m in methods]
        hf = row.get("transformers") or {}
        cells += [times((hf.get(n) or {}).get("speedup")) for n in hf_names]
        if hf_names:
            cells.append(num((hf.get(PLAIN) or {}).get("tokens_per_second"), 1))
        sub_rows.append(cells)
    return lines + table(sub_header, sub_rows)


def _spec_curve_line(curve: dict) -> list[str]:
    if "1" not in curve:
        return []
    sizes = [n for n in (2, 4, 8, 16, 32) if str(n) in curve]
    return ["", f"Forward cost curve in the run: c({') / c('.join(map(str, sizes))}) = "
            + " / ".join(num(curve_ratio(curve, n)) for n in sizes)
            + f" x one token ({num(1000 * curve['1'], 1)} ms)."]


def _mode(data: dict) -> str:
    return "greedy" if not data.get("temperature") else f"temperature {data['temperature']:g} (seeded per prompt)"


def _settings_line(data: dict, mode: str) -> str:
    """The target, its weights, the decoding mode, k and the token budget, then the identity check."""
    own_k = any("@" in str(m.get("label", "")) for m in data["methods"])
    return (f"Target {data.get('model')} ({data.get('quantization')} weights, {data.get('dtype')} activations), "
            f"{mode}, k = {data.get('num_draft_tokens')}{' where a method sets no shape' if own_k else ''}, "
            f"up to {data.get('max_new_tokens')} new tokens, batch 1. " + _identity_line(data))


def spec_section(page: Page, rel: str, data: dict) -> list[str]:
    subtasks = _subtasks(data)
    stem = rel[: -len(".json")]
    plots_rel, pngs = page.sibling_plots(rel)
    plots = page.shown(plots_rel) if plots_rel and plots_rel == stem else ""
    lines = _spec_command(page, rel, data, subtasks, plots)
    if data.get("note"):
        lines += ["", f"Note: {data['note']}"]
    mode = _mode(data)
    lines += ["", machine_line(rel, data.get("machine")), "", _settings_line(data, mode), ""]
    overall = data["categories"].get(OVERALL) or {}
    tandem = overall.get("tandem") or {}
    header = ["configuration", "tau", "acceptance rate", "acceptance per position", "tokens per draft",
              "draft ms per round asked", "tok/s", "speedup"]
    rows = [_spec_row(f"tandem {name}", row) for name, row in tandem.items()]
    rows += [_spec_row(f"transformers {name}", row) for name, row in (overall.get("transformers") or {}).items()]
    lines += [f"Overall ({overall.get('num_prompts')} prompts):", ""]
    lines += table(header, rows)
    methods = [name for name in tandem if name != PLAIN]
    if len(subtasks) > 1:
        lines += _spec_subtask_table(data, subtasks, methods, overall)
    lines += _spec_curve_line(data.get("cost_curve") or {})
    return lines + page.plots_line(pngs, "Plots")
