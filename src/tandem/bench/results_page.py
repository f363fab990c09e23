"""What every section of the results page shares: the loaded results directory, the report kinds, the machine.

`Page` holds the results/**/*.json files (parsed, or the error that stopped them) and names and links
them; `kind_of` tells a report's kind by its fields; `machine_line` and `variant_env` say where a report
was measured; `model_flags` rebuilds the model flags every command shares. The sections themselves are
in results_spec.py, results_base.py, results_advise.py and results_serve.py; the page in results_doc.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tandem.model.catalogue import DEFAULT_MODEL  # the catalogue imports no torch

# What `--quantization auto --dtype auto` resolves to for the built-in GGUF models on a CPU: rebuilt
# commands leave these flags out when a report records exactly this.
AUTO_WEIGHTS = ("native", "float32")

# The report kinds this page knows: what each one's file looks like, and the command that writes it.
SCRATCH = "tmp"

KINDS = {
    "bench_spec": "tandem bench spec",
    "bench_spec_merged": "tandem bench spec-merge",
    "bench_base": "tandem bench base",
    "advise": "tandem advise",
    "bench_serve": "tandem bench serve",
    "bench_burst": "tandem bench burst",
    "bench_agent": "tandem bench agent",
    "guidellm": "scripts/guidellm_bench.sh",
    "bench_soak": "tandem bench soak",
    "bench_replicas": "tandem bench replicas",
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


class Page:
    """What every section needs: where the files are, how to name and link them."""

    def __init__(self, results_dir: Path, out: Path) -> None:
        self.root = results_dir
        self.prefix = results_dir.resolve().name  # "results": commands name paths as run from the repository
        self.out_dir = out.resolve().parent
        # results/tmp/ holds scratch (full third-party reports, logs) that git ignores: not results.
        self.files = sorted((p for p in results_dir.rglob("*.json") if p.relative_to(results_dir).parts[0] != SCRATCH),
                            key=lambda p: p.relative_to(results_dir).as_posix())
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

    def png_arg(self, plot_rel: str | None) -> str:
        """A `--plot FILE.png` argument: the PNG beside a report, or '' when it has a plot directory or none."""
        return self.shown(plot_rel) if plot_rel and plot_rel.endswith(".png") else ""

    def plots_line(self, pngs: list[str], label: str = "Plot") -> list[str]:
        """The line linking a report's PNGs (after a blank line); nothing when it has none."""
        if not pngs:
            return []
        return ["", f"{label}: " + ", ".join(self.link(p, p.rsplit("/", 1)[-1]) for p in pngs) + "."]


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
    if isinstance(data.get("results"), list) and "burst" in data:
        return "bench_burst"
    if isinstance(data.get("runs"), dict) and "cache on" in data["runs"]:
        return "bench_agent"
    if data.get("tool") == "guidellm" and isinstance(data.get("levels"), list):
        return "guidellm"
    if isinstance(data.get("soak"), dict):
        return "bench_soak"
    if data.get("bench") == "replicas" and isinstance(data.get("levels"), dict):
        return "bench_replicas"
    return "unknown"


def machine_line(rel: str, machine: dict | None) -> str:
    """`Machine: ...`: the CPU, cores, threads, torch, instruction sets, kernel variant and date a report records."""
    kernels = None
    if machine:
        parts = [str(machine.get("cpu", "CPU not recorded"))
                 + (f" ({machine['cpu_model']})" if machine.get("cpu_model") else "")]
        if machine.get("cores") is not None:
            parts.append(f"{machine['cores']} cores")
        threads = machine.get("torch_threads", machine.get("threads"))
        if threads is not None:
            parts.append(f"{threads} torch threads")
        if machine.get("torch"):
            parts.append(f"torch {machine['torch']}")
        kernels = machine.get("kernels")
        text = ", ".join(parts)
        if machine.get("isa"):
            text += f" (instruction sets: {', '.join(machine['isa'])})"
    else:
        text = UNRECORDED_MACHINES.get(rel, "not recorded in the file")
    text += f"; kernels: {kernels}" if kernels else f"; {PREVIOUS_KERNELS}"
    if machine and machine.get("date"):
        text += f"; {machine['date']}"
    if machine and isinstance(machine.get("steal"), (int, float)):
        text += f"; {machine['steal']:.1%} of the CPU time stolen by the hypervisor during the run"
    return f"Machine: {text}."


def variant_env(machine: dict | None) -> str:
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


def model_flags(data: dict, weights: bool = False) -> list[str]:
    """`--model` unless the report ran the default model; with `weights`, `--quantization/--dtype` unless auto."""
    words: list[str] = []
    if data.get("model") not in (None, DEFAULT_MODEL):
        words += ["--model", str(data["model"])]
    if weights and (data.get("quantization"), data.get("dtype")) != AUTO_WEIGHTS:
        words += ["--quantization", str(data.get("quantization")), "--dtype", str(data.get("dtype"))]
    return words
