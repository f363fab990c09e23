"""`tandem bench spec-merge`: one report from `tandem bench spec` runs over disjoint subtasks.

The full Spec-Bench suite (480 prompts, every drafter) takes hours on a small CPU. It can be run
one subtask at a time (`--categories`), in as many sittings as needed, and merged here. Subtask
rows are kept as they were measured. The overall row is recomputed exactly as a single run would
compute it: tokens/s from the per-prompt tokens and seconds, tau and acceptance from the summed
speculation counters, speedups from those. Every configuration still ran next to plain decoding
on each prompt, so every ratio remains a same-run ratio.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from tandem.bench.draft_profile import DraftProfile
from tandem.bench.prompts import spec_bench_prompts
from tandem.bench.spec import OVERALL, PLAIN, summary_row
from tandem.bench.spec_report import print_identity, print_table, write_outputs
from tandem.paths import check_not_an_input
from tandem.types import SpecStats

# Report fields every merged run must share: they define what was measured.
SHARED_FIELDS = ("model", "quantization", "dtype", "temperature", "seed", "num_draft_tokens", "max_new_tokens",
                 "methods", "transformers")
# What a report's machine must share with the others': the CPU, the kernels and the threads.
MACHINE_FIELDS = ("cpu", "cpu_model", "kernels", "torch_threads")
SIDES = ("tandem", "transformers")


def merge_spec_reports(reports: list[dict], names: list[str] | None = None) -> dict:
    """Merge `bench spec` reports over disjoint subtasks into one report (see the module doc).

    names: how each report is called in errors and in `merged_from` (e.g. its file name).
    """
    if not reports:
        raise ValueError("no reports to merge")
    names = names or [f"report {i + 1}" for i in range(len(reports))]
    for name, rep in zip(names, reports):
        if not (isinstance(rep, dict) and {"categories", "prompts", "methods"} <= set(rep)):
            raise ValueError(f"{name} is not a `tandem bench spec` report (it lacks categories, prompts or methods)")
    first = reports[0]
    for name, rep in zip(names[1:], reports[1:]):
        for key in SHARED_FIELDS:
            if rep.get(key) != first.get(key):
                raise ValueError(f"cannot merge {name} with {names[0]}: {key} differs "
                                 f"({rep.get(key)!r} vs {first.get(key)!r}); merge runs of one configuration")
        for key in MACHINE_FIELDS:  # the merged figures are labelled with one machine: they must share it
            ours, theirs = (r.get("machine", {}).get(key) for r in (rep, first))
            if ours != theirs:
                raise ValueError(f"cannot merge {name} with {names[0]}: they ran on different machines or settings "
                                 f"({key} {ours!r} vs {theirs!r})")
    configs = _configurations(first, names[0])
    categories: dict[str, dict] = {}
    owner: dict[str, str] = {}
    prompts: list[dict] = []
    identity: dict[str, dict] | None = {} if first["identity"] is not None else None
    identity_hf: dict[str, dict] | None = {} if first["identity"] is not None else None
    for name, rep in zip(names, reports):
        if _configurations(rep, name) != configs:
            raise ValueError(f"cannot merge {name} with {names[0]}: they ran different configurations")
        for cat, row in rep["categories"].items():
            if cat == OVERALL:
                continue
            if cat in categories:
                raise ValueError(f"subtask {cat} is in both {owner[cat]} and {name}; merge runs over disjoint subtasks")
            categories[cat], owner[cat] = row, name
        if identity is not None:
            _add_identity(identity, rep["identity"], len(prompts))
            _add_identity(identity_hf, rep.get("identity_transformers") or {}, len(prompts))
        prompts.extend(rep["prompts"])

    overall: dict = {"num_prompts": len(prompts)}
    for side in SIDES:
        if side in configs:
            overall[side] = _overall_rows(side, configs[side], categories, prompts)
    if "transformers" in overall:
        hf_plain, plain = overall["transformers"][PLAIN], overall["tandem"][PLAIN]
        hf_plain["vs_tandem_plain"] = hf_plain["tokens_per_second"] / plain["tokens_per_second"]

    merged = {key: first.get(key) for key in SHARED_FIELDS}
    merged.update(
        num_prompts=len(prompts),
        definitions=first["definitions"],
        machine=_merged_machine([r["machine"] for r in reports]),
        categories={**categories, OVERALL: overall},
        prompts=prompts,
        identity=identity,
        identity_transformers=identity_hf,
        cost_curve=_median_cost_curve([r.get("cost_curve") or {} for r in reports]),
        limit_per_subtask=max((r.get("limit_per_subtask") or 0) for r in reports) or None,
        skipped_methods={k: v for r in reports for k, v in (r.get("skipped_methods") or {}).items()},
        wall_seconds=round(sum(r.get("wall_seconds") or 0.0 for r in reports), 1),
        merged_from=[{"report": name, "subtasks": [c for c in rep["categories"] if c != OVERALL],
                      "num_prompts": rep["num_prompts"], "date": rep["machine"]["date"],
                      "wall_seconds": rep.get("wall_seconds")} for name, rep in zip(names, reports)],
    )
    return merged


def _merged_machine(machines: list[dict]) -> dict:
    """The parts' shared machine, with the highest steal any of them saw (a noisy sitting must
    not hide behind a quiet one)."""
    merged = dict(machines[0])
    steals = [m["steal"] for m in machines if isinstance(m.get("steal"), (int, float))]
    if steals:
        merged["steal"] = max(steals)
    return merged


def _configurations(report: dict, name: str) -> dict[str, list[str]]:
    """{side: configuration names, plain first} of a report's overall row."""
    overall = report["categories"].get(OVERALL)
    if overall is None:
        raise ValueError(f"{name} is not a `tandem bench spec` report (no overall row)")
    return {side: list(overall[side]) for side in SIDES if side in overall}


def _add_identity(total: dict, part: dict, offset: int) -> None:
    for name, v in part.items():
        into = total.setdefault(name, {"mismatches": 0, "prompts": 0, "details": []})
        into["mismatches"] += v["mismatches"]
        into["prompts"] += v["prompts"]
        into["details"] += [{**d, "index": d["index"] + offset} for d in v["details"]]


def _overall_rows(side: str, names: list[str], categories: dict[str, dict], prompts: list[dict]) -> dict:
    rows: dict[str, dict] = {}
    for name in names:  # plain comes first: the others' speedups are over it
        key = f"{side} {name}"
        tokens = [p["generated"][key] for p in prompts]
        seconds = [p["seconds"][key] for p in prompts]
        parts = [row[side][name] for row in categories.values()]
        stats = profile = None
        if all("spec" in r for r in parts):
            stats = SpecStats()
            for r in parts:
                # Reports from before `num_committed_tokens` was written: every generated token was committed.
                stats.merge(SpecStats.from_dict({"num_committed_tokens": r["tokens"], **r["spec"]}))
        if all("draft" in r for r in parts):
            profile = DraftProfile()
            for r in parts:
                profile.merge(DraftProfile.from_dict(r["draft"]))
        rows[name] = summary_row(tokens, seconds, stats, profile, None if name == PLAIN else rows[PLAIN])
    return rows


def _median_cost_curve(curves: list[dict]) -> dict:
    sizes = sorted({n for c in curves for n in c}, key=int)
    return {n: statistics.median(c[n] for c in curves if n in c) for n in sizes}


def merge_command(args) -> int:
    paths = [Path(p) for p in args.reports]
    if args.json:
        check_not_an_input(args.json, paths, "--json")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"no such report: {', '.join(missing)}")
    reports = []
    for p in paths:
        try:
            reports.append(json.loads(p.read_text()))
        except json.JSONDecodeError as err:
            raise ValueError(f"{p} is not JSON: {err}") from err
    # Spec-Bench's subtask order, whatever order the files were named in (a shell glob sorts them).
    order = list(dict.fromkeys(p.category for p in spec_bench_prompts()))

    def rank(report: dict) -> int:
        subtasks = [c for c in report.get("categories", {}) if c != OVERALL]
        return min((order.index(c) if c in order else len(order) for c in subtasks), default=len(order))

    ranked = sorted(range(len(reports)), key=lambda i: rank(reports[i]))
    report = merge_spec_reports([reports[i] for i in ranked], [paths[i].name for i in ranked])
    print(f"merged {len(paths)} reports: " + ", ".join(
        f"{m['report']} ({', '.join(m['subtasks'])}, {m['num_prompts']} prompts)" for m in report["merged_from"]))
    print_table(report)
    print_identity(report)
    write_outputs(report, args.json, args.plots)
    mismatches = sum(v["mismatches"] for v in (report["identity"] or {}).values())
    return 1 if mismatches else 0
