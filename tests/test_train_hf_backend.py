"""The transformers backend of the data stages writes what the engine path writes."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import tiny_loaded
from tandem.config import EngineConfig
from tandem.llm import LLM
from tandem.train.capture import CapturedData, capture, capture_in_memory, engine_forward_factory, sequences
from tandem.train.data import DistillConfig, distill, read_answers
from tandem.train.hf_backend import capture_hf, distill_hf, hf_forward_factory

pytestmark = pytest.mark.usefixtures("one_thread")

# Prompts of different lengths, so the padded batches really pad.
PROMPTS = [" ".join(str(3 + (i * 11 + j) % 90) for j in range(2 + i % 5)) for i in range(9)]


def _engine_answers(tmp_path, max_new_tokens=7):
    _, loaded = tiny_loaded("llama")
    llm = LLM.from_loaded(loaded, EngineConfig(model="tiny", max_model_len=64, max_num_seqs=4))
    return distill(llm, PROMPTS, tmp_path / "engine", DistillConfig("tiny", max_new_tokens=max_new_tokens), shard_size=4)


def test_greedy_answers_equal_the_engines(tmp_path):
    hf, loaded = tiny_loaded("llama")
    want = _engine_answers(tmp_path)
    cfg = DistillConfig("tiny", max_new_tokens=7)
    got = distill_hf(hf, loaded.tokenizer, {2}, PROMPTS, tmp_path / "hf", cfg, batch_size=4, max_model_len=64)
    assert got == want
    assert any(r["finish_reason"] == "stop" for r in got) or all(len(r["answer_ids"]) == 7 for r in got)
    # Resumable like the engine path: nothing is answered twice.
    shards = sorted((tmp_path / "hf").glob("answers-*.jsonl"))
    stamps = [p.stat().st_mtime_ns for p in shards]
    assert distill_hf(hf, loaded.tokenizer, {2}, PROMPTS, tmp_path / "hf", cfg, batch_size=4, max_model_len=64) == want
    assert [p.stat().st_mtime_ns for p in shards] == stamps
    with pytest.raises(ValueError, match="greedily"):
        distill_hf(hf, loaded.tokenizer, {2}, PROMPTS, tmp_path / "t1", DistillConfig("tiny", temperature=1.0))


def test_a_passed_deadline_answers_nothing_new(tmp_path):
    hf, loaded = tiny_loaded("llama")
    cfg = DistillConfig("tiny", max_new_tokens=4)
    first = distill_hf(hf, loaded.tokenizer, {2}, PROMPTS[:4], tmp_path, cfg, batch_size=4, max_model_len=64)
    late = distill_hf(hf, loaded.tokenizer, {2}, PROMPTS, tmp_path, cfg, batch_size=4, max_model_len=64,
                      deadline=time.monotonic() - 1)
    assert late == first and len(read_answers(tmp_path)) == 4


def test_capture_equals_the_engines(tmp_path):
    hf, loaded = tiny_loaded("llama")
    seqs = sequences(_engine_answers(tmp_path))
    L = loaded.config.num_layers
    layers = (0, 1, L)
    ours = capture(loaded, seqs, tmp_path / "ours", layers, shard_size=4, batch_size=3, store_dtype=torch.float32)
    theirs = capture_hf(hf, loaded.name, seqs, tmp_path / "hf", layers, shard_size=4, batch_size=3,
                        store_dtype=torch.float32)
    a, b = CapturedData(ours, layers), CapturedData(theirs, layers)
    for shard, idx in a.in_order(batch_size=4):
        x, y = a.batch(shard, idx), b.batch(shard, idx)
        assert torch.equal(x.token_ids, y.token_ids) and torch.equal(x.loss_mask, y.loss_mask)
        for layer in layers:
            torch.testing.assert_close(x.hidden[layer], y.hidden[layer], atol=1e-4, rtol=1e-4)


def test_resident_data_gives_the_same_batches(tmp_path):
    hf, loaded = tiny_loaded("llama")
    seqs = sequences(_engine_answers(tmp_path))
    paths = capture_hf(hf, loaded.name, seqs, tmp_path / "cap", (1,), shard_size=4, batch_size=4)
    on_disk, resident = CapturedData(paths, (1,), 3), CapturedData(paths, (1,), 3).to_device("cpu")
    for shard, idx in on_disk.epoch_plan(0, batch_size=3, seed=0):
        x, y = on_disk.batch(shard, idx), resident.batch(shard, idx)
        assert torch.equal(x.token_ids, y.token_ids) and torch.equal(x.lengths, y.lengths)
        assert torch.equal(x.loss_mask, y.loss_mask) and torch.equal(x.hidden[1], y.hidden[1])


@pytest.mark.parametrize("backend", ["engine", "transformers"])
def test_capture_in_memory_holds_what_the_disk_capture_holds(tmp_path, backend):
    hf, loaded = tiny_loaded("llama")
    seqs = sequences(_engine_answers(tmp_path))
    L = loaded.config.num_layers
    layers = (1, L)
    factory = engine_forward_factory(loaded, batch_size=3) if backend == "engine" else hf_forward_factory(hf)
    paths = capture_hf(hf, loaded.name, seqs, tmp_path / "cap", layers, shard_size=4, batch_size=3,
                       store_dtype=torch.float32)
    on_disk = CapturedData(paths, layers, 3)
    memory = capture_in_memory(factory, seqs, layers, "cpu", 3, shard_size=4, batch_size=3, store_dtype=torch.float32)
    assert memory.num_sequences == on_disk.num_sequences == len(seqs)

    def rows(data):  # sequence (as its token ids) -> (loss mask, hidden states per layer), batch order aside
        out = {}
        for shard, idx in data.in_order(batch_size=2):
            batch = data.batch(shard, idx)
            for b in range(len(idx)):
                n = int(batch.lengths[b])
                out[tuple(batch.token_ids[b, :n].tolist())] = (batch.loss_mask[b, :n], [batch.hidden[x][b, :n] for x in layers])
        return out

    want, got = rows(on_disk), rows(memory)
    assert want.keys() == got.keys()
    for key, (mask, hidden) in want.items():
        assert torch.equal(mask, got[key][0])
        for h, g in zip(hidden, got[key][1]):
            torch.testing.assert_close(g, h, atol=1e-4, rtol=1e-4)
    # Shards group sequences of similar length, so a batch drawn within one pads little.
    lengths = [data_len for shard in memory._resident for data_len in shard["offsets"].diff().tolist()]
    assert lengths == sorted(lengths)
    assert memory.to_device("cpu").num_sequences == len(seqs)
    with pytest.raises(ValueError, match="empty"):
        capture_in_memory(factory, [], layers, "cpu")
