"""`tandem bench spec`: speculative decoding Spec-Bench style, every method side by side in one run.

Rows: the Spec-Bench subtasks and overall. Configurations: tandem plain decoding (the baseline),
tandem with each drafter on the same loaded weights, and transformers `generate` (plain, prompt
lookup, assisted generation with a smaller same-tokenizer model when one exists). Batch 1, EOS may
stop a request (Spec-Bench's protocol). Each prompt runs every configuration before the next prompt
starts, so machine noise lands on all of them alike. As in Spec-Bench, tokens/s is the mean of the
per-prompt tokens/s and a speedup is the ratio of two such means.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Protocol

import torch

from tandem.bench.draft_profile import DraftProfile, ProbedDrafter
from tandem.bench.kernel_report import ISA_FLAGS
from tandem.bench.steal import StealMeter
from tandem.config import EngineConfig, SamplingParams, SpecConfig, StructuredOutput
from tandem.drafters import TargetInfo, available_drafters, create_drafter
from tandem.llm import LLM
from tandem.model.kernels import cpu_flags, cpu_model, cpu_name, kernel_description
from tandem.progress import progress as progress_bar
from tandem.scheduler.profile import cost_curve_for
from tandem.types import SpecStats

PLAIN = "plain"
OVERALL = "overall"
HF_PLD = "prompt_lookup"
HF_ASSISTED = "assisted"
WARMUP_TOKENS = 8
WARMUP_TEXT = "Say hello and name three colours."
DEFINITIONS = {
    "tau": "mean acceptance length: tokens committed per target forward, including the recovered/bonus "
           "token (plain decoding has tau = 1; a request's prefill counts as one forward)",
    "acceptance_rate": "accepted draft tokens / drafted tokens",
    "acceptance_per_position": "P(draft token i passes | draft tokens before it passed), over the rounds "
                               "that graded position i",
    "drafted_acceptance": "P(the drafter proposes token i and it passes | tokens before it passed, the "
                          "budget allowed i): what expected_tau(., k) needs; an empty or short draft counts "
                          "as a failure",
    "calibration_error": "drafters that report confidences (dflash, dspark): expected calibration error of the "
                         "survivals prod_{i<=j} c_i at the verified positions against whether positions 1..j "
                         "all passed, over 10 equal-width bins (draft.calibration: per bin positions, sum of "
                         "survivals, passed)",
    "tokens_per_second": "mean over prompts of (generated tokens / wall seconds, prefill included)",
    "speedup": "tokens_per_second over that of the same engine's plain decoding on the same prompts",
}


# ---- methods -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    """A tandem drafter to benchmark: a registry name, the file it needs (if any), its k (None:
    the run's default), for EAGLE drafters top-k and depth, for hidden-state heads whether they
    consult the lookup, and which policy prices its drafts: the fixed length (default), the
    adaptive policy, or the confidence scheduler."""

    algorithm: str
    draft_path: str | None = None
    num_draft_tokens: int | None = None
    eagle_topk: int = 1
    num_steps: int | None = None
    lookup: bool = True
    corpus: bool = True
    scheduled: bool = False  # verified under the confidence scheduler (dspark), not the full draft
    adaptive: bool = False  # each round's length picked by the adaptive policy on the cost curve

    def __post_init__(self) -> None:
        if self.scheduled and self.adaptive:
            raise ValueError(f"{self.algorithm}: @sched=1 and @adaptive=1 name two policies; choose one")

    def spec_config(self, num_draft_tokens: int) -> SpecConfig:
        """The engine settings of this method, drafting `num_draft_tokens` unless it names its own."""
        return SpecConfig(algorithm=self.algorithm, num_draft_tokens=self.num_draft_tokens or num_draft_tokens,
                          draft_model_path=self.draft_path, eagle_topk=self.eagle_topk, num_steps=self.num_steps,
                          lookup=self.lookup, corpus=self.corpus, policy=self.policy)

    @property
    def policy(self) -> str:
        return "confidence" if self.scheduled else "adaptive" if self.adaptive else "fixed"

    @property
    def label(self) -> str:
        name = self.algorithm
        if self.draft_path:
            name += f"({os.path.basename(os.path.normpath(self.draft_path))})"
        if self.num_draft_tokens is not None:
            name += f"@k={self.num_draft_tokens}"
        if self.eagle_topk > 1:
            name += f"@topk={self.eagle_topk}"
        if self.num_steps is not None:
            name += f"@steps={self.num_steps}"
        if not self.lookup:
            name += "@lookup=0"
        if not self.corpus:
            name += "@corpus=0"
        if self.scheduled:
            name += "@sched=1"
        if self.adaptive:
            name += "@adaptive=1"
        return name


# NAME[=PATH]@key=value options of --methods, and the Method field each sets.
METHOD_OPTIONS = {"k": "num_draft_tokens", "topk": "eagle_topk", "steps": "num_steps", "lookup": "lookup",
                  "corpus": "corpus", "sched": "scheduled", "adaptive": "adaptive"}


def parse_methods(items: list[str], flag: str = "--methods") -> list[Method]:
    """`ngram`, `suffix`, `draft_model=PATH`, `eagle3@k=16@topk=4@steps=5` ...: space- or
    comma-separated, any registered name, with options after `@`; flag: the option they came
    from, which the errors name."""
    known = available_drafters()
    methods = []
    for item in (part for text in items for part in text.split(",")):
        item = item.strip()
        if not item:
            continue
        head, *options = item.split("@")
        name, _, path = head.partition("=")
        if name not in known:
            raise ValueError(f"unknown drafter {name!r} in {flag}; registered: {', '.join(known)}")
        if name == PLAIN:
            raise ValueError(f"plain decoding is always the baseline; do not list it in {flag}")
        fields: dict = {}
        for option in options:
            key, _, value = option.partition("=")
            if key not in METHOD_OPTIONS or not value.isdigit():
                raise ValueError(f"bad option {option!r} in {flag} item {item!r}; use @k=N, @topk=N, @steps=N, "
                                 "@lookup=0|1, @corpus=0|1, @sched=0|1 (the confidence scheduler) or @adaptive=0|1 "
                                 "(the adaptive policy)")
            switch = key in ("lookup", "corpus", "sched", "adaptive")
            if (switch and value not in ("0", "1")) or (not switch and int(value) < 1):
                raise ValueError(f"bad option {option!r} in {flag} item {item!r}: @{key} takes "
                                 + ("0 or 1" if switch else "a number of at least 1 (`off` is plain decoding, which "
                                                            "runs as the baseline anyway)"))
            fields[METHOD_OPTIONS[key]] = bool(int(value)) if switch else int(value)
        try:
            methods.append(Method(name, path or None, **fields))
        except ValueError as err:
            raise ValueError(f"{flag} item {item!r}: {err}") from err
    if not methods:
        raise ValueError(f"{flag} is empty; name at least one drafter")
    labels = [m.label for m in methods]
    if len(set(labels)) != len(labels):
        raise ValueError(f"{flag} lists a drafter twice: {', '.join(labels)}")
    return methods


def target_info(loaded):
    eos = set(loaded.config.eos_token_ids)
    if loaded.tokenizer.eos_token_id is not None:
        eos.add(loaded.tokenizer.eos_token_id)
    return TargetInfo.of(loaded, tuple(sorted(eos)))


def default_methods(loaded) -> tuple[list[Method], dict[str, str]]:
    """Every registered drafter that can be built with no extra files (no draft path), and for the
    others the reason they were left out (their own construction error)."""
    target = target_info(loaded)
    usable, skipped = [], {}
    for name in available_drafters():
        try:
            create_drafter(SpecConfig(algorithm=name), target)
        except (ValueError, FileNotFoundError) as err:
            skipped[name] = str(err)
        else:
            usable.append(Method(name))
    return usable, skipped


# ---- what one run records ------------------------------------------------------------------------


@dataclass
class SpecCase:
    """One benchmark prompt, already chat-templated and tokenized with the target's tokenizer."""

    category: str
    prompt_ids: list[int]
    question_id: int | None = None


@dataclass
class Run:
    """One configuration on one prompt."""

    token_ids: list[int]
    seconds: float
    spec: SpecStats | None = None
    profile: DraftProfile | None = None


@dataclass
class RunConfig:
    name: str
    run: Callable[[list[int], int, int], Run]  # (prompt ids, max new tokens, seed) -> Run


class Baselines(Protocol):
    """The other engine's configurations the suite runs beside tandem's (bench/spec_hf.py builds
    transformers' own)."""

    def configs(self, temperature: float) -> list[RunConfig]: ...

    def describe(self) -> dict: ...


# ---- the configurations ------------------------------------------------------------------------


def _tandem_config(name: str, loaded, method: Method | None, num_draft_tokens: int, max_model_len: int,
                   temperature: float, structured_output: StructuredOutput | None = None) -> RunConfig:
    spec = SpecConfig(num_draft_tokens=num_draft_tokens) if method is None else method.spec_config(num_draft_tokens)
    config = EngineConfig(model=loaded.name, max_model_len=max_model_len, max_num_seqs=1, spec=spec)
    # The scheduler prices rounds on the measured (cached) cost curve.
    curve = cost_curve_for(loaded, config.device, torch.get_num_threads()) if spec.needs_cost_curve else None
    llm = LLM.from_loaded(loaded, config, curve)
    probe = None
    if llm.engine.drafter is not None:
        probe = llm.engine.drafting.drafter = ProbedDrafter(llm.engine.drafter)

    def run(prompt_ids: list[int], max_new: int, seed: int) -> Run:
        params = SamplingParams(temperature=temperature, max_tokens=max_new, seed=seed, structured_output=structured_output)
        if probe is not None:
            probe.profile = DraftProfile()
        t = time.perf_counter()
        out = llm.generate(prompt_ids, params)[0]
        seconds = time.perf_counter() - t
        return Run(out.token_ids, seconds, out.spec, probe.profile if probe else None)

    return RunConfig(name, run)


# ---- the core -------------------------------------------------------------------------------------


def run_spec_bench(
    loaded,
    cases: list[SpecCase],
    *,
    methods: list[Method],
    num_draft_tokens: int = 4,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int = 0,
    baselines: Baselines | None = None,
    warmup_ids: list[int],
    progress: bool = True,
    structured_output: StructuredOutput | None = None,
) -> dict:
    """Run every configuration on every case (interleaved per case) and return the report.

    `loaded` is a LoadedModel shared by all tandem configurations (weights loaded once). Prompt i
    uses seed `seed + i` in every configuration. `warmup_ids` (WARMUP_TEXT's tokens, as the
    commands pass it) warms each configuration once with a few tokens before timing; it must not
    be a measured prompt, since suffix decoding keeps earlier outputs in its global trie. structured_output:
    what every tandem answer must match (None: anything).
    """
    if not cases:
        raise ValueError("no prompts to benchmark")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    configs = _tandem_configs(loaded, cases, methods, num_draft_tokens, max_new_tokens, temperature, warmup_ids,
                              structured_output)
    hf_configs = baselines.configs(temperature) if baselines else []

    steal = StealMeter()
    for cfg in configs + hf_configs:
        cfg.run(warmup_ids, WARMUP_TOKENS, seed)
    gc.collect()

    runs, hf_runs = _run_cases(cases, configs, hf_configs, max_new_tokens, seed, progress)
    report = {
        "model": loaded.name,
        "quantization": loaded.quantization,
        "dtype": str(loaded.dtype).replace("torch.", ""),
        "temperature": temperature,
        "seed": seed,
        "num_draft_tokens": num_draft_tokens,
        "max_new_tokens": max_new_tokens,
        "num_prompts": len(cases),
        "methods": [{"label": m.label, "algorithm": m.algorithm, "draft_path": m.draft_path,
                     "num_draft_tokens": m.num_draft_tokens or num_draft_tokens, "eagle_topk": m.eagle_topk,
                     "num_steps": m.num_steps, "lookup": m.lookup, "corpus": m.corpus} for m in methods],
        "transformers": baselines.describe() if baselines else None,
        "definitions": DEFINITIONS,
        "machine": machine_info(steal),
    }
    report.update(_tables(cases, runs, hf_runs, temperature))
    return report


def _tandem_configs(loaded, cases: list[SpecCase], methods: list[Method], num_draft_tokens: int, max_new_tokens: int,
                    temperature: float, warmup_ids: list[int],
                    structured_output: StructuredOutput | None) -> list[RunConfig]:
    """Plain decoding, then every method, on the shared weights with a context that fits every case."""
    ks = [num_draft_tokens] + [m.num_draft_tokens for m in methods if m.num_draft_tokens]
    longest = max(len(c.prompt_ids) for c in [*cases, SpecCase("", warmup_ids)])
    max_model_len = max(2048, longest + max_new_tokens + max(ks) + 2)
    configs = [_tandem_config(PLAIN, loaded, None, num_draft_tokens, max_model_len, temperature, structured_output)]
    configs += [_tandem_config(m.label, loaded, m, num_draft_tokens, max_model_len, temperature, structured_output)
                for m in methods]
    return configs


def _run_cases(cases: list[SpecCase], configs: list[RunConfig], hf_configs: list[RunConfig], max_new_tokens: int,
               seed: int, progress: bool) -> tuple[dict[str, list[Run]], dict[str, list[Run]]]:
    """Every configuration on each case before the next case (prompt i: seed + i); the runs by name."""
    runs: dict[str, list[Run]] = {cfg.name: [] for cfg in configs}
    hf_runs: dict[str, list[Run]] = {cfg.name: [] for cfg in hf_configs}
    for i, case in enumerate(progress_bar(cases, desc="prompts", unit="prompt", disable=not progress)):
        for cfg in configs:
            runs[cfg.name].append(cfg.run(case.prompt_ids, max_new_tokens, seed + i))
        for cfg in hf_configs:
            hf_runs[cfg.name].append(cfg.run(case.prompt_ids, max_new_tokens, seed + i))
    return runs, hf_runs


def _summary(picked: list[Run], baseline: dict | None) -> dict:
    stats = profile = None
    if picked and picked[0].spec is not None:
        stats = SpecStats()
        for r in picked:
            stats.merge(r.spec)
    if picked and picked[0].profile is not None:
        profile = DraftProfile()
        for r in picked:
            profile.merge(r.profile)
    return summary_row([len(r.token_ids) for r in picked], [r.seconds for r in picked], stats, profile, baseline)


def summary_row(tokens: list[int], seconds: list[float], stats: SpecStats | None, profile: DraftProfile | None,
                baseline: dict | None) -> dict:
    """One configuration's row over some prompts: their generated tokens and wall seconds, the
    speculation counters and draft profile summed over them, the speedup over `baseline`'s row."""
    per_prompt = [n / s for n, s in zip(tokens, seconds) if s > 0]
    row = {
        "tokens": sum(tokens),
        "seconds": sum(seconds),
        "tokens_per_second": statistics.fmean(per_prompt) if per_prompt else 0.0,
    }
    if baseline is not None:
        row["speedup"] = row["tokens_per_second"] / baseline["tokens_per_second"] if baseline["tokens_per_second"] else 0.0
    if stats is not None:
        row.update(tau=stats.mean_acceptance_length, acceptance_rate=stats.acceptance_rate,
                   acceptance_per_position=stats.acceptance_per_position,
                   accepted_per_position=list(stats.accepted_per_position), spec=stats.as_dict())
    if profile is not None:
        row.update(drafted_acceptance=profile.acceptance(), draft_seconds=profile.seconds,
                   draft_seconds_per_position=profile.seconds_per_position, draft=profile.as_dict())
    return row


def _identity(reference: list[Run], other: list[Run], cases: list[SpecCase]) -> dict:
    """Prompts whose greedy output differs from the reference, with the first differing position."""
    diffs = []
    for i, (a, b) in enumerate(zip(reference, other)):
        if a.token_ids != b.token_ids:
            pos = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                       min(len(a.token_ids), len(b.token_ids)))
            diffs.append({"index": i, "category": cases[i].category, "question_id": cases[i].question_id,
                          "first_difference": pos, "reference_tokens": a.token_ids[pos : pos + 8],
                          "other_tokens": b.token_ids[pos : pos + 8]})
    return {"mismatches": len(diffs), "prompts": len(reference), "details": diffs}


def _tables(cases, runs, hf_runs, temperature) -> dict:
    categories = list(dict.fromkeys(c.category for c in cases))
    groups = {cat: [i for i, c in enumerate(cases) if c.category == cat] for cat in categories}
    groups[OVERALL] = list(range(len(cases)))
    table = {}
    for cat, idx in groups.items():
        plain = _summary([runs[PLAIN][i] for i in idx], None)
        row: dict = {"num_prompts": len(idx), "tandem": {PLAIN: plain}}
        for name in runs:
            if name != PLAIN:
                row["tandem"][name] = _summary([runs[name][i] for i in idx], plain)
        if hf_runs:
            hf_plain = _summary([hf_runs[PLAIN][i] for i in idx], None)
            hf_plain["vs_tandem_plain"] = hf_plain["tokens_per_second"] / plain["tokens_per_second"]
            row["transformers"] = {PLAIN: hf_plain}
            for name in hf_runs:
                if name != PLAIN:
                    row["transformers"][name] = _summary([hf_runs[name][i] for i in idx], hf_plain)
        table[cat] = row
    all_runs = {**{f"tandem {n}": r for n, r in runs.items()}, **{f"transformers {n}": r for n, r in hf_runs.items()}}
    out = {
        "categories": table,
        "prompts": [
            {"category": c.category, "question_id": c.question_id, "prompt_tokens": len(c.prompt_ids),
             "generated": {name: len(r[i].token_ids) for name, r in all_runs.items()},
             "seconds": {name: round(r[i].seconds, 6) for name, r in all_runs.items()}}
            for i, c in enumerate(cases)
        ],
    }
    # Under sampling the methods consume randomness differently, so outputs legitimately differ;
    # exactness is then `tandem audit`'s job.
    if temperature == 0:
        out["identity"] = {name: _identity(runs[PLAIN], r, cases) for name, r in runs.items() if name != PLAIN}
        out["identity_transformers"] = {name: _identity(hf_runs[PLAIN], r, cases)
                                        for name, r in hf_runs.items() if name != PLAIN}
    else:
        out["identity"] = out["identity_transformers"] = None
    return out


def machine_info(steal: StealMeter | None = None) -> dict:
    """The CPU (model name and the instruction sets the kernels care about), the kernels that ran
    the quantized linears, threads, torch and the date: what every figure is reported next to;
    with the run's StealMeter, the share of the machine's CPU time stolen since it started."""
    flags = cpu_flags()
    info = {"cpu": cpu_name(), "cpu_model": cpu_model(), "isa": [f for f in ISA_FLAGS if f in flags],
            "kernels": kernel_description(),
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    share = steal.share() if steal is not None else None
    if share is not None:
        info["steal"] = round(share, 4)
    return info


def machine_line(machine: dict) -> str | None:
    """machine_info as the line printed (and plotted) next to a report's figures; None for a
    report that recorded no machine."""
    if "kernels" not in machine:
        return None
    model = f" {machine['cpu_model']}" if machine.get("cpu_model") else ""
    return (f"CPU: {machine['cpu']}{model} ({' '.join(machine['isa'])}), {machine['torch_threads']} threads, "
            f"{machine['kernels']}")


# ---- the command ----------------------------------------------------------------------------------
