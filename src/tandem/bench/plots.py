"""PNG plots shared by the bench commands (matplotlib, imported only when a plot is drawn).

Every function takes the JSON-shaped report a benchmark saves, so a plot can be redrawn from a
results file without rerunning anything.
"""

from __future__ import annotations

from pathlib import Path

from tandem.bench.spec import machine_line
from tandem.scheduler.cost_model import expected_tau, expected_tau_uniform

ALPHAS = (0.2, 0.4, 0.6, 0.7, 0.8, 0.9)


def _pyplot():
    try:
        import matplotlib  # lazy: optional dependency; imported only when a plot is drawn
    except ImportError as err:
        raise ImportError("plots need matplotlib: pip install matplotlib (or pass no plot directory)") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after matplotlib.use("Agg")

    return plt


def stamp_machine(fig, machine: dict | None) -> None:
    """The report's machine line (CPU, threads, kernels) along the figure's foot, and the layout
    tightened above it: every figure names the machine it was measured on."""
    line = machine_line(machine or {})
    if line is None:
        fig.tight_layout()
        return
    fig.text(0.01, 0.01, line, fontsize=7, color="dimgray")
    fig.tight_layout(rect=(0, 0.04, 1, 1))


def _save(fig, path: str | Path, machine: dict | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp_machine(fig, machine)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def _tandem_methods(report: dict) -> list[str]:
    return [name for name in report["categories"]["overall"]["tandem"] if name != "plain"]


def plot_tau_vs_draft_length(report: dict, path: str | Path, alphas=ALPHAS) -> Path:
    """The analytical tau(k) = (1 - a^(k+1)) / (1 - a) for several i.i.d. acceptance rates a, with each
    method's measured tau at its k on top, and (dashed) tau(k) predicted from its measured
    acceptance per position."""
    plt = _pyplot()
    overall = report["categories"]["overall"]["tandem"]
    ks_used = {m["label"]: m["num_draft_tokens"] for m in report["methods"]}
    k_max = max([10] + list(ks_used.values()))
    ks = list(range(k_max + 1))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for a in alphas:
        ax.plot(ks, [expected_tau_uniform(a, k) for k in ks], color="grey", lw=1, alpha=0.35 + 0.6 * a)
        ax.annotate(f"a={a}", (k_max, expected_tau_uniform(a, k_max)), fontsize=7, color="grey",
                    xytext=(3, 0), textcoords="offset points", va="center")
    for i, name in enumerate(_tandem_methods(report)):
        row, color = overall[name], f"C{i}"
        k = ks_used.get(name, report["num_draft_tokens"])
        profile = row.get("drafted_acceptance")
        if profile:
            upto = list(range(min(len(profile), k) + 1))
            ax.plot(upto, [expected_tau(profile, j) for j in upto], ls="--", color=color, lw=1.2)
        ax.scatter([k], [row["tau"]], color=color, s=50, zorder=3, label=f"{name} (measured, k={k})")
    ax.set_xlabel("draft length k")
    ax.set_ylabel("tau (tokens per target forward)")
    ax.set_title(f"Acceptance length vs draft length, {report['model']}")
    ax.set_xlim(0, k_max + 1.2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, title="dashed: from measured acceptance per position", title_fontsize=7)
    return _save(fig, path, report.get("machine"))


def _grouped_bars(ax, cats: list[str], series: dict[str, list[float]]) -> None:
    width = 0.8 / max(1, len(series))
    for j, (name, values) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(cats))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(cats)))
    ax.set_xticklabels(cats, rotation=25, ha="right", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    # beside the axes: with many methods a legend inside covers the last group's bars
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def plot_speedup_by_subtask(report: dict, path: str | Path) -> Path:
    """Speedup of every method over its own engine's plain decoding, per subtask and overall."""
    plt = _pyplot()
    cats = list(report["categories"])
    series = {f"tandem {m}": [report["categories"][c]["tandem"][m]["speedup"] for c in cats]
              for m in _tandem_methods(report)}
    hf = report["categories"]["overall"].get("transformers", {})
    for name in hf:
        if name != "plain":
            series[f"transformers {name}"] = [report["categories"][c]["transformers"][name]["speedup"] for c in cats]
    fig, ax = plt.subplots(figsize=(max(7, 1.2 * len(cats) + 0.4 * len(series)), 4.5))
    _grouped_bars(ax, cats, series)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_ylabel("speedup over the same engine's plain decoding")
    mode = "greedy" if report["temperature"] == 0 else f"T={report['temperature']}"
    ax.set_title(f"Speedup per subtask, {report['model']}, {mode}, batch 1")
    return _save(fig, path, report.get("machine"))


def plot_acceptance_per_position(report: dict, path: str | Path) -> Path:
    """P(draft token i passes | earlier ones passed) per position (solid), and the drafted
    acceptance (dotted: a missing draft token counts as a failure), overall."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator  # lazy: optional dependency (see _pyplot)

    overall = report["categories"]["overall"]["tandem"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, name in enumerate(_tandem_methods(report)):
        row = overall[name]
        cond = row.get("acceptance_per_position", [])
        if cond:
            ax.plot(range(1, len(cond) + 1), cond, marker="o", color=f"C{i}", label=f"{name}: given graded")
        drafted = row.get("drafted_acceptance", [])
        if drafted:
            ax.plot(range(1, len(drafted) + 1), drafted, marker=".", ls=":", color=f"C{i}",
                    label=f"{name}: drafted and passed")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(pass | earlier passed)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Acceptance per position, {report['model']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path, report.get("machine"))


def plot_cost_curve(curves: dict[str, dict], path: str | Path, title: str = "Forward cost curve",
                    machine: dict | None = None) -> Path:
    """Seconds of one forward over n new tokens ({label: {n: seconds}}): absolute and relative to n = 1."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, points in curves.items():
        pts = sorted((int(n), s) for n, s in points.items())
        ns = [n for n, _ in pts]
        ax1.plot(ns, [s * 1000 for _, s in pts], marker="o", label=label)
        ax2.plot(ns, [s / pts[0][1] for _, s in pts], marker="o", label=label)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("new tokens in one forward")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax1.set_ylabel("ms")
    ax2.set_ylabel(f"time relative to {min(int(n) for c in curves.values() for n in c)} token(s)")
    ax1.set_title(title)
    ax2.set_title("verifying k drafts costs curve(k + 1)")
    return _save(fig, path, machine)


def plot_speedup_vs_concurrency(sweep: dict, path: str | Path, *, baseline: str = "off",
                                metric: str = "throughput_tokens_per_second", series_key: str = "mode") -> Path:
    """Speedup over the baseline series at each concurrency, and the metric itself.

    `sweep["results"]` is a list of records, one per (series, concurrency), e.g.
    {"mode": "adaptive", "concurrency": 8, "throughput_tokens_per_second": 41.2, ...}; the series
    named `baseline` (speculation off) is the denominator. `sweep["model"]` titles the plot.
    """
    plt = _pyplot()
    by_series: dict[str, dict[int, float]] = {}
    for rec in sweep["results"]:
        by_series.setdefault(str(rec[series_key]), {})[int(rec["concurrency"])] = float(rec[metric])
    if baseline not in by_series:
        raise ValueError(f"the sweep has no {baseline!r} series to divide by; series: {', '.join(by_series)}")
    base = by_series[baseline]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, points in by_series.items():
        cs = sorted(points)
        ax2.plot(cs, [points[c] for c in cs], marker="o", label=name)
        if name != baseline:
            shared = [c for c in cs if base.get(c)]
            ax1.plot(shared, [points[c] / base[c] for c in shared], marker="o", label=name)
    ax1.axhline(1.0, color="black", lw=0.8, ls="--")
    ax1.set_ylabel(f"{metric} / {baseline}")
    ax1.set_title(f"Speedup vs concurrency{', ' + sweep['model'] if sweep.get('model') else ''}")
    ax2.set_ylabel(metric)
    ax2.set_title("Absolute")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path, sweep.get("machine"))


def plot_spec_report(report: dict, directory: str | Path) -> list[Path]:
    """All plots of a `bench spec` report into `directory`."""
    d = Path(directory)
    paths = [
        plot_tau_vs_draft_length(report, d / "tau_vs_draft_length.png"),
        plot_speedup_by_subtask(report, d / "speedup_by_subtask.png"),
        plot_acceptance_per_position(report, d / "acceptance_per_position.png"),
    ]
    if report.get("cost_curve"):
        label = f"tandem {report['quantization']}/{report['dtype']}"
        paths.append(plot_cost_curve({label: report["cost_curve"]}, d / "cost_curve.png",
                                     f"Forward cost curve, {report['model']}", report.get("machine")))
    return paths
