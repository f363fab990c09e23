"""Architecture registry: Hugging Face config -> one flat ModelConfig for the lean decoder.

Each supported `model_type` maps to a small function that reads its config; the decoder itself
(transformer.py) is shared, so adding a Llama-like architecture is one function and one entry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable


class UnsupportedArchitectureError(ValueError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    """Everything the lean decoder needs, whatever the source architecture.

    layer_windows[i]: sliding-window size of layer i (None = full attention); a key at position
    pk is visible to a query at pq when pq - pk < window. layer_rope[i]: index into rope_tables.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_tables: tuple[tuple[float, Any], ...]  # (theta, scaling dict or None) per distinct rope
    layer_rope: tuple[int, ...]
    layer_windows: tuple[int | None, ...]
    max_position_embeddings: int
    attn_scale: float
    activation: str = "silu"  # "silu" or "gelu_tanh"
    qkv_bias: bool = False
    o_bias: bool = False  # Llama's / Qwen3's attention_bias also biases o_proj (Qwen2's qkv bias does not)
    mlp_bias: bool = False  # Llama's mlp_bias: gate, up and down projections
    qk_norm: bool = False
    norm_offset: float = 0.0  # Gemma RMSNorm multiplies by (1 + w)
    sandwich_norms: bool = False  # Gemma: extra norms after attention and after the MLP
    embed_scale: float | None = None  # Gemma scales embeddings by sqrt(hidden)
    tie_word_embeddings: bool = True
    final_logit_softcap: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()


def _eos_ids(cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _rope(cfg: dict, key: str | None = None) -> tuple[float, Any]:
    """(theta, scaling) from either transformers 5 `rope_parameters` or the older flat fields."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and key is not None and key in params:
        params = params[key]
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = params if params.get("rope_type", "default") != "default" else None
        return float(params["rope_theta"]), scaling
    scaling = cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(cfg.get("rope_theta", 10000.0)), scaling


def _llama_family(cfg: dict) -> ModelConfig:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    n = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    layer_types = cfg.get("layer_types")
    if layer_types:
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    else:
        windows = (window if cfg["model_type"] == "mistral" else None,) * n
    model_type = cfg["model_type"]
    return ModelConfig(
        model_type=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=n,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_tables=(_rope(cfg),),
        layer_rope=(0,) * n,
        layer_windows=windows,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        attn_scale=head_dim**-0.5,
        activation="silu",
        qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        o_bias=model_type != "qwen2" and bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg),
    )


def _gemma3(cfg: dict) -> ModelConfig:
    if "text_config" in cfg:  # multimodal wrapper: the language model is what we run
        cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
    n = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % cfg.get("sliding_window_pattern", 6) == 0 else "sliding_attention"
        for i in range(n)
    ]
    if "rope_parameters" in cfg:
        local, glob = _rope(cfg, "sliding_attention"), _rope(cfg, "full_attention")
    else:
        local = (float(cfg.get("rope_local_base_freq", 10000.0)), None)
        glob = _rope(cfg)
    head_dim = cfg.get("head_dim", 256)
    return ModelConfig(
        model_type="gemma3_text",
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=n,
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"],
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_tables=(local, glob),
        layer_rope=tuple(0 if t == "sliding_attention" else 1 for t in layer_types),
        layer_windows=tuple(cfg.get("sliding_window") if t == "sliding_attention" else None for t in layer_types),
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        attn_scale=cfg.get("query_pre_attn_scalar", head_dim) ** -0.5,
        activation="gelu_tanh",
        qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=True,
        norm_offset=1.0,
        sandwich_norms=True,
        embed_scale=math.sqrt(cfg["hidden_size"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        final_logit_softcap=cfg.get("final_logit_softcapping"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg),
    )


ARCHITECTURES: dict[str, Callable[[dict], ModelConfig]] = {
    "llama": _llama_family,
    "mistral": _llama_family,
    "qwen2": _llama_family,
    "qwen3": _llama_family,
    "gemma3_text": _gemma3,
    "gemma3": _gemma3,
}


def model_config_from_hf(cfg: dict) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"architecture {model_type!r} is not supported; tandem runs: {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[model_type](cfg)
