"""Model loading: a resolved model (model/catalogue.py) -> a lean TransformerLM + tokenizer.

A GGUF file is converted once through transformers + gguf (dequantised, slow) into a cache
directory of config.json + tokenizer (+ model.safetensors when a float copy is needed); later loads
read the cache. `native` quantization runs the GGUF's own 4-bit blocks (gguf_native.py) instead.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from tandem.model.arch import ModelConfig, UnsupportedArchitectureError, model_config_from_hf
from tandem.model.catalogue import ModelNotFoundError, ModelSource, resolve_model
from tandem.model.fused import fused_eligible
from tandem.model.gguf_source import GGUFSource
from tandem.model.kernels import block_kernels
from tandem.model.kv_cache import kv_cache_dtype
from tandem.model.libc import trim_heap
from tandem.model.quant import DenseLinear, quantize_linear
from tandem.model.transformer import TransformerLM
from tandem.paths import cache_root, save_safetensors, umask
from tandem.progress import progress

log = logging.getLogger("tandem.loader")


# What a GGUF model's converted metadata directory holds once complete.
METADATA_FILES = ("config.json", "tokenizer_config.json")


def _ensure_gguf_metadata(src: ModelSource) -> None:
    """config.json + tokenizer for a GGUF model, converted once (fast: no weights). Each process
    converts into a directory of its own and renames it into place, so runs started together never
    see (or leave) a half-written one; a directory without both files is converted again."""
    if all((src.hf_dir / name).is_file() for name in METADATA_FILES):
        return
    from transformers import (  # lazy: transformers takes seconds to import
        AutoConfig,
        AutoTokenizer,
    )

    assert src.gguf_path is not None
    log.info("reading config and tokenizer from %s (one time)", src.gguf_path.name)
    try:
        src.hf_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=src.hf_dir.parent, prefix=src.hf_dir.name + ".tmp-"))
        tmp.chmod(0o777 & ~umask())  # mkdtemp's 0700 would keep the other accounts sharing the cache out
    except OSError as err:
        raise ValueError(f"the cache directory {src.hf_dir.parent} cannot be written ({err.strerror or err}); set "
                         "TANDEM_CACHE_DIR to a writable directory") from None
    folder, fname = str(src.gguf_path.parent), src.gguf_path.name
    try:
        AutoTokenizer.from_pretrained(folder, gguf_file=fname).save_pretrained(tmp)
        AutoConfig.from_pretrained(folder, gguf_file=fname).save_pretrained(tmp)
    except Exception as err:  # a truncated or foreign file: say so, and leave nothing half-made
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelNotFoundError(f"{src.gguf_path} is not a complete GGUF model that transformers can read "
                                 f"({type(err).__name__}: {err})") from err
    if src.hf_dir.exists() and not all((src.hf_dir / name).is_file() for name in METADATA_FILES):
        shutil.rmtree(src.hf_dir, ignore_errors=True)  # a half-made one (an older tandem's race): replaced
    try:
        tmp.rename(src.hf_dir)
    except OSError:  # another process renamed its conversion into place first
        shutil.rmtree(tmp, ignore_errors=True)


def _ensure_gguf_float_weights(src: ModelSource) -> Path:
    """The GGUF dequantised to fp32 safetensors through transformers, once (slow: ~30-80 s)."""
    out = src.hf_dir / "model.safetensors"
    if out.is_file():
        return out
    from transformers import (
        AutoModelForCausalLM,  # lazy: transformers takes seconds to import
    )

    assert src.gguf_path is not None
    t0 = time.time()
    print(f"[tandem] converting {src.gguf_path.name} to a cached float copy (one time, about a minute)...", flush=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(src.gguf_path.parent), gguf_file=src.gguf_path.name, dtype=torch.float32
    )
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")  # one per process: runs started together
    save_safetensors(state, tmp)
    os.replace(tmp, out)
    print(f"[tandem] cached in {src.hf_dir} ({time.time() - t0:.0f} s)", flush=True)
    return out


def float_checkpoint(name: str) -> Path:
    """The HF directory of a model with float weights (a GGUF converted once), for libraries
    that load HF checkpoints themselves (the transformers backend of `tandem train`)."""
    src = resolve_model(name)
    if src.gguf_path is not None:
        _ensure_gguf_metadata(src)
        _ensure_gguf_float_weights(src)
    return src.hf_dir


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    path = hf_dir / "config.json"
    try:
        return json.loads(path.read_text())
    except (ValueError, OSError) as err:
        raise ModelNotFoundError(f"{path} cannot be read ({err}){_damaged_hint(hf_dir)}") from None


def _damaged_hint(hf_dir: Path) -> str:
    """What to do about a damaged file of a model directory: one tandem made can be made again."""
    if cache_root().resolve() in hf_dir.resolve().parents:
        return f"; it is tandem's conversion: delete {hf_dir} and it is made again"
    return ""


# Where a multimodal checkpoint (Gemma 3 4B and up) keeps its language model, by the transformers
# version that saved it; tandem runs the language model and leaves the vision tower unread.
LANGUAGE_MODEL_PREFIXES = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                           "model.language_model.": "model."}
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def language_model_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors under the names a text-only checkpoint gives them."""
    renamed = {}
    for name, t in tensors.items():
        for prefix, plain in LANGUAGE_MODEL_PREFIXES.items():
            if name.startswith(prefix):
                name = plain + name.removeprefix(prefix)
                break
        renamed[name] = t
    return renamed


class StateDictSource:
    """WeightSource over float tensors with HF names; linears built dense, int8 or int4. It
    remembers which tensors the model read, so that weights the model would silently leave out
    (a bias tandem's decoder does not apply) are refused, not ignored."""

    def __init__(self, tensors: dict[str, torch.Tensor], linear_mode: str, dtype: torch.dtype,
                 kernels: str = "torch") -> None:
        self.tensors = language_model_names(tensors)
        self.linear_mode = linear_mode
        self.dtype = dtype
        self.kernels = kernels
        self.read: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise KeyError(f"weight {name!r} missing from the checkpoint")
        self.read.add(name)
        return self.tensors[name].float()

    def unread(self, cfg: ModelConfig) -> list[str]:
        """The checkpoint's language-model tensors that building the model did not read."""
        def expected_unread(name: str) -> bool:
            return (name.startswith(VISION_PREFIXES) or "rotary_emb" in name
                    or (name == "lm_head.weight" and cfg.tie_word_embeddings))  # tied: the embedding is the head
        return sorted(n for n in self.tensors if n not in self.read and not expected_unread(n))

    def linear(self, names: list[str], bias: bool) -> nn.Module:
        weight = torch.cat([self.tensor(n) for n in names], dim=0)
        b = torch.cat([self.tensor(n.replace(".weight", ".bias")) for n in names]) if bias else None
        if self.linear_mode == "none":
            return DenseLinear(weight.to(self.dtype), None if b is None else b.to(self.dtype))
        return quantize_linear(weight, b, self.linear_mode, kernels=self.kernels)


def checkpoint_files(hf_dir: Path) -> list[Path]:
    """The model's weight files: those its shard index names, else `model.safetensors`, else every
    `.safetensors` file (a directory may hold others: a tandem draft_model's head file)."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            return sorted({hf_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (ValueError, OSError, KeyError, TypeError, AttributeError) as err:
            raise ModelNotFoundError(f"{index} cannot be read ({err!r}){_damaged_hint(hf_dir)}") from None
    if (hf_dir / "model.safetensors").is_file():
        return [hf_dir / "model.safetensors"]
    return sorted(hf_dir.glob("*.safetensors"))


def load_safetensors_dir(hf_dir: Path) -> dict[str, torch.Tensor]:
    files = checkpoint_files(hf_dir)
    if not files:
        raise ModelNotFoundError(f"no .safetensors weights in {hf_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except Exception as err:  # safetensors' own error type: a truncated or foreign file
            raise ModelNotFoundError(f"{f} cannot be read ({err}){_damaged_hint(hf_dir)}") from None
    return tensors


@dataclass
class LoadedModel:
    model: TransformerLM
    tokenizer: Any
    config: ModelConfig
    name: str
    dtype: torch.dtype
    quantization: str
    kernels: str = "torch"  # "block": tandem's block kernels (model/kernels); "torch": torch's own
    kv_cache_dtype: str = "auto"  # what the KV cache stores (model/kv_cache.kv_cache_dtype)

    def kv_dtype(self, device: str | torch.device = "cpu") -> torch.dtype:
        """The dtype KV caches for this model hold on `device`."""
        fused = self.kernels == "block" and fused_eligible(self.model)
        return kv_cache_dtype(self.dtype, device, self.kv_cache_dtype, fused)


def resolve_quantization(quantization: str, src: ModelSource, device: str) -> str:
    """'auto' = the GGUF's own blocks on CPU (fastest measured), dense otherwise."""
    if quantization == "auto":
        quantization = "native" if src.gguf_path is not None and device == "cpu" else "none"
    if quantization == "native" and src.gguf_path is None:
        raise ValueError(f"--quantization native needs a GGUF model; {src.name} is a float checkpoint (use int8/int4)")
    if quantization in ("native", "int8", "int4") and device == "cuda":
        log.warning("int4/int8 CPU kernels are not available on CUDA; running %s dense in bfloat16", src.name)
        quantization = "none"
    return quantization


def resolve_kernels(quantization: str, device: str = "cpu") -> str:
    """'block' (tandem's block kernels, fp32 activations) for quantized weights on a CPU that can
    build and run them, else 'torch' (torch's int4/int8 kernels with bf16 activations)."""
    if quantization == "none" or device != "cpu":
        return "torch"
    return "block" if block_kernels() is not None else "torch"


def resolve_dtype(dtype: str, quantization: str, device: str = "cpu") -> torch.dtype:
    """'auto': fp32 on CPU (dense weights: this CPU has no native bf16, and dense bf16 makes a
    multi-token verification several times a one-token one; quantized weights: tandem's block
    kernels take fp32), except bf16 where torch's int4/int8 kernels serve the quantized weights
    (they compute in bf16) and on CUDA."""
    if dtype == "auto":
        if device == "cuda":
            return torch.bfloat16
        if quantization == "none" or resolve_kernels(quantization, device) == "block":
            return torch.float32
        return torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def model_config(name: str) -> ModelConfig:
    """A model's ModelConfig (its shapes) from its config alone, without loading weights."""
    src = resolve_model(name)
    if src.gguf_path is not None:
        _ensure_gguf_metadata(src)
    return model_config_from_hf(read_hf_config(src.hf_dir))


def load_model(
    name: str,
    dtype: str = "auto",
    quantization: str = "auto",
    device: str = "cpu",
    kv_cache_dtype: str = "auto",
) -> LoadedModel:
    from transformers import AutoTokenizer  # lazy: transformers takes seconds to import

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch finds no CUDA GPU here ("
                         + ("this torch is built without CUDA" if not torch.backends.cuda.is_built()
                            else "no device is visible") + "); use --device cpu")

    src = resolve_model(name)
    if src.gguf_path is not None:
        _ensure_gguf_metadata(src)
    hf_cfg = read_hf_config(src.hf_dir)
    cfg = model_config_from_hf(hf_cfg)
    quant = resolve_quantization(quantization, src, device)
    torch_dtype = resolve_dtype(dtype, quant, device)
    # tandem's block kernels take fp32 activations; bf16 activations stay on torch's kernels.
    block = resolve_kernels(quant, device)
    kernels = block if torch_dtype == torch.float32 else "torch"
    if kernels == "torch" and block == "block" and device == "cpu":
        log.warning("%s with %s activations runs on torch's int kernels, not tandem's block kernels: many times "
                    "slower on a CPU (--dtype float32, the default here, uses the block kernels)", quant,
                    str(torch_dtype).removeprefix("torch."))
    if quant == "native":
        weights = GGUFSource(src.gguf_path, cfg, torch_dtype, kernels)
    else:
        if src.gguf_path is not None:
            _ensure_gguf_float_weights(src)
        weights = StateDictSource(load_safetensors_dir(src.hf_dir), quant, torch_dtype, kernels)
    model = build_model(cfg, weights, torch_dtype, desc=f"loading {src.name}")
    refuse_unread_weights(src.name, cfg, weights.unread(cfg))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(src.hf_dir))
    except (ValueError, OSError) as err:
        raise ModelNotFoundError(f"the tokenizer in {src.hf_dir} cannot be read ({str(err).splitlines()[0]})"
                                 f"{_damaged_hint(src.hf_dir)}") from None
    loaded = LoadedModel(model.to(device), tokenizer, cfg, src.name, torch_dtype, quant, kernels, kv_cache_dtype)
    loaded.kv_dtype(device)  # a bad kv_cache_dtype fails here, not at the first request
    return_freed_memory()
    return loaded


def return_freed_memory() -> None:
    """Hand the heap memory that loading freed (GGUF blocks read, dequantized and repacked: about
    160 MB for SmolLM2) back to the OS: glibc keeps freed heap pages resident until trimmed."""
    gc.collect()
    trim_heap()


def refuse_unread_weights(name: str, cfg: ModelConfig, unread: list[str]) -> None:
    """A checkpoint whose weights the decoder did not all read would run as another model: say so."""
    if unread:
        more = f" and {len(unread) - 4} more" if len(unread) > 4 else ""
        raise UnsupportedArchitectureError(
            f"{name} holds weights tandem's {cfg.model_type} decoder does not apply ({', '.join(unread[:4])}{more}); "
            "running without them would compute another model than the checkpoint's")


def build_model(cfg: ModelConfig, weights, dtype: torch.dtype, desc: str = "building model") -> TransformerLM:
    bar = partial(progress, desc=desc, unit="layer", leave=False)
    return TransformerLM(cfg, weights, dtype, progress=bar).eval()
