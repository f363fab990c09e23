"""scripts/train_gpu.sh builds the `tandem train` commands its knobs ask for (run with a stand-in tandem)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_gpu.sh"
RECORDER = """import json, sys
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(sys.argv[2:]) + "\\n")
print("held-out (1 positions): tau 1.0")
"""


def _run(tmp_path: Path, **knobs: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    recorder = tmp_path / "recorder.py"
    recorder.write_text(RECORDER)
    calls = tmp_path / "calls.jsonl"
    env = {**os.environ, "TANDEM": f"{sys.executable} {recorder} {calls}", **knobs}
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), "--seed", "3"], env=env, capture_output=True,
                          text=True, timeout=60)
    argvs = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    return done, argvs


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_data_once_then_each_method_captures_in_memory(tmp_path):
    done, argvs = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    data, *runs = argvs
    assert "--data-only" in data and "--capture-in-memory" in data and _value(data, "--method") == "eagle3"
    assert sorted(_value(a, "--method") for a in runs) == ["eagle3", "medusa", "mtp"]
    for argv in runs:
        assert argv[:2] == ["-v", "train"] and "--capture-in-memory" in argv
        assert _value(argv, "--max-data-minutes") == "0" and _value(argv, "--device") == "cuda"
        assert _value(argv, "--max-prompt-context") == "0" and _value(argv, "--seed") == "3"  # extra options reach every run
        assert _value(argv, "--out") == str(tmp_path / "out" / _value(argv, "--method"))
    eagle3 = next(a for a in runs if _value(a, "--method") == "eagle3")
    assert _value(eagle3, "--draft-vocab-size") == "8192" and "--init-from" not in eagle3


def test_knobs_pick_methods_init_and_disk_capture(tmp_path):
    done, argvs = _run(tmp_path, METHODS="eagle3", EAGLE3_INIT="/heads/eagle3", EAGLE3_BATCH="64", EAGLE3_LR="1e-3",
                       CAPTURE_IN_MEMORY="0", PROMPT_CONTEXT="128")
    assert done.returncode == 0, done.stderr
    data, eagle3 = argvs
    assert "--capture-in-memory" not in data + eagle3 and _value(data, "--capture-layers") == "29"
    assert _value(eagle3, "--init-from") == "/heads/eagle3" and "--draft-vocab-size" not in eagle3
    assert _value(eagle3, "--batch-size") == "64" and _value(eagle3, "--lr") == "1e-3"
    assert _value(eagle3, "--max-prompt-context") == "128"


def test_an_unknown_method_is_refused_before_anything_runs(tmp_path):
    done, argvs = _run(tmp_path, METHODS="eagle3 nonsense")
    assert done.returncode == 2 and "unknown method nonsense" in done.stderr and argvs == []


def test_block_drafters_and_the_draft_model_train_with_their_own_knobs(tmp_path):
    done, argvs = _run(tmp_path, METHODS="dflash dspark draft_model", DSPARK_INIT="/heads/dspark", DFLASH_STEPS="900",
                       DFLASH_BATCH="64", DSPARK_LR="5e-4", DRAFT_MODEL_STEPS="300", DEVICE="cpu")
    assert done.returncode == 0, done.stderr
    data, *runs = argvs
    assert _value(data, "--device") == "cpu"
    by_method = {_value(a, "--method"): a for a in runs}
    assert sorted(by_method) == ["dflash", "draft_model", "dspark"]
    dflash, dspark, draft_model = by_method["dflash"], by_method["dspark"], by_method["draft_model"]
    assert _value(dflash, "--steps") == "900" and _value(dflash, "--batch-size") == "64"
    assert _value(dflash, "--draft-vocab-size") == "8192" and "block_size=8" in dflash and "--init-from" not in dflash
    # an exported head keeps its own options: no head options beside --init-from
    assert _value(dspark, "--init-from") == "/heads/dspark" and "--draft-vocab-size" not in dspark
    assert _value(dspark, "--lr") == "5e-4" and _value(dspark, "--steps") == "4000"
    assert _value(draft_model, "--num-layers") == "2" and _value(draft_model, "--steps") == "300"
    assert all(_value(a, "--device") == "cpu" and "--capture-in-memory" in a for a in runs)


@pytest.mark.slow
def test_a_cpu_smoke_run_trains_and_exports_the_block_drafters(tmp_path):
    """The real `tandem train` behind the script (DEVICE=cpu, a few answers and steps): the
    transformers backend's answers, the in-memory capture and both block drafters' exports work
    together before a GPU slot is spent on them."""
    out = tmp_path / "out"
    env = {**os.environ, "TANDEM": f"{sys.executable} -m tandem.cli", "DEVICE": "cpu", "METHODS": "dflash dspark",
           "NUM_PROMPTS": "6", "MAX_NEW_TOKENS": "12", "GENERATION_BATCH": "4", "DATA_MINUTES": "5",
           "TRAIN_MINUTES": "5", "DFLASH_STEPS": "2", "DSPARK_STEPS": "2", "DFLASH_BATCH": "2", "DSPARK_BATCH": "2"}
    done = subprocess.run(["bash", str(SCRIPT), str(out), "--held-out", "3", "--data-dir", str(tmp_path / "data")],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for method in ("dflash", "dspark"):
        head = json.loads((out / method / "head.json").read_text())
        assert head["method"] == method and (out / method / "head.safetensors").is_file()
        assert f"[train_gpu] {method}: " in done.stdout and "held-out" in (out / f"{method}.log").read_text()
