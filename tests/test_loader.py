"""Loader: name resolution and clear errors; HF-directory round trip on a tiny model."""

import json

import pytest
import torch

from conftest import build_tiny
from tandem.model.arch import UnsupportedArchitectureError
from tandem.model.catalogue import ModelNotFoundError, resolve_model
from tandem.model.loader import load_model


def test_unknown_name_lists_builtins():
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct"):
        resolve_model("no-such-model")


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model(str(tmp_path / "absent.gguf"))


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))


def test_unsupported_architecture_in_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(UnsupportedArchitectureError, match="supported"):
        load_model(str(tmp_path))


def test_hf_directory_round_trip(tmp_path):
    """A local HF directory (config + safetensors + tokenizer) loads and matches transformers."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    hf, _ = build_tiny("qwen2")
    hf.save_pretrained(tmp_path)
    vocab = {f"t{i}": i for i in range(97)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")), eos_token="t2")
    tok.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), quantization="none", dtype="float32")
    assert loaded.quantization == "none" and loaded.dtype == torch.float32
    from tandem.model.kv_cache import KVCache
    from tandem.model.runner import ModelRunner, SeqInput

    runner = ModelRunner(loaded.model, KVCache(loaded.config, 1, 32, torch.float32))
    ids = [5, 9, 14, 3, 77]
    out = runner.forward([SeqInput(runner.cache.allocate(), ids, logits="all")])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(out.logits, ref, atol=2e-4, rtol=1e-4)


def test_native_quantization_needs_gguf(tmp_path):
    hf, _ = build_tiny("llama")
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GGUF"):
        load_model(str(tmp_path), quantization="native")
