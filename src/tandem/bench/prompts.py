"""Benchmark prompt sets shipped with tandem (Spec-Bench, MT-Bench; see data/SOURCES.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files

MT_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


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
