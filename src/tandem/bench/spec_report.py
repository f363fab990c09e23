"""`tandem bench spec`, the command: load, run every configuration (bench/spec.py), print the
tables, write the JSON report and the plots."""

from __future__ import annotations

import logging
import time

from tandem.bench.base import save_report
from tandem.bench.plots import plot_spec_report
from tandem.bench.prompts import spec_bench_prompts
from tandem.bench.spec import (
    OVERALL,
    PLAIN,
    WARMUP_TEXT,
    SpecCase,
    default_methods,
    machine_line,
    parse_methods,
    run_spec_bench,
)
from tandem.bench.spec_hf import Baselines, load_transformers, pick_assistant
from tandem.bench.steal import steal_notice
from tandem.config import EngineConfig, StructuredOutput
from tandem.llm import LLM
from tandem.model.cost import forward_cost_curve
from tandem.model.loader import load_model


def bench_spec(args) -> dict:
    if args.limit < 1:
        raise ValueError(f"--limit must be >= 1 (prompts per subtask), got {args.limit}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.json_object and not args.skip_transformers:
        raise ValueError("--json-object holds tandem's answers to a JSON object; transformers' are not: add "
                         "--skip-transformers")
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
            structured_output=StructuredOutput(json_object=True) if args.json_object else None,
        )
    finally:
        engine_log.setLevel(level)
    report["cost_curve"] = forward_cost_curve(loaded)
    report["limit_per_subtask"] = args.limit
    if args.json_object:
        report["structured_output"] = "json_object"
    report["skipped_methods"] = skipped
    report["wall_seconds"] = round(time.perf_counter() - t0, 1)
    if args.note:
        report["note"] = args.note
    print_table(report)
    print_identity(report)
    print(f"total wall time {report['wall_seconds']:.0f} s")
    notice = steal_notice(report["machine"].get("steal"))
    if notice:
        print(notice)
    write_outputs(report, args.json, args.plots)
    return report


def write_outputs(report: dict, json_path: str | None, plots_dir: str | None) -> None:
    if json_path:
        save_report(report, json_path)
    if plots_dir:
        for path in plot_spec_report(report, plots_dir):
            print(f"wrote {path}")


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
    cpu = machine_line(report.get("machine", {}))
    if cpu:
        print(cpu)
    head = (f"{'configuration':34} {'tau':>5} {'acc':>5}  {'acceptance per position':24} {'draft ms/tok':>12} "
            f"{'ms/round':>8} {'tok/s':>7} {'speedup':>8}")
    print(head)
    print("-" * len(head))
    for label, r in _rows(report, OVERALL):
        tau = f"{r['tau']:5.2f}" if "tau" in r else f"{'-':>5}"
        acc = f"{r['acceptance_rate']:5.2f}" if r.get("spec", {}).get("num_draft_tokens") else f"{'-':>5}"
        per_pos = " ".join(f"{a:.2f}" for a in r.get("acceptance_per_position", [])[:6]) or "-"
        speed = f"{r['speedup']:7.2f}x" if "speedup" in r else f"{'1.00x':>8}"
        draft = r.get("draft") or {}
        per_token = f"{1000 * r['draft_seconds_per_position']:12.2f}" if draft.get("rounds") else f"{'-':>12}"
        per_round = f"{1000 * draft['seconds'] / draft['rounds']:8.2f}" if draft.get("rounds") else f"{'-':>8}"
        ece = f"  survival ECE {draft['calibration_error']:.3f}" if "calibration_error" in draft else ""
        print(f"{label:34} {tau} {acc}  {per_pos:24} {per_token} {per_round} {r['tokens_per_second']:7.1f} {speed}{ece}")
    plain_row = report["categories"][OVERALL]["tandem"].get(PLAIN)
    if plain_row and plain_row["tokens"]:
        print(f"(plain decoding: {1000 * plain_row['seconds'] / plain_row['tokens']:.2f} ms per token, prompts included: "
              "the step the draft ms compare with)")
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
          "acceptance per position = P(pass | earlier passed); draft ms/tok = drafter time per draft position "
          "asked for, ms/round = per round; tok/s = mean of per-prompt tokens/s")


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
