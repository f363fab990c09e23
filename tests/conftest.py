"""Shared fixtures: tiny random-weight models (HF reference + tandem's lean copy) and a toy tokenizer."""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from tandem.model.loader import LoadedModel

# Under pytest-xdist each worker takes one core: two workers with two threads each would
# oversubscribe the cores and leave OpenMP teams spinning at barriers.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256)


def tiny_hf_config(arch: str, **overrides):
    """A small config of the given architecture (the shapes real models have, shrunk)."""
    import transformers as tf

    common = dict(TINY, num_attention_heads=4, num_key_value_heads=2, eos_token_id=2, bos_token_id=1)
    common.update(overrides)
    if arch == "llama":
        return tf.LlamaConfig(**common, tie_word_embeddings=True)
    if arch == "llama3_scaled":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        return tf.LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False)
    if arch == "llama_biased":  # attention_bias biases q, k, v and o; mlp_bias gate, up and down
        return tf.LlamaConfig(**common, attention_bias=True, mlp_bias=True, tie_word_embeddings=False)
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=6, tie_word_embeddings=False)
    if arch == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=False)
    if arch == "qwen3":
        return tf.Qwen3Config(**{"head_dim": 24, **common}, tie_word_embeddings=True)
    if arch == "qwen3_biased":
        return tf.Qwen3Config(**{"head_dim": 24, **common}, attention_bias=True, tie_word_embeddings=True)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(
            **{"head_dim": 16, **common, "num_hidden_layers": 3}, query_pre_attn_scalar=20, sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        )
    raise ValueError(arch)


ARCHS = ["llama", "llama3_scaled", "llama_biased", "mistral", "qwen2", "qwen3", "qwen3_biased", "gemma3"]


def build_tiny(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """(HF reference model, tandem TransformerLM) with identical random weights."""
    from transformers import AutoModelForCausalLM

    from tandem.model.arch import model_config_from_hf
    from tandem.model.loader import StateDictSource
    from tandem.model.transformer import TransformerLM

    torch.manual_seed(seed)
    hf_cfg = tiny_hf_config(arch, **overrides)
    hf = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            # Random norms too, so a wrong (1 + w) offset or a missing norm cannot hide.
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.08))
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    cfg = model_config_from_hf(hf_cfg.to_dict())
    ours = TransformerLM(cfg, StateDictSource(state, "none", dtype), dtype).eval()
    return hf, ours


class ToyTokenizer:
    """Enough of a tokenizer for the engine on tiny models: ids <-> space-separated numbers."""

    eos_token_id = 2
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids if not (skip_special_tokens and i == self.eos_token_id))


def write_tiny_target(root):
    """A tiny random llama as an HF directory with a word-level tokenizer (t0 .. t96; t2 is EOS)
    that tandem's CLI loads by path, and a .jsonl of 20 prompts beside it: (root, prompts)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    hf, _ = build_tiny("llama")
    hf.save_pretrained(root)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(97)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2").save_pretrained(root)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(" ".join(f"t{3 + (i * 13 + j) % 90}" for j in range(4))) + "\n"
                               for i in range(20)))
    return root, prompts


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a shared 2-core machine every
    parallel region can wait a whole scheduler slice for a busy core (measured 10-60x slower).
    Modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def toy_tokenizer():
    return ToyTokenizer()


@functools.lru_cache(maxsize=None)
def tiny_loaded(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32):
    """A LoadedModel around a tiny random model, for engine-level tests (shared: read-only)."""
    from tandem.model.loader import LoadedModel

    hf, ours = build_tiny(arch, seed, dtype)
    return hf, LoadedModel(ours, ToyTokenizer(), ours.cfg, f"tiny-{arch}", dtype, "none")


# Every path the quantized linears can take: tandem's block-kernel variants (kernels.VARIANTS)
# and torch's int4/int8 kernels. Tests that take `kernel_path` run once per path this CPU
# supports and skip the others with the reason.
KERNEL_PATHS = ("avx512", "vnni256", "avx2", "torch")
BLOCK_PATHS = KERNEL_PATHS[:-1]


def _use_kernel_path(name: str, monkeypatch) -> str:
    from tandem.model import kernels

    if name != "torch" and name not in kernels.supported_variants():
        supported = ", ".join(kernels.supported_variants()) or "none"
        pytest.skip(f"this CPU cannot run the {name} kernels (it runs: {supported})")
    monkeypatch.setenv("TANDEM_KERNELS", name)
    return name


@pytest.fixture(params=KERNEL_PATHS)
def kernel_path(request, monkeypatch):
    """TANDEM_KERNELS set to one path (a block-kernel variant or torch) for the test."""
    return _use_kernel_path(request.param, monkeypatch)


@pytest.fixture(params=BLOCK_PATHS)
def block_variant(request, monkeypatch):
    """TANDEM_KERNELS set to one block-kernel variant for the test."""
    return _use_kernel_path(request.param, monkeypatch)


def quantized_tiny(arch: str) -> "LoadedModel":
    """A tiny random model with int4 weights on whatever path TANDEM_KERNELS selects (the fused,
    batch-invariant path where it selects a block-kernel variant)."""
    from tandem.model.arch import model_config_from_hf
    from tandem.model.loader import LoadedModel, StateDictSource, resolve_kernels
    from tandem.model.transformer import TransformerLM

    hf, _ = build_tiny(arch)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    cfg = model_config_from_hf(hf.config.to_dict())
    path = resolve_kernels("int4")
    dtype = torch.float32 if path == "block" else torch.bfloat16
    model = TransformerLM(cfg, StateDictSource(state, "int4", dtype, kernels=path), dtype)
    return LoadedModel(model, ToyTokenizer(), cfg, f"int4-{arch}", dtype, "int4", path)
