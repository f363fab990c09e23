"""draft_model (distilled draft LM): init from target layers, KL loss, overfitting a tiny batch,
and the export: a llama directory the real loader reads, computing what the head computes."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_loaded
from heads_fixtures import expected_tau, hf_tokenizer, make_batch, parts, sharp_target, train
from tandem.drafters.heads.base import TargetParts
from tandem.drafters.heads.draft_model import spaced_layers
from tandem.drafters.heads.io import build_head, load_head, save_head
from tandem.model.kv_cache import KVCache
from tandem.model.loader import load_model
from tandem.model.runner import ModelRunner, SeqInput

pytestmark = pytest.mark.usefixtures("one_thread")


def test_spaced_layers():
    assert spaced_layers(30, 2) == (0, 29)
    assert spaced_layers(30, 4) == (0, 10, 19, 29)
    assert spaced_layers(4, 1) == (0,)


def test_all_layers_reproduce_the_target():
    """Initialised from every target layer, the draft is the target (qwen2's q/k/v biases aside:
    use the llama target, which has none)."""
    loaded = tiny_loaded("llama")[1]
    p = TargetParts.from_loaded(loaded)
    head = build_head("draft_model", p, num_layers=2, init_layers=[0, 1])
    ids = torch.tensor([[5, 17, 33, 8, 91, 4, 17]])
    runner = ModelRunner(loaded.model, KVCache(loaded.config, 1, 16, torch.float32))
    want = runner.forward([SeqInput(runner.cache.allocate(), ids[0].tolist(), logits="all")]).logits
    got = p.lm_head(head.hidden(ids, p))[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_overfits_a_tiny_batch():
    p, batch = parts(), make_batch()
    head = build_head("draft_model", p, num_layers=1)
    before = head.draft_accuracy(batch, p, 3)
    losses = train(head, batch, p, steps=30, lr=3e-3)
    assert losses[-1] < losses[0] / 4
    assert expected_tau(head.draft_accuracy(batch, p, 3)) > expected_tau(before) + 0.5


def test_export_loads_as_a_model_computing_the_same_logits(tmp_path):
    p, batch = parts(), make_batch()
    head = build_head("draft_model", p, num_layers=2)
    train(head, batch, p, steps=5, lr=3e-3)
    save_head(head, tmp_path, "sharp-qwen2-0", tokenizer=hf_tokenizer())
    loaded = load_model(str(tmp_path))
    assert loaded.config.num_layers == 2 and loaded.config.vocab_size == 97
    assert loaded.tokenizer.encode("5 17 33") == [5, 17, 33]
    seq = batch.token_ids[0, :20].tolist()
    runner = ModelRunner(loaded.model, KVCache(loaded.config, 1, 32, loaded.dtype))
    got = runner.forward([SeqInput(runner.cache.allocate(), seq, logits="all")]).logits
    want = p.lm_head(head.hidden(torch.tensor([seq]), p))[0]
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    # The head directory also reloads as a head (training resumes, evaluation).
    again = load_head(tmp_path, p)
    torch.testing.assert_close(again.hidden(torch.tensor([seq]), p), head.hidden(torch.tensor([seq]), p))


def test_export_needs_a_tokenizer(tmp_path):
    head = build_head("draft_model", parts(), num_layers=1)
    with pytest.raises(ValueError, match="tokenizer"):
        save_head(head, tmp_path, "sharp-qwen2-0")


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="num_layers"):
        build_head("draft_model", parts(), num_layers=9)
    with pytest.raises(ValueError, match="init_layers"):
        build_head("draft_model", parts(), num_layers=2, init_layers=[0])


def test_reduced_vocab_export_is_served_by_the_draft_model_drafter(tmp_path):
    """vocab_size 60 of 97: a smaller file; the drafter never proposes ids >= 60, feeds them as
    the unknown token (as training did), and greedy output still equals plain decoding."""
    import dataclasses

    from tandem.config import EngineConfig, SamplingParams, SpecConfig
    from tandem.llm import LLM

    p, batch = parts(), make_batch()
    head = build_head("draft_model", p, num_layers=1, vocab_size=60)
    losses = train(head, batch, p, steps=20, lr=3e-3)
    assert losses[-1] < losses[0]
    save_head(head, tmp_path, "sharp-qwen2-0", tokenizer=hf_tokenizer())
    exported = load_model(str(tmp_path))
    assert exported.config.vocab_size == 60
    seq = batch.token_ids[1, :20].tolist()
    assert max(seq) >= 60  # the stand-in path is exercised
    runner = ModelRunner(exported.model, KVCache(exported.config, 1, 32, exported.dtype))
    got = runner.forward([SeqInput(runner.cache.allocate(), [t if t < 60 else 0 for t in seq], logits="all")]).logits
    torch.testing.assert_close(got, head.logits(head.hidden(torch.tensor([seq]), p)[0], p), rtol=1e-3, atol=1e-3)

    target = dataclasses.replace(sharp_target(), tokenizer=hf_tokenizer())  # vocabularies compared by token
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [[5, 17, 33, 8, 91, 4], [60, 61, 62], [7] * 11 + [12, 13]]
    plain = [o.token_ids for o in LLM.from_loaded(target, EngineConfig(max_model_len=128)).generate(prompts, params)]
    llm = LLM.from_loaded(target, EngineConfig(max_model_len=128, spec=SpecConfig("draft_model", 3, str(tmp_path))))
    drafted = []
    propose = llm.engine.drafter.propose
    llm.engine.drafter.propose = lambda b: [drafted.extend(d.token_ids) or d for d in propose(b)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    assert drafted and max(drafted) < 60


def test_a_head_directory_of_trained_layers_is_served(tmp_path, monkeypatch):
    """As tandem ships it (head.json + head.safetensors, no embedding): the drafter adds the
    target's embedding and untied LM head once, caches the model directory, and drafts losslessly;
    without a path it finds the head shipped for the target."""
    import dataclasses

    from tandem.config import EngineConfig, SamplingParams, SpecConfig
    from tandem.drafters import draft_model as drafter_module
    from tandem.llm import LLM

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    p, batch = parts(), make_batch()
    head = build_head("draft_model", p, num_layers=2)
    train(head, batch, p, steps=10, lr=3e-3)
    full, shipped = tmp_path / "full", tmp_path / "shipped"
    save_head(head, full, "sharp-qwen2-0", tokenizer=hf_tokenizer())
    shipped.mkdir()
    for name in ("head.json", "head.safetensors"):
        (shipped / name).write_bytes((full / name).read_bytes())

    target = dataclasses.replace(sharp_target(), tokenizer=hf_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[5, 17, 33, 8, 91, 4], [7] * 9 + [12, 13]]
    plain = [o.token_ids for o in LLM.from_loaded(target, EngineConfig(max_model_len=128)).generate(prompts, params)]
    llm = LLM.from_loaded(target, EngineConfig(max_model_len=128, spec=SpecConfig("draft_model", 3, str(shipped))))
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.spec.num_draft_tokens for o in outs) > 0

    made = list((tmp_path / "cache" / "drafters").iterdir())
    assert len(made) == 1 and made[0].name.startswith("sharp-qwen2-0-draft_model-")
    seq = batch.token_ids[0, :20].tolist()
    logits = []
    for directory in (full, made[0]):
        loaded = load_model(str(directory))
        runner = ModelRunner(loaded.model, KVCache(loaded.config, 1, 32, loaded.dtype))
        logits.append(runner.forward([SeqInput(runner.cache.allocate(), seq, logits="all")]).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-3, atol=1e-3)

    # No path: the head shipped for the target; the cached directory is reused, not rebuilt.
    monkeypatch.setattr(drafter_module, "shipped_head_dir", lambda model, method: shipped if model == "sharp-qwen2-0" else None)
    stamp = (made[0] / "model.safetensors").stat().st_mtime_ns
    again = LLM.from_loaded(target, EngineConfig(max_model_len=128, spec=SpecConfig("draft_model", 3)))
    assert [o.token_ids for o in again.generate(prompts, params)] == plain
    assert list((tmp_path / "cache" / "drafters").iterdir()) == made
    assert (made[0] / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_head_directory_for_another_target_or_method_is_refused(tmp_path, monkeypatch):
    import dataclasses

    from tandem.config import EngineConfig, SpecConfig
    from tandem.llm import LLM

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    head = build_head("draft_model", parts(), num_layers=1)
    save_head(head, tmp_path / "dm", "sharp-qwen2-0", tokenizer=hf_tokenizer())
    (tmp_path / "dm" / "config.json").unlink()  # trained layers only
    other = dataclasses.replace(sharp_target(seed=1), tokenizer=hf_tokenizer())
    with pytest.raises(ValueError, match="different weights"):
        LLM.from_loaded(other, EngineConfig(max_model_len=64, spec=SpecConfig("draft_model", 3, str(tmp_path / "dm"))))
    medusa = build_head("medusa", parts(), num_heads=2)
    save_head(medusa, tmp_path / "medusa", "sharp-qwen2-0")
    target = dataclasses.replace(sharp_target(), tokenizer=hf_tokenizer())
    with pytest.raises(ValueError, match="holds a medusa head"):
        LLM.from_loaded(target, EngineConfig(max_model_len=64, spec=SpecConfig("draft_model", 3, str(tmp_path / "medusa"))))
