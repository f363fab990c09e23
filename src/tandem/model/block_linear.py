"""Linear layers in GGUF-style blocks of 32 inputs (Q4_1 and Q8_0), run on tandem's block kernels.

Each stores the GGUF's codes and scales as buffers (state_dict and `.to()` work) and keeps the
layout the running kernel variant reads beside the module, packed on first use (`blocks`). Inputs
[..., in_features] of any float dtype; outputs float32. Off the CPU, or without the compiled
kernels, a forward dequantises the weight and runs F.linear.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from tandem.model.kernels import BlockKernels, BlockWeights, block_kernels

_warned: set[str] = set()

BLOCK = 32


def _packed(layer: nn.Module, kernels: BlockKernels, m: torch.Tensor | None) -> BlockWeights:
    # Kept beside the module, not as buffers: the packed layout belongs to one kernel variant
    # and is rebuilt from qs/d/m (the state) wherever the module goes.
    # Repacked when the kernels or the weights change (a new tensor, or one written in place).
    source = (kernels, layer.qs.data_ptr(), layer.qs._version, layer.d._version)
    cached = layer.__dict__.get("_blocks")
    if cached is None or cached[0] != source:
        cached = (source, kernels.pack(layer.qs, layer.d, m, layer.bias))
        layer.__dict__["_blocks"] = cached
    return cached[1]


def _block_forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """[..., in] -> [..., out] float32 through tandem's block kernel (CPU) or, elsewhere or
    without the compiled kernel, the dequantised weight with F.linear."""
    lead = x.shape[:-1]
    if x.shape[-1] != layer.in_features:
        raise ValueError(f"expected last dim {layer.in_features}, got input of shape {tuple(x.shape)}")
    x2 = x.reshape(-1, layer.in_features).float().contiguous()
    kernels = block_kernels() if x2.device.type == "cpu" else None
    if kernels is not None:
        y = kernels.linear(x2, layer.blocks(kernels))  # the packed weights carry the bias
    else:
        if x2.device.type != "cpu" and type(layer).__name__ not in _warned:
            _warned.add(type(layer).__name__)
            warnings.warn(f"{type(layer).__name__}: tandem's block kernels are CPU-only; on {x2.device.type} every "
                          "forward dequantises the weight and runs F.linear (correct, not fast)", stacklevel=2)
        y = F.linear(x2, layer.dequantize(torch.float32), layer.bias)
    return y.reshape(*lead, layer.out_features)


def _weight_blocks(weight: torch.Tensor) -> torch.Tensor:
    """A float weight [out, in] as float32 blocks [out, in/32, 32] of consecutive inputs."""
    out_features, in_features = weight.shape
    if in_features % BLOCK:
        raise ValueError(f"in_features {in_features} is not a multiple of {BLOCK}")
    return weight.detach().float().reshape(out_features, -1, BLOCK)


def fp16_scales(scales: torch.Tensor) -> torch.Tensor:
    """Block scales rounded to fp16 (kept as float32 tensors): the block kernels read them as
    fp16, as GGUF stores them, so GGUF weights lose nothing and a step reads the GGUF's bytes."""
    half = scales.detach().float().half()
    if not torch.isfinite(half).all():
        raise ValueError(f"block scales up to {scales.abs().max().item():.3g} do not fit fp16 (max 65504)")
    return half.float().contiguous()


class BlockQ4Linear(nn.Module):
    """y = x W^T + b with W in 4-bit blocks of 32 inputs: w = d * q + m, q in 0..15 (GGUF Q4_1).

    Runs on tandem's block kernels (model/kernels), which quantizes each activation row to int8
    blocks of 32 and multiplies in integers, as llama.cpp does. Buffers: qs uint8 [out, in/2]
    (byte j of a block holds q_j low and q_{j+16} high), d and m [out, in/32] (fp16 values held
    as float32). Takes any
    float input, returns float32.
    """

    def __init__(self, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        out_features, half = qs.shape
        if qs.dtype != torch.uint8 or d.shape != (out_features, 2 * half // BLOCK) or m.shape != d.shape:
            raise ValueError(f"q4 blocks {tuple(qs.shape)} {qs.dtype} do not match scales {tuple(d.shape)}/{tuple(m.shape)}")
        self.in_features, self.out_features = 2 * half, out_features
        self.register_buffer("qs", qs.contiguous())
        self.register_buffer("d", fp16_scales(d))
        self.register_buffer("m", fp16_scales(m))
        self.register_buffer("bias", None if bias is None else bias.float())

    @classmethod
    def from_affine_groups(cls, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                           bias: torch.Tensor | None = None) -> BlockQ4Linear:
        """w = q * scale + offset with q uint8 [out, in] in 0..15 and scale/offset per group of
        inputs (a group of 32 or a multiple of 32, which is split into blocks)."""
        out_features, in_features = q.shape
        if in_features % BLOCK or in_features % scale.shape[1] or (in_features // scale.shape[1]) % BLOCK:
            raise ValueError(f"in_features {in_features} with {scale.shape[1]} groups does not split into blocks of {BLOCK}")
        repeat = in_features // scale.shape[1] // BLOCK
        blocks = q.reshape(out_features, -1, BLOCK).to(torch.uint8)
        qs = (blocks[..., :16] | (blocks[..., 16:] << 4)).reshape(out_features, in_features // 2)
        return cls(qs, scale.float().repeat_interleave(repeat, 1), offset.float().repeat_interleave(repeat, 1), bias)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> BlockQ4Linear:
        """Round-to-nearest min/max affine quantisation of each block of 32 inputs."""
        out_features, in_features = weight.shape
        g = _weight_blocks(weight)
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        scale = fp16_scales(torch.where(hi > lo, (hi - lo) / 15.0, torch.ones_like(lo)))
        lo = fp16_scales(lo)
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15)
        return cls.from_affine_groups(q.reshape(out_features, in_features).to(torch.uint8), scale, lo, bias)

    def codes(self) -> torch.Tensor:
        """The 4-bit codes as uint8 [out, in]."""
        b = self.qs.reshape(self.out_features, -1, BLOCK // 2)
        return torch.cat([b & 0xF, b >> 4], dim=-1).reshape(self.out_features, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = self.codes().float().reshape(self.out_features, -1, BLOCK)
        return (q * self.d[..., None] + self.m[..., None]).reshape(self.out_features, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _block_forward(self, x)

    def blocks(self, kernels: BlockKernels) -> BlockWeights:
        """The weights as `kernels` reads them, packed on first use (bias included)."""
        return _packed(self, kernels, self.m)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class BlockQ8Linear(nn.Module):
    """y = x W^T + b with W in 8-bit blocks of 32 inputs: w = d * q, q in -127..127 (GGUF Q8_0).

    Runs on tandem's block kernels like BlockQ4Linear. Buffers: qs int8 [out, in], d [out,
    in/32] (fp16 values held as float32). Takes any float input, returns float32.
    """

    def __init__(self, qs: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        out_features, in_features = qs.shape
        if qs.dtype != torch.int8 or in_features % BLOCK or d.shape != (out_features, in_features // BLOCK):
            raise ValueError(f"q8 blocks {tuple(qs.shape)} {qs.dtype} do not match scales {tuple(d.shape)}")
        self.in_features, self.out_features = in_features, out_features
        # -128 has no positive twin: the kernel's sign trick needs codes in -127..127.
        self.register_buffer("qs", qs.clamp(-127, 127).contiguous())
        self.register_buffer("d", fp16_scales(d))
        self.register_buffer("bias", None if bias is None else bias.float())

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> BlockQ8Linear:
        """Symmetric round-to-nearest quantisation of each block of 32 inputs (scale = max|w| / 127)."""
        out_features, in_features = weight.shape
        g = _weight_blocks(weight)
        amax = g.abs().amax(dim=-1)
        d = fp16_scales(torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)))
        q = torch.round(g / d[..., None]).clamp_(-127, 127).to(torch.int8)
        return cls(q.reshape(out_features, in_features), d, bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = self.qs.float().reshape(self.out_features, -1, BLOCK)
        return (q * self.d[..., None]).reshape(self.out_features, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _block_forward(self, x)

    def blocks(self, kernels: BlockKernels) -> BlockWeights:
        """The weights as `kernels` reads them, packed on first use (bias included)."""
        return _packed(self, kernels, None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
