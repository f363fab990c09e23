"""WeightSource over a GGUF file's own blocks: the shipped 4-bit weights run as they are shipped.

Maps Hugging Face parameter names (what the lean decoder asks for) to GGUF tensor names, undoes
llama.cpp's Q/K row permutation and Gemma's stored +1 on norm weights, and fuses q/k/v and
gate/up on the raw int4 groups (exact: groups run along a row's inputs).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from tandem.model.arch import ModelConfig
from tandem.model.gguf_native import GGUFTensor, concat_records, read_gguf, to_linear, unpermute_llama_qk

_COMMON = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LLAMA_NORMS = {"post_attention_layernorm": "ffn_norm"}
_GEMMA_NORMS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$")

# Dense tensors used as linears (Q8_0/Q6_K LM heads and embeddings, Q5_K/Q6_K layers) are
# re-quantised to int8: blocks of 32 on tandem's kernels, per output channel on torch's
# (measured fastest of torch's choices for the LM-head shapes at 1-8 rows).
DENSE_LINEAR_MODE = "int8"


class GGUFSource:
    def __init__(self, path, cfg: ModelConfig, dtype: torch.dtype, kernels: str = "torch") -> None:
        metadata, self.records = read_gguf(path)
        self.kernels = kernels
        self.arch = str(metadata.get("general.architecture", ""))
        self.cfg = cfg
        self.dtype = dtype
        self.layer_names = {**_COMMON, **(_GEMMA_NORMS if cfg.model_type.startswith("gemma3") else _LLAMA_NORMS)}
        self.read: set[str] = set()

    def gguf_name(self, hf_name: str) -> str:
        m = _LAYER.match(hf_name)
        if m:
            layer, part, kind = m.groups()
            if part not in self.layer_names:
                raise KeyError(f"no GGUF tensor known for {hf_name}")
            return f"blk.{layer}.{self.layer_names[part]}.{kind}"
        stem, _, kind = hf_name.rpartition(".")
        if stem not in _TOP:
            raise KeyError(f"no GGUF tensor known for {hf_name}")
        return f"{_TOP[stem]}.{kind}"

    def has(self, name: str) -> bool:
        return self.gguf_name(name) in self.records

    def _record(self, hf_name: str) -> GGUFTensor:
        name = self.gguf_name(hf_name)
        if name not in self.records:
            raise KeyError(f"{name} (for {hf_name}) missing from the GGUF file")
        record = self.records[name]
        self.read.add(name)
        # llama.cpp permutes Q/K rows of llama-architecture models for its interleaved RoPE.
        if self.arch in ("llama", "mistral"):
            if hf_name.endswith("self_attn.q_proj.weight"):
                record = unpermute_llama_qk(record, self.cfg.num_heads)
            elif hf_name.endswith("self_attn.k_proj.weight"):
                record = unpermute_llama_qk(record, self.cfg.num_kv_heads)
        return record

    def unread(self, cfg: ModelConfig) -> list[str]:
        """The file's tensors that building the model did not read (llama.cpp's `rope_freqs`, the
        Llama 3 scaling tandem computes from the config, aside)."""
        return sorted(n for n in self.records if n not in self.read and n != "rope_freqs.weight")

    def tensor(self, name: str) -> torch.Tensor:
        values = self._record(name).dequantize().float()
        if self.cfg.norm_offset and name.endswith("norm.weight"):
            # llama.cpp's converter stores Gemma norms as (1 + w); the decoder adds the 1 itself.
            values = values - self.cfg.norm_offset
        return values

    def linear(self, names: list[str], bias: bool) -> nn.Module:
        record = concat_records([self._record(n) for n in names]) if len(names) > 1 else self._record(names[0])
        b = torch.cat([self.tensor(n.replace(".weight", ".bias")) for n in names]) if bias else None
        return to_linear(record, self.dtype, dense_mode=DENSE_LINEAR_MODE, bias=b, kernels=self.kernels)
