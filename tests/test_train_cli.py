"""`tandem train` end to end on a tiny random HF-directory target: distil, capture, train, export, resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest
import torch

from conftest import write_tiny_target
from tandem.cli import main
from tandem.train.trainer import auto_precision

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return write_tiny_target(tmp_path_factory.mktemp("target"))


def _argv(tiny_target, tmp_path, *extra):
    root, prompts = tiny_target
    return ["train", "--target", str(root), "--method", "medusa", "--prompts", str(prompts), "--out", str(tmp_path / "out"),
            "--data-dir", str(tmp_path / "data"), "--num-prompts", "12", "--held-out", "4", "--max-new-tokens", "8",
            "--batch-size", "4", "--eval-every", "3", "--checkpoint-every", "3", "--num-heads", "2", "--lr", "1e-2",
            "--threads", "1", *extra]


def test_train_cli_writes_a_loadable_head_and_resumes(tiny_target, tmp_path, capsys):
    from tandem.drafters.heads.base import TargetParts
    from tandem.drafters.heads.io import load_head
    from tandem.model.loader import load_model

    assert main(_argv(tiny_target, tmp_path, "--steps", "6")) == 0
    assert "held-out" in capsys.readouterr().out
    out = tmp_path / "out"
    record = json.loads((out / "training_record.json").read_text())
    assert record["method"] == "medusa" and record["training"]["steps_done"] == 6 and record["training"]["finished"]
    assert record["data"]["train_prompts"] == 12 and record["data"]["held_out_prompts"] == 4
    # --eval-k 5, and the held-out evaluation scores the 2 positions the 2 medusa heads draft
    assert record["held_out"]["tau"] >= 1.0 and len(record["held_out"]["acceptance"]) == 2
    assert record["training"]["precision"] == auto_precision("cpu")  # --precision auto, recorded as what ran
    assert torch.get_num_threads() == 1  # --threads 1 held for every stage
    loaded = load_model(str(tiny_target[0]))
    head = load_head(out, TargetParts.from_loaded(loaded))
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)["head"]
    for name, value in head.state_dict().items():
        torch.testing.assert_close(value, ckpt[name].float(), atol=0.02, rtol=0.01)  # exported in bfloat16

    answers = sorted((tmp_path / "data").glob("answers-*/answers-*.jsonl"))
    stamps = [p.stat().st_mtime_ns for p in answers]
    assert main(_argv(tiny_target, tmp_path, "--steps", "9", "--resume")) == 0
    assert [p.stat().st_mtime_ns for p in answers] == stamps  # answers were reused, not regenerated
    record = json.loads((out / "training_record.json").read_text())
    assert record["training"]["steps_done"] == 9


def test_train_cli_reports_bad_input(tiny_target, tmp_path, capsys):
    assert main(_argv(tiny_target, tmp_path, "--steps", "2", "--head-option", "nonsense")) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
    assert main(_argv(tiny_target, tmp_path, "--steps", "2", "--resume")) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert main(_argv(tiny_target, tmp_path, "--steps", "2", "--max-prompt-context", "-1")) == 2
    assert "--max-prompt-context" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # refused while parsing, before any model loads
        main(_argv(tiny_target, tmp_path, "--steps", "2", "--threads", "0"))
    assert exit_.value.code == 2 and "--threads: must be >= 1" in capsys.readouterr().err


def test_a_draft_model_that_cannot_export_is_refused_before_any_work(tmp_path, capsys):
    """draft_model exports a llama model: for a Gemma 3 target (embedding scale, GeGLU, softcap)
    that is known from its config, so the run stops before answering a prompt, not after training."""
    from conftest import build_tiny

    hf, _ = build_tiny("gemma3")
    hf.save_pretrained(tmp_path / "gemma")
    argv = ["train", "--target", str(tmp_path / "gemma"), "--method", "draft_model", "--out", str(tmp_path / "out"),
            "--data-dir", str(tmp_path / "data"), "--num-prompts", "4", "--held-out", "2", "--steps", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "exports a llama-architecture model" in err and "dflash" in err
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").rglob("answers-*.jsonl"))


def test_train_cli_transformers_backend_data_only_then_cached_answers(tiny_target, tmp_path, capsys):
    # Nothing answered yet and no time to answer: a clear error, not an empty training set.
    assert main(_argv(tiny_target, tmp_path, "--backend", "transformers", "--max-data-minutes", "0")) == 2
    assert "no training prompt is answered" in capsys.readouterr().err
    assert main(_argv(tiny_target, tmp_path, "--backend", "transformers", "--data-only", "--capture-layers", "0")) == 0
    assert "12 training and 4 held-out answers" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()
    answers = sorted((tmp_path / "data").glob("answers-transformers-*/answers-*.jsonl"))
    stamps = [p.stat().st_mtime_ns for p in answers]
    # A head trained on the cached data only (no answering), as several heads side by side would.
    assert main(_argv(tiny_target, tmp_path, "--backend", "transformers", "--max-data-minutes", "0", "--steps", "3")) == 0
    assert [p.stat().st_mtime_ns for p in answers] == stamps
    record = json.loads((tmp_path / "out" / "training_record.json").read_text())
    assert record["data"]["train_prompts"] == 12 and record["data"]["capture"]["quantization"] == "transformers"
    assert main(_argv(tiny_target, tmp_path, "--backend", "transformers", "--temperature", "1", "--steps", "1")) == 2
    assert "greedily" in capsys.readouterr().err
    assert main(_argv(tiny_target, tmp_path, "--backend", "transformers", "--capture-dtype", "bfloat16")) == 2
    assert "float32" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["tandem", "transformers"])
def test_train_cli_capture_in_memory_writes_no_hidden_states(tiny_target, tmp_path, capsys, backend):
    argv = _argv(tiny_target, tmp_path, "--backend", backend, "--capture-in-memory", "--max-prompt-context", "0")
    assert main([*argv, "--data-only"]) == 0
    assert "captured in memory by each training run" in capsys.readouterr().out
    assert main([*argv, "--max-data-minutes", "0", "--steps", "3"]) == 0
    assert "held-out" in capsys.readouterr().out
    record = json.loads((tmp_path / "out" / "training_record.json").read_text())
    assert record["data"]["capture"]["stored"] == "memory" and record["training"]["steps_done"] == 3
    assert record["data"]["train_sequences"] == 12 and record["training"]["max_prompt_context"] is None
    assert not list((tmp_path / "data").glob("answers-*/capture-*"))


def test_train_cli_init_from_fine_tunes_an_exported_head(tiny_target, tmp_path, capsys):
    from tandem.drafters.heads.base import TargetParts
    from tandem.drafters.heads.io import load_head, read_head_config
    from tandem.model.loader import load_model

    assert main(_argv(tiny_target, tmp_path, "--steps", "3")) == 0
    first = tmp_path / "first"
    (tmp_path / "out").rename(first)
    capsys.readouterr()
    root, prompts = tiny_target
    again = ["train", "--target", str(root), "--method", "medusa", "--prompts", str(prompts), "--out", str(tmp_path / "out"),
             "--data-dir", str(tmp_path / "data"), "--num-prompts", "12", "--held-out", "4", "--max-new-tokens", "8",
             "--batch-size", "4", "--eval-every", "3", "--lr", "1e-2", "--init-from", str(first)]
    assert main([*again, "--steps", "1", "--lr", "1e-12"]) == 0  # a step that cannot move the weights
    target = TargetParts.from_loaded(load_model(str(root)))
    before, after = load_head(first, target).state_dict(), load_head(tmp_path / "out", target).state_dict()
    assert before.keys() == after.keys()
    for name in before:
        torch.testing.assert_close(after[name], before[name])  # started from the exported weights
    record = json.loads((tmp_path / "out" / "training_record.json").read_text())
    assert record["training"]["init_from"] == str(first)
    assert record["method_options"] == read_head_config(first)["config"]  # the options the head came with
    history = json.loads((tmp_path / "out" / "metrics.json").read_text())["history"]
    assert history[0]["step"] == 0 and "eval" in history[0]  # the starting head is evaluated too
    # The head's options come with it; another method's head is refused.
    assert main([*again, "--steps", "1", "--num-heads", "3"]) == 2
    assert "keeps its own options" in capsys.readouterr().err
    assert main([*again[:4], "mtp", *again[5:], "--steps", "1"]) == 2
    assert "holds a medusa head" in capsys.readouterr().err
    assert main([*again[:-1], str(tmp_path / "nothing"), "--steps", "1"]) == 2


def test_train_cli_records_a_dspark_heads_calibration(tiny_target, tmp_path):
    argv = [a for a in _argv(tiny_target, tmp_path, "--steps", "3") if a not in ("--num-heads", "2")]
    argv[argv.index("medusa")] = "dspark"
    assert main([*argv, "--head-option", "block_size=3", "--head-option", "rank=32"]) == 0
    record = json.loads((tmp_path / "out" / "training_record.json").read_text())
    for kind in ("greedy", "sampled"):
        calibration = record["calibration"][kind]
        assert len(calibration["temperatures"]) == 3 and calibration["ece_after"] <= calibration["ece_before"]


def test_train_cli_writes_a_suffix_corpus_of_the_answers(tiny_target, tmp_path, capsys):
    from tandem.drafters.corpus import read_corpus

    root, prompts = tiny_target
    argv = ["train", "--target", str(root), "--method", "suffix", "--prompts", str(prompts), "--out",
            str(tmp_path / "corpus"), "--data-dir", str(tmp_path / "data"), "--num-prompts", "12", "--held-out", "4",
            "--max-new-tokens", "8", "--corpus-tokens", "20"]
    assert main(argv) == 0
    assert "held-out replay" in capsys.readouterr().out
    config, answers = read_corpus(tmp_path / "corpus", 97)
    record = json.loads((tmp_path / "corpus" / "training_record.json").read_text())
    assert record.pop("command_seconds") >= 0 and record == config["record"] and record["method"] == "suffix"
    # the first answers until 20 tokens: 3 of 8 tokens each
    assert len(answers) == 3 and config["tokens"] == record["corpus"]["tokens"] == 24
    held = record["held_out"]
    assert held["with_corpus"]["tokens"] == held["without_corpus"]["tokens"] > 0
    assert held["with_corpus"]["tau"] >= 1.0 and len(held["with_corpus"]["acceptance"]) == 4
    assert not list((tmp_path / "data").glob("answers-*/capture-*"))  # no hidden states for a corpus
    assert main([*argv, "--init-from", str(tmp_path / "corpus")]) == 2
    assert "no head" in capsys.readouterr().err


def test_mistakes_are_refused_before_anything_runs(tiny_target, tmp_path, capsys):
    """Bad counts, directories that are files, and a fresh run into another run's --out: a clear
    error (exit 2) before the target answers anything."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = [
        (("--num-prompts", "-4"), "--num-prompts must be >= 1"),
        (("--num-prompts", "0"), "--num-prompts must be >= 1"),
        (("--held-out", "0"), "--held-out must be >= 1"),
        (("--out", str(afile)), "is a file, not a directory"),
        (("--out", str(afile / "sub")), "which is a file"),
        (("--data-dir", str(afile)), "is a file, not a directory"),
    ]
    for extra, message in cases:
        assert main(_argv(tiny_target, tmp_path, "--steps", "1", *extra)) == 2, extra
        assert message in capsys.readouterr().err, extra
    assert not (tmp_path / "data").exists()  # nothing was answered
    assert main(_argv(tiny_target, tmp_path, "--steps", "3")) == 0
    checkpoint = tmp_path / "out" / "checkpoint.pt"
    before = checkpoint.read_bytes()
    capsys.readouterr()
    assert main(_argv(tiny_target, tmp_path, "--steps", "1")) == 2  # forgetting --resume keeps the run
    assert "holds a run already" in capsys.readouterr().err and checkpoint.read_bytes() == before
    checkpoint.write_bytes(before[: len(before) // 2])  # a damaged checkpoint is named, not a traceback
    assert main(_argv(tiny_target, tmp_path, "--steps", "6", "--resume")) == 2
    assert "checkpoint is damaged" in capsys.readouterr().err
    checkpoint.write_text("garbage\n")  # not torch's at all
    assert main(_argv(tiny_target, tmp_path, "--steps", "6", "--resume")) == 2
    assert "checkpoint is damaged" in capsys.readouterr().err


def test_a_resume_that_cannot_work_is_refused_before_answering(tiny_target, tmp_path, capsys):
    """--resume with another method, or for another target (told from its config alone), is
    refused before the target answers a prompt; a smaller --steps says nothing was added."""
    assert main(_argv(tiny_target, tmp_path, "--steps", "3")) == 0
    capsys.readouterr()
    answers = sorted((tmp_path / "data").rglob("*.jsonl"))
    other = tmp_path / "other-target"
    shutil.copytree(tiny_target[0], other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 1}))
    (tmp_path / "data").rename(tmp_path / "kept")  # answering anything would recreate it
    assert main(_argv(tiny_target, tmp_path, "--steps", "6", "--resume", "--method", "mtp")) == 2
    assert "holds a medusa run, not mtp" in capsys.readouterr().err
    assert main(_argv(tiny_target, tmp_path, "--steps", "6", "--resume", "--target", str(other))) == 2
    err = capsys.readouterr().err
    assert "trains a head for" in err and "num_layers" in err
    assert not (tmp_path / "data").exists()
    (tmp_path / "kept").rename(tmp_path / "data")
    info = tmp_path / "out" / "checkpoint.json"
    kept = info.read_text()
    info.write_text("{}")  # damaged: no early check, but the checkpoint's own on loading, named
    assert main(_argv(tiny_target, tmp_path, "--steps", "6", "--resume", "--method", "mtp")) == 2
    assert "--method mtp does not take options" in capsys.readouterr().err  # no KeyError from the json
    info.write_text(kept)
    assert main(_argv(tiny_target, tmp_path, "--steps", "2", "--resume")) == 0
    assert "the checkpoint had 3 steps, more than --steps 2" in capsys.readouterr().out
    assert sorted((tmp_path / "data").rglob("*.jsonl")) == answers


def test_sigterm_stops_training_as_ctrl_c_does(tiny_target, tmp_path, capsys, monkeypatch):
    """A scheduler's SIGTERM during the optimisation ends it with the checkpoint message and
    exit 143, not a silent death."""
    from tandem.train import cli as train_cli

    def terminated_mid_run(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr(train_cli, "train", terminated_mid_run)
    assert main(_argv(tiny_target, tmp_path, "--steps", "3")) == 143
    assert "tandem train: terminated; no checkpoint was written yet" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # given back


def test_prompt_files_that_are_not_text_or_json_are_named(tiny_target, tmp_path, capsys):
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00bad\n")
    prose = tmp_path / "prose.jsonl"
    prose.write_text('"a prompt"\nnot json at all\n')
    for path, message in ((binary, f"prompt file {binary} is not UTF-8 text"), (prose, f"{prose}:2: not JSON")):
        argv = _argv(tiny_target, tmp_path, "--steps", "1")
        argv[argv.index("--prompts") + 1] = str(path)
        assert main(argv) == 2
        assert message in capsys.readouterr().err


def test_a_damaged_head_is_a_clear_error(tiny_target, tmp_path):
    from tandem.drafters.heads.base import TargetParts
    from tandem.drafters.heads.io import load_head, read_head_config
    from tandem.model.loader import load_model

    assert main(_argv(tiny_target, tmp_path, "--steps", "1")) == 0
    out = tmp_path / "out"
    target = TargetParts.from_loaded(load_model(str(tiny_target[0])))
    with pytest.raises(ValueError, match="is not a draft head's head.json"):
        read_head_config(out / "head.safetensors")  # the weights file given for the directory
    weights = out / "head.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="head.safetensors cannot be read"):
        load_head(out, target)
    (out / "head.json").write_text('{"format": "tandem-draft-head", "meth')
    with pytest.raises(ValueError, match="head.json is not a draft head's head.json"):
        read_head_config(out)
