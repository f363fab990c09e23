"""Read GGUF tensors into records; Q4_0/Q4_1/Q4_K stay as 4-bit (code, scale, offset) groups.

Other formats are decoded to fp32 by vectorised numpy, bit-exact with `gguf.quants.dequantize`.
Values are the file's own: Gemma norms keep llama.cpp's +1, llama Q/K rows keep its RoPE order.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, ReaderTensor
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES
from torch import nn

from tandem.model.block_linear import BLOCK, BlockQ4Linear
from tandem.model.quant import DenseLinear, Int4Linear, quantize_linear

INT4_GROUP = 32


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file, in torch's dimension order ([out, in] for matrices).

    kind "int4_affine": w = q * scale + offset with q uint8 [out, in] in 0..15 and scale, offset
    fp32 [out, in / 32] (one pair per 32 consecutive inputs of a row).
    kind "dense": `values` holds the fp32 tensor.
    ggml_type names the source format(s), e.g. "Q4_K" or "Q5_0+Q8_0" after a concat.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: str
    kind: str
    q: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        """The fp32 tensor this record stands for (a dense record's own `values`, not a copy)."""
        if self.kind == "dense":
            return self.values
        rows, cols = self.shape
        w = self.q.float().view(rows, -1, INT4_GROUP) * self.scale[..., None]
        return (w + self.offset[..., None]).view(rows, cols)


# --- block decoders: raw blocks [n, type_size] uint8 -> values -------------------------------

def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of each block, as fp32 [n, 1]."""
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes per block -> 32 codes: low nibbles are elements 0-15, high ones 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """4 little-endian bytes per block -> bit j of the uint32 for each element j (0/1, uint8)."""
    word = np.ascontiguousarray(qh).view("<u4")  # [n, 1]
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins per super-block.

    Sub-blocks 0-3 keep scale and min in the low 6 bits of bytes 0-3 and 4-7; sub-blocks 4-7
    keep their low 4 bits in the nibbles of bytes 8-11 and their top 2 bits in the top bits of
    bytes 0-3 (scales) and 4-7 (mins).
    """
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 8 sub-blocks of 32 codes: each 32-byte run holds sub-block 2i in its low
    nibbles and 2i+1 in its high ones."""
    runs = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([runs & 0x0F, runs >> 4], axis=2).reshape(-1, 8, 32)


# (q [groups, 32] uint8 codes 0..15, scale [groups, 1], offset [groups, 1]), w = q * scale + offset
Affine = tuple[np.ndarray, np.ndarray, np.ndarray]


def _affine_q4_0(b: np.ndarray) -> Affine:
    d = _f16(b, 0)
    return _nibbles(b[:, 2:18]), d, -8.0 * d


def _affine_q4_1(b: np.ndarray) -> Affine:
    return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _affine_q4_k(b: np.ndarray) -> Affine:
    sc, mn = _k_scales_mins(b[:, 4:16])
    scale = _f16(b, 0) * sc
    offset = -(_f16(b, 2) * mn)
    return _k_low_nibbles(b[:, 16:144]).reshape(-1, 32), scale.reshape(-1, 1), offset.reshape(-1, 1)


_AFFINE_DECODERS = {QT.Q4_0: _affine_q4_0, QT.Q4_1: _affine_q4_1, QT.Q4_K: _affine_q4_k}


# Products are formed as np.multiply(ints, floats, dtype=np.float32): converting inside the ufunc
# is ~10x faster than materialising an fp32 copy of the codes first (measured on a 671 MB
# embedding), and every product here is exact in fp32, so the result is the same.

def _dense_q5_0(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 6:22]) | (_bits32(b[:, 2:6]) << 4)
    return np.multiply(q.view(np.int8) - np.int8(16), _f16(b, 0), dtype=np.float32)


def _dense_q5_1(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 8:24]) | (_bits32(b[:, 4:8]) << 4)
    return np.multiply(q, _f16(b, 0), dtype=np.float32) + _f16(b, 2)


def _dense_q8_0(b: np.ndarray) -> np.ndarray:
    return np.multiply(b.view(np.int8)[:, 2:34], _f16(b, 0), dtype=np.float32)


def _dense_q5_k(b: np.ndarray) -> np.ndarray:
    sc, mn = _k_scales_mins(b[:, 4:16])
    # Bit j of byte l of qh is the fifth bit of element l of sub-block j.
    high = (b[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q = _k_low_nibbles(b[:, 48:176]) | (high << 4)
    scale = (_f16(b, 0) * sc)[..., None]
    offset = (_f16(b, 2) * mn)[..., None]
    return (np.multiply(q, scale, dtype=np.float32) - offset).reshape(-1, 256)


def _dense_q6_k(b: np.ndarray) -> np.ndarray:
    # Each half of 128 elements: ql's 64 bytes give the low 4 bits (low nibbles of the two
    # 32-byte runs for elements 0-63, high nibbles for 64-127); qh's 32 bytes give the top 2
    # bits, element runs 0/32/64/96 taking bit pairs 0-1/2-3/4-5/6-7.
    ql = b[:, 0:128].reshape(-1, 2, 2, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # [n, half, run, 32]
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
    q = (low | (high << 4)).view(np.int8).reshape(-1, 16, 16) - np.int8(32)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)  # one per 16
    return np.multiply(q, (_f16(b, 208) * sc)[..., None], dtype=np.float32).reshape(-1, 256)


def _dense_bf16(b: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(b).view("<u2").astype(np.uint32) << 16).view(np.float32)


def _dense_f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _dense_f32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float32).copy()


_DENSE_DECODERS = {
    QT.Q5_0: _dense_q5_0, QT.Q5_1: _dense_q5_1, QT.Q8_0: _dense_q8_0, QT.Q5_K: _dense_q5_k,
    QT.Q6_K: _dense_q6_k, QT.BF16: _dense_bf16, QT.F16: _dense_f16, QT.F32: _dense_f32,
}


def _blocks(data: np.ndarray, qtype: QT) -> np.ndarray:
    _, type_size = GGML_QUANT_SIZES[qtype]
    return np.ascontiguousarray(data).view(np.uint8).reshape(-1, type_size)


def decode_affine(data: np.ndarray, qtype: QT, shape: tuple[int, int]):
    """Raw data of a Q4_0/Q4_1/Q4_K matrix -> (q uint8 [out, in], scale, offset fp32
    [out, in / 32]) as torch tensors, with w = q * scale + offset."""
    q, scale, offset = _AFFINE_DECODERS[qtype](_blocks(data, qtype))
    rows, cols = shape
    return (torch.from_numpy(q).reshape(rows, cols),
            torch.from_numpy(scale).reshape(rows, cols // INT4_GROUP),
            torch.from_numpy(offset).reshape(rows, cols // INT4_GROUP))


def dequantize(data: np.ndarray, qtype: QT, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw data of any GGUF tensor -> fp32 torch tensor of `shape` (torch order).

    Types without a decoder here (e.g. Q2_K, IQ*) go through gguf's reference dequantiser.
    """
    if qtype in _AFFINE_DECODERS:
        q, scale, offset = _AFFINE_DECODERS[qtype](_blocks(data, qtype))
        values = np.multiply(q, scale, dtype=np.float32) + offset
    elif qtype in _DENSE_DECODERS:
        values = _DENSE_DECODERS[qtype](_blocks(data, qtype))
    else:
        values = gguf_quants.dequantize(np.asarray(data), qtype).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(shape)


def decode_tensor(t: "ReaderTensor | IndexedTensor") -> GGUFTensor:
    """A GGUFReader tensor -> record (4-bit formats kept as groups when the tensor is 2-D)."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    qtype = t.tensor_type
    if qtype in _AFFINE_DECODERS and len(shape) == 2:
        q, scale, offset = decode_affine(t.data, qtype, shape)
        return GGUFTensor(t.name, shape, qtype.name, "int4_affine", q=q, scale=scale,
                          offset=offset)
    return GGUFTensor(t.name, shape, qtype.name, "dense", values=dequantize(t.data, qtype, shape))


def read_gguf(source: str | os.PathLike | GGUFReader, names: Iterable[str] | None = None
              ) -> tuple[dict[str, object], dict[str, GGUFTensor]]:
    """(metadata, {GGUF tensor name: record}) of a GGUF file; `names` limits what is decoded.

    metadata maps each key (e.g. "llama.attention.head_count") to its Python value; read from a
    path, array-valued keys (the vocabulary) are skipped (see index_gguf). `source` may also be
    an open GGUFReader, which keeps every key.
    """
    if isinstance(source, GGUFReader):
        metadata = {key: field.contents() for key, field in source.fields.items()}
        index, where = source.tensors, source.data.filename
    else:
        metadata, index = index_gguf(source)
        where = source
    wanted = None if names is None else set(names)
    tensors = {t.name: decode_tensor(t) for t in index if wanted is None or t.name in wanted}
    if wanted is not None and wanted - tensors.keys():
        raise KeyError(f"not in {where}: {sorted(wanted - tensors.keys())}")
    return metadata, tensors


# --- record transforms ------------------------------------------------------------------------

def concat_records(records: list[GGUFTensor], name: str | None = None) -> GGUFTensor:
    """Stack matrices along dim 0 (output rows), e.g. q/k/v into one fused qkv.

    All int4 records stay int4 (groups belong to single rows, so this is exact); if any record
    is dense, the result is dense fp32 (the int4 parts dequantised exactly).
    """
    if len({r.shape[1:] for r in records}) != 1:
        raise ValueError(f"cannot stack shapes {[r.shape for r in records]}")
    name = name or "+".join(r.name for r in records)
    ggml_type = "+".join(dict.fromkeys(r.ggml_type for r in records))
    shape = (sum(r.shape[0] for r in records), *records[0].shape[1:])
    if all(r.kind == "int4_affine" for r in records):
        return GGUFTensor(name, shape, ggml_type, "int4_affine",
                          q=torch.cat([r.q for r in records]),
                          scale=torch.cat([r.scale for r in records]),
                          offset=torch.cat([r.offset for r in records]))
    return GGUFTensor(name, shape, ggml_type, "dense",
                      values=torch.cat([r.dequantize() for r in records]))


def permute_rows(record: GGUFTensor, index: torch.Tensor) -> GGUFTensor:
    """Row i of the result is row index[i] of `record`; int4 groups move with their rows."""
    if record.kind == "int4_affine":
        return GGUFTensor(record.name, record.shape, record.ggml_type, record.kind,
                          q=record.q[index], scale=record.scale[index],
                          offset=record.offset[index])
    return GGUFTensor(record.name, record.shape, record.ggml_type, record.kind,
                      values=record.values[index])


def llama_qk_unpermute_index(rows: int, n_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation for llama-architecture models.

    For its interleaved RoPE, llama.cpp's converter moves HF row (h, j, i) (head h, rotary half
    j, index i within the half) to GGUF row (h, i, j); result row (h, j, i) therefore reads
    GGUF row (h, i, j), restoring HF's rotate-half order. n_heads: attention heads for Q,
    key/value heads for K (the same rule transformers' GGUF loader applies).
    """
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of rotary pairs")
    return torch.arange(rows).view(n_heads, -1, 2).transpose(1, 2).reshape(-1)


def unpermute_llama_qk(record: GGUFTensor, n_heads: int) -> GGUFTensor:
    """`record` (attn_q or attn_k of a llama-architecture GGUF) with HF's row order."""
    return permute_rows(record, llama_qk_unpermute_index(record.shape[0], n_heads))


def to_linear(record: GGUFTensor, activation_dtype: torch.dtype = torch.bfloat16,
              dense_mode: str = "int8", native_int4: bool = True,
              bias: torch.Tensor | None = None, kernels: str = "torch") -> nn.Module:
    """A linear layer computing x @ record^T (+ bias).

    int4 records keep their own blocks (unless native_int4 is False): BlockQ4Linear on tandem's
    block kernels, Int4Linear (bf16 activations) on torch's. Dense records (and int4 ones when
    native_int4 is False) follow dense_mode: "int8" re-quantises (blocks of 32 on the block
    kernels, which recovers Q8_0's own codes; per output channel on torch's), "int4" re-quantises
    in groups of 32, "none" keeps a DenseLinear in activation_dtype (e.g. fp32 for a reference run).
    """
    if len(record.shape) != 2:
        raise ValueError(f"{record.name} has shape {record.shape}, not a matrix")
    if record.kind == "int4_affine" and native_int4:
        if kernels == "block" and record.shape[1] % BLOCK == 0:
            return BlockQ4Linear.from_affine_groups(record.q, record.scale, record.offset, bias)
        return Int4Linear.from_affine_groups(record.q, record.scale, record.offset, bias)
    weight = record.dequantize()
    if dense_mode == "none":
        return DenseLinear(weight, bias, dtype=activation_dtype)
    return quantize_linear(weight, bias, dense_mode, kernels=kernels)


# --- fast tensor index -------------------------------------------------------------------------

@dataclass
class IndexedTensor:
    """The fields of gguf's ReaderTensor that decode_tensor reads (shape in GGUF order)."""

    name: str
    shape: np.ndarray
    tensor_type: QT
    data: np.ndarray  # raw bytes, uint8


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Reads GGUF's little-endian header fields in order from a byte buffer."""

    def __init__(self, buf: memoryview, pos: int) -> None:
        self.buf, self.pos = buf, pos

    def unpack(self, fmt: str) -> tuple:
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return out

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        """A metadata value: scalars and strings read, arrays skipped by length (None)."""
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            return self.unpack(_SCALAR_FORMATS[vtype])[0]
        etype, count = self.unpack("<IQ")
        if etype == _STRING:
            for _ in range(count):
                (n,) = self.unpack("<Q")
                self.pos += n
        elif etype == _ARRAY:
            for _ in range(count):
                self.value(_ARRAY)
        else:
            self.pos += _SCALAR_SIZES[etype] * count
        return None


def index_gguf(path: str | os.PathLike) -> tuple[dict[str, object], list[IndexedTensor]]:
    """Tensor index of a GGUF file without materialising its metadata arrays.

    GGUFReader builds numpy views for every vocabulary entry (seconds for a 49k-262k vocab);
    here metadata values are skipped by length, keeping only scalar and string values.
    Layout (GGUF v2/v3): magic, version, tensor count, kv count; kv pairs; tensor infos
    (name, dims, type, offset); tensor data from the next `general.alignment` boundary.
    """
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(raw)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
    cur = _Cursor(buf, 24)
    metadata: dict[str, object] = {}
    for _ in range(n_kv):
        key = cur.string()
        v = cur.value(cur.unpack("<I")[0])
        if v is not None:
            metadata[key] = v
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        (n_dims,) = cur.unpack("<I")
        dims = cur.unpack(f"<{n_dims}Q")
        qtype, offset = cur.unpack("<IQ")
        infos.append((name, dims, QT(qtype), offset))
    align = int(metadata.get("general.alignment", 32))
    start = (cur.pos + align - 1) // align * align
    tensors = []
    for name, dims, qtype, offset in infos:
        block, type_size = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(dims)) // block * type_size
        tensors.append(IndexedTensor(name, np.array(dims), qtype, raw[start + offset : start + offset + nbytes]))
    return metadata, tensors
