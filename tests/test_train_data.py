"""Training data: prompt formats, the split, resumable self-distillation and hidden-state capture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_loaded
from tandem.config import EngineConfig
from tandem.llm import LLM
from tandem.train.capture import CapturedData, capture, sequences
from tandem.train.data import DistillConfig, distill, load_prompts, read_prompt_file

pytestmark = pytest.mark.usefixtures("one_thread")

DATA = Path(__file__).resolve().parents[1] / "src" / "tandem" / "data" / "train"


def _write(path: Path, records, jsonl: bool) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) if jsonl else json.dumps(records))
    return path


def test_each_prompt_format(tmp_path):
    cases = {
        "turns.jsonl": ([{"turns": ["first turn", "second turn"]}], True, ["first turn"]),
        "gsm.jsonl": ([{"question": "How many?", "answer": "4"}], True, ["How many?"]),
        "teacher.json": ([{"instruction": "Sum", "input": "1 2", "response": "3"},
                          {"instruction": "Greet", "input": "", "response": "hi"}], False, ["Sum\n\n1 2", "Greet"]),
        "seed.jsonl": ([{"instruction": "Fix", "instances": [{"input": "teh", "output": "the"}]}], True, ["Fix\n\nteh"]),
        "lottery.jsonl": (["Can you tell me about GLaDOS?"], True, ["Can you tell me about GLaDOS?"]),
        "tree.jsonl": ([{"prompt": {"text": "How do I bake?", "replies": []}}], True, ["How do I bake?"]),
    }
    for name, (records, jsonl, want) in cases.items():
        assert read_prompt_file(_write(tmp_path / name, records, jsonl)) == want, name


def test_shipped_training_sets_load_and_match_their_sources():
    files = sorted(DATA.glob("*.json*"))
    assert len(files) == 8
    for f in files:
        prompts = read_prompt_file(f)
        assert len(prompts) >= 100, f.name
    raw = json.loads((DATA / "gsm8k_train.jsonl").read_text().splitlines()[0])
    assert read_prompt_file(DATA / "gsm8k_train.jsonl")[0] == raw["question"]
    tree = json.loads((DATA / "oasst_en_100_tree.jsonl").read_text().splitlines()[0])
    assert read_prompt_file(DATA / "oasst_en_100_tree.jsonl")[0] == tree["prompt"]["text"]


def test_evaluation_sets_and_bad_files_are_refused(tmp_path):
    bench = Path(__file__).resolve().parents[1] / "src" / "tandem" / "data" / "spec_bench_question.jsonl"
    with pytest.raises(ValueError, match="evaluation set"):
        read_prompt_file(bench)
    with pytest.raises(ValueError, match="no prompts found"):
        read_prompt_file(_write(tmp_path / "odd.jsonl", [{"text": 1}], True))
    with pytest.raises(FileNotFoundError):
        read_prompt_file(tmp_path / "missing.jsonl")


def test_split_deduplicates_mixes_files_and_is_deterministic(tmp_path):
    a = _write(tmp_path / "a.jsonl", [{"question": f"math {i}"} for i in range(50)] + [{"question": "Math  0"}], True)
    b = _write(tmp_path / "b.jsonl", [f"chat {i}" for i in range(10)], True)
    split = load_prompts([a, b], num_prompts=20, held_out=6, seed=3)
    allp = split.held_out + split.train
    assert len(set(allp)) == len(allp) == 26
    everything = load_prompts([a, b], held_out=6, seed=3)
    assert len(everything.train) + 6 == 60  # "Math  0" duplicates "math 0"
    assert sum(p.startswith("chat") for p in allp[:20]) == 10  # round-robin: the small file is not drowned
    assert load_prompts([a, b], num_prompts=20, held_out=6, seed=3) == split
    bigger = load_prompts([a, b], num_prompts=40, held_out=6, seed=3)
    assert bigger.held_out == split.held_out and bigger.train[:20] == split.train
    assert load_prompts([a, b], num_prompts=20, held_out=6, seed=4).train != split.train
    with pytest.raises(ValueError, match="held out"):
        load_prompts([b], held_out=10)


class CountingLLM:
    """Wraps an LLM; counts generated prompts and can crash after a number of generate calls."""

    def __init__(self, llm, crash_after: int | None = None) -> None:
        self.llm, self.crash_after, self.calls, self.prompts = llm, crash_after, 0, 0
        self.tokenizer, self.config, self.encode = llm.tokenizer, llm.config, llm.encode

    def generate(self, prompts, params, chat=False):
        if self.crash_after is not None and self.calls >= self.crash_after:
            raise KeyboardInterrupt
        self.calls += 1
        self.prompts += len(prompts)
        return self.llm.generate(prompts, params, chat=chat)


def _tiny_llm(max_model_len: int = 64) -> LLM:
    _, loaded = tiny_loaded("llama")
    return LLM.from_loaded(loaded, EngineConfig(model="tiny", max_model_len=max_model_len, max_num_seqs=4))


PROMPTS = [" ".join(str(3 + (i * 7 + j) % 90) for j in range(3 + i % 4)) for i in range(10)]


def test_distill_resumes_without_redoing_finished_shards(tmp_path):
    cfg = DistillConfig(target="tiny-llama", max_new_tokens=6)
    whole = distill(_tiny_llm(), PROMPTS, tmp_path / "whole", cfg, shard_size=4)
    assert [len(r["answer_ids"]) for r in whole] == [6] * len(PROMPTS)
    crashing = CountingLLM(_tiny_llm(), crash_after=2)
    with pytest.raises(KeyboardInterrupt):
        distill(crashing, PROMPTS, tmp_path / "run", cfg, shard_size=4)
    assert crashing.prompts == 8 and len(list((tmp_path / "run").glob("answers-*.jsonl"))) == 2
    resumed = CountingLLM(_tiny_llm())
    records = distill(resumed, PROMPTS, tmp_path / "run", cfg, shard_size=4)
    assert resumed.prompts == 2  # only the unfinished shard ran again
    assert records == whole
    again = CountingLLM(_tiny_llm())
    assert distill(again, PROMPTS, tmp_path / "run", cfg, shard_size=4) == whole and again.prompts == 0
    with pytest.raises(ValueError, match="was made with"):
        distill(_tiny_llm(), PROMPTS, tmp_path / "run", DistillConfig(target="tiny-llama", max_new_tokens=7))


def test_distill_sampling_is_seeded_per_prompt(tmp_path):
    cfg = DistillConfig(target="tiny-llama", max_new_tokens=8, temperature=1.0, seed=5)
    a = distill(_tiny_llm(), PROMPTS[:6], tmp_path / "a", cfg, shard_size=6)
    b = distill(_tiny_llm(), PROMPTS[:6], tmp_path / "b", cfg, shard_size=2)
    assert a == b


def test_distill_skips_prompts_too_long_for_the_context(tmp_path):
    long_prompt = " ".join(["5"] * 60)
    records = distill(_tiny_llm(max_model_len=64), [PROMPTS[0], long_prompt], tmp_path, DistillConfig("tiny", max_new_tokens=8))
    assert len(records[0]["answer_ids"]) == 8
    assert records[1]["answer_ids"] == [] and records[1]["finish_reason"].startswith("skipped")
    assert len(sequences(records)) == 1


def test_capture_matches_a_direct_forward_and_resumes(tmp_path):
    hf, loaded = tiny_loaded("llama")
    records = distill(_tiny_llm(), PROMPTS[:5], tmp_path / "answers", DistillConfig("tiny", max_new_tokens=6))
    seqs = sequences(records)
    L = loaded.config.num_layers
    layers = (0, L)
    paths = capture(loaded, seqs, tmp_path / "cap", layers, shard_size=2, batch_size=3, store_dtype=torch.float32)
    assert len(paths) == 3
    data = CapturedData(paths, layers)
    assert data.num_sequences == 5
    batches = data.in_order(batch_size=2)
    seen = 0
    for shard, idx in batches:
        batch = data.batch(shard, idx)
        for b, i in enumerate(idx):
            s = seqs[seen + b]
            n = len(s.token_ids)
            assert batch.lengths[b] == n and batch.token_ids[b, :n].tolist() == s.token_ids
            # loss_mask[t] marks positions whose next token is an answer token.
            assert batch.loss_mask[b].nonzero().flatten().tolist() == list(range(s.prompt_len - 1, n - 1))
            with torch.no_grad():
                ref = hf(torch.tensor([s.token_ids]), output_hidden_states=True).hidden_states
            # HF: hidden_states[i + 1] is decoder layer i's output; the last one is after the final norm.
            torch.testing.assert_close(batch.hidden[0][b, :n], ref[1][0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(batch.hidden[L][b, :n], ref[-1][0], atol=1e-4, rtol=1e-4)
            assert not batch.hidden[L][b, n:].any()
        seen += len(idx)
    # Cropped prompts: the last 2 prompt tokens stay before each answer, rows otherwise the same.
    cropped = CapturedData(paths, layers, max_prompt_context=2)
    batch = cropped.batch(0, [0, 1])
    for b in range(2):
        s = seqs[b]
        drop = max(0, s.prompt_len - 2)
        n = len(s.token_ids) - drop
        assert batch.lengths[b] == n and batch.token_ids[b, :n].tolist() == s.token_ids[drop:]
        assert batch.loss_mask[b].nonzero().flatten().tolist() == list(range(min(s.prompt_len, 2) - 1, n - 1))
        full = data.batch(0, [b])
        torch.testing.assert_close(batch.hidden[L][b, :n], full.hidden[L][0, drop : drop + n])
    with pytest.raises(ValueError, match="max_prompt_context"):
        CapturedData(paths, layers, max_prompt_context=0)
    before = [p.stat().st_mtime_ns for p in paths]
    paths[1].unlink()
    again = capture(loaded, seqs, tmp_path / "cap", layers, shard_size=2, batch_size=3, store_dtype=torch.float32)
    assert [p.stat().st_mtime_ns for p in (again[0], again[2])] == [before[0], before[2]]
    assert again[1].exists()
    with pytest.raises(ValueError, match="hidden layers"):
        capture(loaded, seqs, tmp_path / "bad", (L + 1,))


def test_epoch_plan_is_a_deterministic_permutation(tmp_path):
    _, loaded = tiny_loaded("llama")
    records = distill(_tiny_llm(), PROMPTS, tmp_path / "answers", DistillConfig("tiny", max_new_tokens=4))
    paths = capture(loaded, sequences(records), tmp_path / "cap", (2,), shard_size=4)
    data = CapturedData(paths, (2,))
    plan = data.epoch_plan(0, batch_size=3, seed=1)
    assert plan == data.epoch_plan(0, batch_size=3, seed=1) != data.epoch_plan(1, batch_size=3, seed=1)
    assert sorted((s, i) for s, idx in plan for i in idx) == [(s, i) for s, n in enumerate(data.counts) for i in range(n)]
    with pytest.raises(ValueError, match="no hidden states of layers"):
        CapturedData(paths, (0,))
