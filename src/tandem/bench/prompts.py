"""Benchmark prompt sets shipped with tandem (Spec-Bench, MT-Bench; see data/SOURCES.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from tandem.paths import read_user_text

MT_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
# Spec-Bench's subtasks as tandem names them (the MT-Bench ones grouped as multi_turn).
SPEC_BENCH_SUBTASKS = ("multi_turn", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass(frozen=True)
class BenchPrompt:
    question_id: int
    category: str
    text: str


def spec_bench_prompts(per_category: int | None = None, categories: list[str] | None = None) -> list[BenchPrompt]:
    """First-turn Spec-Bench prompts; the eight MT-Bench categories are grouped as `multi_turn`
    as in Spec-Bench's own tables. `per_category` takes the first N of each category."""
    rows = files("tandem").joinpath("data/spec_bench_question.jsonl").read_text().splitlines()
    out: list[BenchPrompt] = []
    counts: dict[str, int] = {}
    for line in rows:
        rec = json.loads(line)
        cat = "multi_turn" if rec["category"] in MT_BENCH_CATEGORIES else rec["category"]
        if categories and cat not in categories:
            continue
        if per_category is not None and counts.get(cat, 0) >= per_category:
            continue
        counts[cat] = counts.get(cat, 0) + 1
        out.append(BenchPrompt(rec["question_id"], cat, rec["turns"][0]))
    return out


def spread_prompts(limit: int) -> list[BenchPrompt]:
    """`limit` Spec-Bench prompts taken round-robin over the subtasks (a quick, varied sample)."""
    if limit < 1:
        raise ValueError(f"need at least one prompt, got limit {limit}")
    by_cat: dict[str, list[BenchPrompt]] = {}
    for p in spec_bench_prompts():
        by_cat.setdefault(p.category, []).append(p)
    out: list[BenchPrompt] = []
    for i in range(max(len(v) for v in by_cat.values())):
        out += [v[i] for v in by_cat.values() if i < len(v)]
    return out[:limit]


def load_prompt_file(path: str, limit: int | None = None) -> list[BenchPrompt]:
    """The user's own prompts: a .jsonl file whose records hold "prompt", "text" or "turns" (the
    first turn; Spec-Bench/MT-Bench files work as they are) and optionally "category", or a text
    file with one prompt per line."""
    file = Path(path)
    lines = [line for line in read_user_text(file, "prompt file").splitlines() if line.strip()]
    out: list[BenchPrompt] = []
    for n, line in enumerate(lines, 1):
        if file.suffix == ".jsonl":
            try:
                rec = json.loads(line)
                text = rec.get("prompt") or rec.get("text") or (rec.get("turns") or [None])[0]
            except (json.JSONDecodeError, AttributeError) as err:
                raise ValueError(f"{path}:{n}: not a JSON object ({err})") from err
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f'{path}:{n}: no prompt text; give a "prompt", "text" or "turns" field')
            out.append(BenchPrompt(rec.get("question_id", n), str(rec.get("category", "prompts")), text))
        else:
            out.append(BenchPrompt(n, "prompts", line.strip()))
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out[:limit] if limit else out
