"""Weight-only quantized linear layers on torch's CPU int4/int8 kernels, a dense baseline, and
the one factory (`quantize_linear`) that picks a layer kind for a weight, tandem's block linears
(block_linear.py) included.

The three torch-kernel modules keep their tensors as buffers (so `.to()` and state_dict work), accept inputs
of shape [..., in_features] and preserve the leading shape. The quantized ones compute with bf16
activations, the dtype their CPU kernels are fast in, and return bf16.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from tandem.model.block_linear import BLOCK, BlockQ4Linear, BlockQ8Linear

INT4_GROUP_SIZES = (32, 64, 128, 256)
# torch's CPU int4 packing needs a multiple of 16 output rows; other counts are zero-padded.
_INT4_ROW_TILE = 16
# _weight_int8pack_mm with bf16 activations crashes or returns wrong sums unless its input width
# K is a multiple of 16 (torch 2.13 CPU, swept over K, N and rows): on AVX2, K % 8 != 0 gives ~10%
# error or a segfault; on AVX-512 (Zen 4, Sapphire Rapids) any K % 16 != 0 segfaults from 2 rows
# on and returns NaN or 10-20% error for one row. Int8Linear therefore stores its weight with zero
# columns up to a multiple of this and pads each input row the same way (exact: 0 * w adds 0).
_INT8_K_MULTIPLE = 32

_warned_fallback: set[str] = set()


def _warn_fallback_once(kind: str, device: torch.device) -> None:
    if kind not in _warned_fallback:
        _warned_fallback.add(kind)
        warnings.warn(
            f"{kind}: torch's weight-only kernels are CPU-only; on {device.type} every forward "
            "dequantises the weight to bf16 and runs F.linear (correct, not fast)",
            stacklevel=2,
        )


def _int4_block_rows() -> int:
    # Output rows per packing block in torch's CPU int4 kernel: 4 float vectors' worth.
    return 64 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 32


@functools.cache
def _int4_row_of_slot(block_rows: int) -> torch.Tensor:
    """Which row of a packing block each nibble slot (2 * byte + high) of one k-column holds.

    The in-block layout differs by CPU capability and block size (torch packs a full AVX2 block
    as rows d | d+16 per byte, a partial one as rows 2j | 2j+1), so it is measured, not assumed:
    pack a [block_rows, 2] probe whose column 0 holds row % 16 and column 1 holds row // 16.
    """
    row = torch.arange(block_rows, dtype=torch.int32)
    probe = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.stack([row % 16, row // 16], dim=1), 2
    ).reshape(2, block_rows // 2)  # [k, byte]
    nib = torch.stack([probe & 0xF, probe >> 4], dim=-1).reshape(2, block_rows).long()
    return nib[1] * 16 + nib[0]


def _unpack_int4_blocks(packed: torch.Tensor, block_rows: int, in_features: int) -> torch.Tensor:
    """Codes [rows, in] of packed rows that form whole blocks of `block_rows` rows each."""
    # A block of b rows is stored as in_features consecutive groups of b/2 bytes, one per k.
    by_k = packed.reshape(-1, in_features, block_rows // 2)
    slots = torch.stack([by_k & 0xF, by_k >> 4], dim=-1).reshape(-1, in_features, block_rows)
    slot_of_row = torch.argsort(_int4_row_of_slot(block_rows)).to(packed.device)
    return slots[..., slot_of_row].transpose(1, 2).reshape(-1, in_features)


def _as_rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    if x.shape[-1] != in_features:
        raise ValueError(f"expected last dim {in_features}, got input of shape {tuple(x.shape)}")
    return x.reshape(-1, in_features).to(torch.bfloat16).contiguous()


def _weight_only_forward(layer: nn.Module, x: torch.Tensor, device: torch.device, cpu_kernel) -> torch.Tensor:
    """[..., in] -> [..., out] in bf16 through a CPU kernel on 2-D rows; elsewhere (CUDA) the
    dequantised weight with F.linear, after a one-time warning."""
    lead = x.shape[:-1]
    x2 = _as_rows(x, layer.in_features)
    if device.type == "cpu":
        y = cpu_kernel(x2)
    else:
        _warn_fallback_once(type(layer).__name__, device)
        y = F.linear(x2, layer.dequantize(torch.bfloat16))
    if layer.bias is not None:
        y = y + layer.bias
    return y.reshape(*lead, layer.out_features)


class Int4Linear(nn.Module):
    """y = x W^T + b with W stored as 4-bit codes, one bf16 scale and zero per group of inputs.

    Dequantisation (torch's convention): w = (q - 8) * scale + zero, q in 0..15, per output row
    and per `group_size` consecutive input columns. Buffers:
      packed            uint8 [rows, in/2] in torch's CPU layout, which depends on the CPU's
                        vector width: a state_dict moves only between machines with the same
                        `torch.backends.cpu.get_cpu_capability()` family (AVX512 or not).
      scales_and_zeros  bf16 [in/group_size, rows, 2]; [..., 0] = scale, [..., 1] = zero.
    rows = out_features rounded up to a multiple of 16; padded rows are zero and sliced off.
    """

    def __init__(self, in_features: int, out_features: int, group_size: int = 32,
                 bias: bool = False) -> None:
        super().__init__()
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        if in_features % group_size:
            raise ValueError(f"in_features {in_features} is not a multiple of group {group_size}")
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        rows = -(-out_features // _INT4_ROW_TILE) * _INT4_ROW_TILE
        self.register_buffer("packed", torch.zeros(rows, in_features // 2, dtype=torch.uint8))
        self.register_buffer(
            "scales_and_zeros",
            torch.zeros(in_features // group_size, rows, 2, dtype=torch.bfloat16),
        )
        self.register_buffer(
            "bias", torch.zeros(out_features, dtype=torch.bfloat16) if bias else None
        )

    @classmethod
    def _from_codes(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    bias: torch.Tensor | None) -> Int4Linear:
        """q [out, in] in 0..15; scale/zero [out, groups] in torch's (q - 8) convention."""
        out_features, in_features = q.shape
        groups = scale.shape[1]
        if scale.shape != (out_features, groups) or zero.shape != scale.shape or groups == 0:
            raise ValueError(f"scale/zero {tuple(scale.shape)}/{tuple(zero.shape)} do not match "
                             f"codes {tuple(q.shape)}")
        if in_features % groups:
            raise ValueError(f"{groups} groups do not divide in_features {in_features}")
        mod = cls(in_features, out_features, in_features // groups, bias is not None)
        rows = mod.packed.shape[0]
        pad = rows - out_features
        codes = F.pad(q.to(torch.int32), (0, 0, 0, pad))
        if codes.min() < 0 or codes.max() > 15:
            raise ValueError("int4 codes must lie in 0..15")
        mod.packed.copy_(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.cpu(), 2))
        sz = torch.stack([scale.float(), zero.float()], dim=-1)  # [out, groups, 2]
        mod.scales_and_zeros.copy_(F.pad(sz, (0, 0, 0, 0, 0, pad)).transpose(0, 1))
        if bias is not None:
            mod.bias.copy_(bias)
        return mod

    @classmethod
    def from_affine_groups(cls, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                           bias: torch.Tensor | None = None) -> Int4Linear:
        """Build from w = q * scale + offset (GGML's Q4_1 / Q4_K convention).

        q: uint8 [out, in] in 0..15; scale, offset: float [out, in / group]. Since
        q * s + m = (q - 8) * s + (m + 8 s), torch's zero is offset + 8 * scale; scale and zero
        are then rounded to bf16, the kernel's only precision for them.
        """
        scale = scale.float()
        return cls._from_codes(q, scale, offset.float() + 8.0 * scale, bias)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 group_size: int = 32) -> Int4Linear:
        """Round-to-nearest min/max affine quantisation of each group of `group_size` inputs."""
        out_features, in_features = weight.shape
        if group_size not in INT4_GROUP_SIZES or in_features % group_size:
            raise ValueError(f"cannot split in_features {in_features} into groups of {group_size}")
        g = weight.detach().float().reshape(out_features, -1, group_size)
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        # A constant group has max == min; any positive scale then encodes it exactly.
        scale = torch.where(hi > lo, (hi - lo) / 15.0, torch.ones_like(lo))
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15)
        return cls.from_affine_groups(q.reshape(out_features, in_features).to(torch.uint8),
                                      scale, lo, bias)

    def codes(self) -> torch.Tensor:
        """Unpack the 4-bit codes to uint8 [out, in] (inverse of torch's CPU packing)."""
        rows = self.packed.shape[0]
        block = _int4_block_rows()
        full = rows // block * block
        parts = [_unpack_int4_blocks(self.packed[:full], block, self.in_features)] if full else []
        if rows > full:
            parts.append(_unpack_int4_blocks(self.packed[full:], rows - full, self.in_features))
        return torch.cat(parts)[: self.out_features]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in] this layer multiplies by, computed in fp32."""
        n = self.out_features
        scale = self.scales_and_zeros[:, :n, 0].t().float().repeat_interleave(self.group_size, 1)
        zero = self.scales_and_zeros[:, :n, 1].t().float().repeat_interleave(self.group_size, 1)
        return ((self.codes().float() - 8.0) * scale + zero).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _weight_only_forward(self, x, self.packed.device, lambda x2: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2, self.packed, self.group_size, self.scales_and_zeros)[:, : self.out_features])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")


class Int8Linear(nn.Module):
    """y = x W^T + b with W = weight_int8 * scales[:, None] (symmetric, one scale per output row).

    Buffers: weight int8 [out, K] with K = in_features rounded up to a multiple of
    _INT8_K_MULTIPLE (the extra columns are zero; torch's kernel mishandles other widths), scales
    bf16 [out], bias bf16 [out] or None.
    """

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None, in_features: int | None = None) -> None:
        super().__init__()
        out_features, width = weight_int8.shape
        if weight_int8.dtype != torch.int8:
            raise TypeError(f"weight must be int8, got {weight_int8.dtype}")
        in_features = width if in_features is None else in_features
        if not 0 < in_features <= width or width - in_features >= _INT8_K_MULTIPLE:
            raise ValueError(f"in_features {in_features} does not match a weight of width {width}")
        if scales.shape != (out_features,):
            raise ValueError(f"scales must have shape ({out_features},), got {tuple(scales.shape)}")
        if bool(weight_int8[:, in_features:].any()):
            raise ValueError("the weight's padding columns past in_features must be zero")
        self.in_features = in_features
        self.out_features = out_features
        padded = -(-in_features // _INT8_K_MULTIPLE) * _INT8_K_MULTIPLE
        self.register_buffer("weight", F.pad(weight_int8[:, :in_features], (0, padded - in_features)).contiguous())
        self.register_buffer("scales", scales.to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(torch.bfloat16))

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        w = weight.detach().float()
        amax = w.abs().amax(dim=1)
        # Round the scale to bf16 first so the codes are chosen for the scale the kernel uses.
        scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).to(torch.bfloat16)
        q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scales, bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight[:, : self.in_features].float() * self.scales.float()[:, None]).to(dtype)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        pad = self.weight.shape[1] - self.in_features
        if pad:
            x2 = F.pad(x2, (0, pad))
        return torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _weight_only_forward(self, x, self.weight.device, self._matmul)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class DenseLinear(nn.Module):
    """Plain F.linear; the input is cast to the weight's dtype, which is also the output's."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        dtype = dtype or weight.dtype
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach().to(dtype).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"dtype={self.weight.dtype}, bias={self.bias is not None}")


KERNELS = ("torch", "block")


QUANT_MODES = ("none", "int8", "int4")


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None, mode: str,
                    group_size: int = 32, kernels: str = "torch") -> nn.Module:
    """A linear layer for `weight` [out, in]: "none" keeps its dtype; with torch's kernels "int8"
    is per-channel and "int4" min/max affine with `group_size` inputs per group (a layer whose
    inputs do not split into such groups gets int8, with a warning); with tandem's
    block kernels both quantize blocks of 32 inputs (layers whose inputs do not split into blocks
    keep torch's kernels)."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    if mode == "none":
        return DenseLinear(weight, bias)
    if kernels == "block" and weight.shape[1] % BLOCK == 0 and mode in ("int8", "int4"):
        return (BlockQ8Linear if mode == "int8" else BlockQ4Linear).quantize(weight, bias)
    if mode == "int8":
        return Int8Linear.quantize(weight, bias)
    if mode == "int4":
        if weight.shape[1] % group_size:
            # torch's int4 kernel needs whole groups; a zero-padded int8 layer is exact instead.
            if "int4-width" not in _warned_fallback:
                _warned_fallback.add("int4-width")
                warnings.warn(f"int4: a layer with {weight.shape[1]} inputs does not split into groups of "
                              f"{group_size}; such layers use int8 weights", stacklevel=2)
            return Int8Linear.quantize(weight, bias)
        return Int4Linear.quantize(weight, bias, group_size)
    raise ValueError(f"mode must be one of {QUANT_MODES}, got {mode!r}")


def _cat_bias(mods: list[nn.Module], dtype: torch.dtype) -> torch.Tensor | None:
    present = [m.bias for m in mods if m.bias is not None]
    if not present:
        return None
    return torch.cat([
        m.bias if m.bias is not None
        else torch.zeros(m.out_features, dtype=dtype, device=present[0].device)
        for m in mods
    ])


def concat_out_features(mods: list[nn.Module]) -> nn.Module:
    """Fuse linears of one kind and input size along the output dim (q/k/v, gate/up).

    Exact: the fused layer's output is the concatenation of the parts' outputs, because int4
    groups and int8 scales belong to single output rows.
    """
    if not mods:
        raise ValueError("nothing to concatenate")
    kind = type(mods[0])
    if any(type(m) is not kind for m in mods):
        raise TypeError(f"cannot fuse different layer types {[type(m).__name__ for m in mods]}")
    if len({m.in_features for m in mods}) != 1:
        raise ValueError(f"in_features differ: {[m.in_features for m in mods]}")
    if kind is DenseLinear:
        if len({m.weight.dtype for m in mods}) != 1:
            raise ValueError("DenseLinear parts have different dtypes")
        return DenseLinear(torch.cat([m.weight for m in mods]),
                           _cat_bias(mods, mods[0].weight.dtype))
    if kind is Int8Linear:
        return Int8Linear(torch.cat([m.weight for m in mods]), torch.cat([m.scales for m in mods]),
                          _cat_bias(mods, torch.bfloat16), mods[0].in_features)
    if kind is Int4Linear:
        if len({m.group_size for m in mods}) != 1:
            raise ValueError(f"group sizes differ: {[m.group_size for m in mods]}")
        # Unpack and repack rather than cat `packed`: parts may carry padding rows, and the
        # packed layout depends on where rows fall in torch's 32/64-row blocks.
        sz = torch.cat([m.scales_and_zeros[:, : m.out_features] for m in mods], dim=1)
        return Int4Linear._from_codes(torch.cat([m.codes() for m in mods]),
                                      sz[..., 0].t(), sz[..., 1].t(),
                                      _cat_bias(mods, torch.bfloat16))
    raise TypeError(f"cannot fuse {kind.__name__}")
