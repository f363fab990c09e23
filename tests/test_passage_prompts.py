"""The shipped passage-task prompts: rebuilt exactly by their script, from training texts only."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "src" / "tandem" / "data" / "train" / "passage_tasks.jsonl"
EVAL_SETS = [ROOT / "src" / "tandem" / "data" / n for n in ("spec_bench_question.jsonl", "mt_bench_question.jsonl")]


def _builder():
    spec = importlib.util.spec_from_file_location("make_passage_prompts", ROOT / "scripts" / "make_passage_prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_rebuilds_the_shipped_file():
    records = _builder().build(seed=0)
    shipped = [json.loads(line) for line in SHIPPED.read_text(encoding="utf-8").splitlines()]
    assert records == shipped
    assert {r["task"] for r in records} == {"summarize", "rewrite", "translate", "documents", "code"}
    assert all(r["prompt"].strip() for r in records)


def test_no_evaluation_text_appears_in_the_passages():
    width, stride = 50, 25  # any shared run of >= 75 characters contains a whole window of the prompt
    evaluation = set()
    for path in EVAL_SETS:
        for line in path.read_text(encoding="utf-8").splitlines():
            for turn in json.loads(line)["turns"]:
                evaluation.update(hash(turn[i : i + width]) for i in range(len(turn) - width + 1))
    for line in SHIPPED.read_text(encoding="utf-8").splitlines():
        prompt = json.loads(line)["prompt"]
        windows = (prompt[i : i + width] for i in range(0, len(prompt) - width + 1, stride))
        assert not any(hash(w) in evaluation for w in windows), prompt[:200]
