"""Loader: name resolution and clear errors; HF-directory round trip on a tiny model."""

import json
import os

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


def test_a_builtin_named_by_its_file_is_the_builtin(tmp_path, monkeypatch):
    """The bundled GGUF given by path resolves to the built-in name (its shipped drafters follow
    the name); a copy elsewhere is a model of its own; a truncated file is a clear error that
    leaves nothing in the cache."""
    from tandem.model.catalogue import BUILTIN_MODELS, builtin_name
    from tandem.model.loader import model_config

    gguf = BUILTIN_MODELS["smollm2-135m-instruct"]()
    assert builtin_name(str(gguf)) == resolve_model(str(gguf)).name == "smollm2-135m-instruct"
    link = tmp_path / "same.gguf"
    link.symlink_to(gguf)
    assert builtin_name(str(link)) == "smollm2-135m-instruct"  # the same file
    cut = tmp_path / "cut.gguf"
    with gguf.open("rb") as f:
        cut.write_bytes(f.read(100_000))
    assert builtin_name(str(cut)) is None
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelNotFoundError, match="not a complete GGUF"):
        model_config(str(cut))
    assert not any((tmp_path / "cache" / "models").glob("*.tmp"))


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))


def test_unsupported_architecture_in_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(UnsupportedArchitectureError, match="supported"):
        load_model(str(tmp_path))


def test_hf_directory_round_trip(tmp_path):
    """A local HF directory (config + safetensors + tokenizer) loads and matches transformers."""
    hf, _ = build_tiny("qwen2")
    _tiny_dir(tmp_path, hf)
    loaded = load_model(str(tmp_path), quantization="none", dtype="float32")
    assert loaded.quantization == "none" and loaded.dtype == torch.float32
    _assert_logits_match(loaded, hf)


def _assert_logits_match(loaded, hf) -> None:
    """A loaded model's logits over a few tokens against the transformers model it came from."""
    from tandem.model.kv_cache import KVCache
    from tandem.model.runner import ModelRunner, SeqInput

    runner = ModelRunner(loaded.model, KVCache(loaded.config, 1, 32, torch.float32))
    ids = [5, 9, 14, 3, 77]
    out = runner.forward([SeqInput(runner.cache.allocate(), ids, logits="all")])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(out.logits, ref, atol=2e-4, rtol=1e-4)


def _tiny_dir(root, hf) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    hf.save_pretrained(root)
    vocab = {f"t{i}": i for i in range(97)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                            eos_token="t2").save_pretrained(root)


def test_weights_the_decoder_would_leave_out_are_refused(tmp_path):
    """A checkpoint tensor no layer reads (here a bias the config does not announce) would run as
    another model: loading names it instead (an o_proj bias was once dropped without a word)."""
    from safetensors.torch import load_file, save_file

    hf, _ = build_tiny("llama")
    _tiny_dir(tmp_path, hf)
    (weights,) = tmp_path.glob("*.safetensors")
    state = load_file(str(weights))
    state["model.layers.1.self_attn.o_proj.bias"] = torch.ones(64)
    save_file(state, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.o_proj\.bias"):
        load_model(str(tmp_path), quantization="none", dtype="float32")


def test_a_multimodal_checkpoint_runs_its_language_model(tmp_path):
    """Gemma 3 4B and up are saved with the language model under a prefix and a vision tower
    beside it: tandem reads the language model's tensors by their plain names and leaves the
    vision tower, and the logits are the text model's."""
    from safetensors.torch import save_file

    hf, _ = build_tiny("gemma3")
    _tiny_dir(tmp_path, hf)
    (weights,) = tmp_path.glob("*.safetensors")
    state = {"language_model." + k: v.clone() for k, v in hf.state_dict().items()}
    state["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4, 3, 2, 2)
    weights.unlink()
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    _assert_logits_match(load_model(str(tmp_path), quantization="none", dtype="float32"), hf)


def test_native_quantization_needs_gguf(tmp_path):
    hf, _ = build_tiny("llama")
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GGUF"):
        load_model(str(tmp_path), quantization="native")


@pytest.mark.slow
def test_a_half_made_model_conversion_is_made_again(tmp_path, monkeypatch):
    """A converted GGUF directory holding config.json alone (what two runs racing on an older
    tandem left) is converted again, through a directory of this process's own."""
    from tandem.model.loader import METADATA_FILES, _ensure_gguf_metadata

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    src = resolve_model("smollm2-135m-instruct")
    src.hf_dir.mkdir(parents=True)
    (src.hf_dir / "config.json").write_text("{}")
    _ensure_gguf_metadata(src)
    assert all((src.hf_dir / name).is_file() for name in METADATA_FILES)
    assert json.loads((src.hf_dir / "config.json").read_text())["hidden_size"] == 576
    assert [p.name for p in src.hf_dir.parent.iterdir()] == [src.hf_dir.name]  # no temporary left
    mask = os.umask(0)
    os.umask(mask)
    assert src.hf_dir.stat().st_mode & 0o777 == 0o777 & ~mask  # as readable as a directory made plainly


def test_a_cache_directory_that_is_a_file_is_named(tmp_path, monkeypatch):
    from tandem.paths import cache_root

    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "afile"))
    with pytest.raises(ValueError, match="is a file; point TANDEM_CACHE_DIR at a directory"):
        cache_root()


def test_a_damaged_converted_model_names_its_file(tmp_path, monkeypatch):
    """A cached conversion whose config or weights are damaged: an error naming the file and
    saying it can be made again, not a bare JSON or safetensors error."""
    from tandem.model.loader import load_safetensors_dir, read_hf_config

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    model_dir = tmp_path / "models" / "m"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text('{"hidden_size": ')
    with pytest.raises(ValueError, match=r"config.json cannot be read .*delete .* and it is made again"):
        read_hf_config(model_dir)
    (model_dir / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(ValueError, match=r"model.safetensors cannot be read"):
        load_safetensors_dir(model_dir)
