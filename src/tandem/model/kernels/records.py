"""The records tandem's kernels read (block_matmul.cpp's structs, mirrored with ctypes) and the
Python descriptions they are built from: a linear layer's repacked weights, a decoder layer's
parts, tree keys, a draft layer's rows, a greedy draft chain's inputs, and the sampling calls'
arguments and status."""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass

import torch

BLOCK = 32


# Input transforms fused into a linear; RMS_NORM_HALVES norms each half of a row on its own
# (EAGLE-3's [embedding | feature] attention input).
IDENTITY, RMS_NORM, SWIGLU, GEGLU, RMS_NORM_HALVES = 0, 1, 2, 3, 4


class WeightsRecord(ctypes.Structure):
    _fields_ = [
        ("packed", ctypes.c_void_p), ("pd", ctypes.c_void_p), ("pm", ctypes.c_void_p), ("bias", ctypes.c_void_p),
        ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("q4", ctypes.c_int),
    ]


class LinearCall(ctypes.Structure):
    _fields_ = [
        ("w", ctypes.POINTER(WeightsRecord)), ("x", ctypes.c_void_p), ("n", ctypes.c_int64), ("x_stride", ctypes.c_int64),
        ("transform", ctypes.c_int), ("norm_w", ctypes.c_void_p), ("eps", ctypes.c_float),
        ("residual", ctypes.c_void_p), ("y", ctypes.c_void_p), ("threads", ctypes.c_int),
    ]


class AttendArgs(ctypes.Structure):
    _fields_ = [
        ("qkv", ctypes.c_void_p), ("T", ctypes.c_int64), ("Hq", ctypes.c_int64), ("Hkv", ctypes.c_int64),
        ("D", ctypes.c_int64), ("seq", ctypes.c_void_p), ("slot", ctypes.c_void_p), ("pos", ctypes.c_void_p),
        ("hi", ctypes.c_void_p), ("key_off", ctypes.c_void_p), ("keys", ctypes.c_void_p),
        ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("kcache", ctypes.c_void_p), ("vcache", ctypes.c_void_p),
        ("M", ctypes.c_int64), ("window", ctypes.c_int64), ("scale", ctypes.c_float), ("out", ctypes.c_void_p),
        ("threads", ctypes.c_int), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("norm_eps", ctypes.c_float),
        ("kv_half", ctypes.c_int),
        ("seq_k", ctypes.POINTER(ctypes.c_void_p)), ("seq_v", ctypes.POINTER(ctypes.c_void_p)),
        ("seq_M", ctypes.c_void_p),
        ("k_blocked", ctypes.c_int),
    ]


class DecoderLayerRecord(ctypes.Structure):
    _fields_ = [
        ("qkv", ctypes.POINTER(WeightsRecord)), ("o", ctypes.POINTER(WeightsRecord)), ("gate_up", ctypes.POINTER(WeightsRecord)),
        ("down", ctypes.POINTER(WeightsRecord)), ("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p),
        ("window", ctypes.c_int64), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
        ("post_attn_norm", ctypes.c_void_p), ("post_mlp_norm", ctypes.c_void_p),
        ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
    ]


class DecoderArgs(ctypes.Structure):
    _fields_ = [
        ("layers", ctypes.POINTER(DecoderLayerRecord)), ("num_layers", ctypes.c_int64),
        ("H", ctypes.c_int64), ("Hq", ctypes.c_int64), ("Hkv", ctypes.c_int64), ("D", ctypes.c_int64),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("activation", ctypes.c_int),
        ("x", ctypes.c_void_p), ("T", ctypes.c_int64),
        ("seq", ctypes.c_void_p), ("slot", ctypes.c_void_p), ("pos", ctypes.c_void_p), ("hi", ctypes.c_void_p),
        ("key_off", ctypes.c_void_p), ("keys", ctypes.c_void_p), ("kcache", ctypes.c_void_p), ("vcache", ctypes.c_void_p), ("M", ctypes.c_int64), ("layer_stride", ctypes.c_int64),
        ("capture", ctypes.POINTER(ctypes.c_void_p)), ("threads", ctypes.c_int), ("kv_half", ctypes.c_int),
        ("k_blocked", ctypes.c_int),
    ]


class DraftLayerArgs(ctypes.Structure):
    _fields_ = [
        ("layer", ctypes.POINTER(DecoderLayerRecord)),
        ("H", ctypes.c_int64), ("Hq", ctypes.c_int64), ("Hkv", ctypes.c_int64), ("D", ctypes.c_int64),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("activation", ctypes.c_int),
        ("x", ctypes.c_void_p), ("attn_in", ctypes.c_void_p), ("attn_width", ctypes.c_int64),
        ("attn_transform", ctypes.c_int), ("attn_eps", ctypes.c_float), ("T", ctypes.c_int64),
        ("seq", ctypes.c_void_p), ("slot", ctypes.c_void_p), ("pos", ctypes.c_void_p), ("hi", ctypes.c_void_p),
        ("key_off", ctypes.c_void_p), ("keys", ctypes.c_void_p),
        ("seq_k", ctypes.POINTER(ctypes.c_void_p)), ("seq_v", ctypes.POINTER(ctypes.c_void_p)), ("seq_M", ctypes.c_void_p),
        ("head", ctypes.POINTER(WeightsRecord)), ("head_norm", ctypes.c_void_p), ("head_eps", ctypes.c_float),
        ("head_index", ctypes.c_void_p), ("head_rows", ctypes.c_int64),
        ("logits", ctypes.c_void_p), ("threads", ctypes.c_int), ("kv_half", ctypes.c_int),
    ]


class DraftChainArgs(ctypes.Structure):
    _fields_ = [
        ("layer", DraftLayerArgs), ("R", ctypes.c_int64), ("feat", ctypes.c_void_p), ("logits", ctypes.c_void_p),
        ("slot0", ctypes.c_void_p), ("pos0", ctypes.c_void_p), ("budget", ctypes.c_void_p), ("width", ctypes.c_int64),
        ("vocab_ids", ctypes.c_void_p), ("embed", ctypes.c_void_p), ("embed_scale", ctypes.c_float),
        ("tokens", ctypes.c_void_p),
    ]


class DraftTreeArgs(ctypes.Structure):
    _fields_ = [
        ("layer", DraftLayerArgs), ("R", ctypes.c_int64), ("feat", ctypes.c_void_p), ("logits", ctypes.c_void_p),
        ("topk", ctypes.c_int64), ("depth", ctypes.c_void_p), ("prefix", ctypes.c_void_p), ("pos0", ctypes.c_void_p),
        ("vocab_ids", ctypes.c_void_p), ("embed", ctypes.c_void_p), ("embed_scale", ctypes.c_float),
        ("capacity", ctypes.c_int64), ("tokens", ctypes.c_void_p), ("parents", ctypes.c_void_p),
        ("scores", ctypes.c_void_p), ("count", ctypes.c_void_p),
    ]


class SampleStatus(enum.IntEnum):
    """What tandem_sample_rows and tandem_grade_chain report (block_matmul.cpp's SampleStatus)."""

    SAMPLED = 0
    NON_FINITE = 1  # the logits hold NaN or inf
    NO_MASS = 2  # the shift refuses every token
    BAD_TOKEN = 3  # a draft token outside the vocabulary
    BAD_DRAFT_PROBS = 4  # a q row holds NaN or inf


@dataclass(frozen=True)
class RowProcessing:
    """One request's processing as the sampling kernels read it (block_matmul.cpp's Processing):
    temperature 1 / inv_temperature, top-k (0: off), top-p (1: off), min-p (0: off)."""

    inv_temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


class SampleArgs(ctypes.Structure):
    _fields_ = [
        ("logits", ctypes.c_void_p), ("row_of", ctypes.c_void_p), ("rows", ctypes.c_int64), ("vocab", ctypes.c_int64),
        ("ld", ctypes.c_int64), ("shift", ctypes.c_void_p), ("shift_ld", ctypes.c_int64),
        ("inv_temperature", ctypes.c_void_p), ("min_p", ctypes.c_void_p), ("top_k", ctypes.c_void_p),
        ("top_p", ctypes.c_void_p),
        ("uniforms", ctypes.c_void_p), ("probs", ctypes.c_void_p),
        ("out_ids", ctypes.c_void_p), ("out_width", ctypes.c_int64), ("tokens", ctypes.c_void_p),
        ("status", ctypes.c_void_p), ("threads", ctypes.c_int),
    ]


class GradeArgs(ctypes.Structure):
    _fields_ = [
        ("logits", ctypes.c_void_p), ("k", ctypes.c_int64), ("vocab", ctypes.c_int64), ("ld", ctypes.c_int64),
        ("shift", ctypes.c_void_p), ("shift_ld", ctypes.c_int64), ("inv_temperature", ctypes.c_float),
        ("min_p", ctypes.c_float), ("top_k", ctypes.c_int64), ("top_p", ctypes.c_float), ("draft", ctypes.c_void_p),
        ("q", ctypes.c_void_p), ("q_ld", ctypes.c_int64),
        ("uniforms", ctypes.c_void_p), ("accepted", ctypes.c_void_p), ("token", ctypes.c_void_p),
        ("status", ctypes.c_void_p),
    ]


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def own_caches(caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[ctypes.Array, ctypes.Array, torch.Tensor]:
    """Per-sequence caches as AttendArgs reads them: key and value base addresses, capacities."""
    k_ptrs = (ctypes.c_void_p * len(caches))(*[ptr(k) for k, _ in caches])
    v_ptrs = (ctypes.c_void_p * len(caches))(*[ptr(v) for _, v in caches])
    return k_ptrs, v_ptrs, torch.tensor([k.shape[1] for k, _ in caches], dtype=torch.int64)


def kv_half(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """1 for an fp16 KV cache, 0 for float32 (the two the kernels read)."""
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"the block kernels read a float32 or float16 KV cache, not {k_cache.dtype}/{v_cache.dtype}")
    return int(k_cache.dtype == torch.float16)


class BlockWeights:
    """One linear layer's weights as the kernels read them: the GGUF blocks repacked into groups
    of `lanes` output rows (see block_matmul.cpp). Built once per layer by BlockKernels.pack;
    holds the tensors its native record points into."""

    _TENSORS = ("packed", "pd", "pm", "bias")  # WeightsRecord's pointer fields, named alike

    def __init__(self, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bias: torch.Tensor | None,
                 lanes: int, q8_bias: int) -> None:
        N = qs.shape[0]
        K = qs.shape[1] * 2 if m is not None else qs.shape[1]
        nb = K // BLOCK
        groups = -(-N // lanes)
        pad = groups * lanes - N
        if m is not None:
            codes = torch.cat([qs.view(N, nb, 16) & 0xF, qs.view(N, nb, 16) >> 4], dim=-1)  # [N, nb, 32]
            codes = torch.nn.functional.pad(codes, (0, 0, 0, 0, 0, pad))
            quads = codes.view(groups, lanes, nb, 8, 4).permute(0, 2, 3, 1, 4)  # [G, nb, 8, lanes, 4]
            packed = quads[:, :, :4] | (quads[:, :, 4:] << 4)
        else:
            codes = torch.nn.functional.pad(qs.view(N, nb, 32), (0, 0, 0, 0, 0, pad))
            quads = codes.view(groups, lanes, nb, 8, 4).permute(0, 2, 3, 1, 4)
            packed = (quads.to(torch.int16) + q8_bias).to(torch.uint8) if q8_bias else quads.view(torch.uint8)

        def grouped(scales: torch.Tensor) -> torch.Tensor:  # fp16, as GGUF stores them
            padded = torch.nn.functional.pad(scales.half(), (0, 0, 0, pad))
            return padded.view(groups, lanes, nb).permute(0, 2, 1).contiguous()

        self.packed = packed.contiguous()
        self.pd = grouped(d)
        self.pm = grouped(m) if m is not None else None
        self.bias = bias.float().contiguous() if bias is not None else None
        self.in_features, self.out_features = K, N
        self.record = WeightsRecord(ptr(self.packed), ptr(self.pd), ptr(self.pm), ptr(self.bias), N, K,
                               int(m is not None))

    @property
    def _held(self) -> list[str]:
        """The names of the tensors the record points into (packed, pd, then pm and bias where
        the layer has them)."""
        return [name for name in self._TENSORS if getattr(self, name) is not None]

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The tensors the record points into, in `_held` order."""
        return [getattr(self, name) for name in self._held]

    def relocate(self, *copies: torch.Tensor) -> None:
        """Read from `copies` of `tensors` from now on (see arena.place_contiguously): the record
        is updated in place, so the native records that point to it follow."""
        names = self._held
        if len(copies) != len(names):
            raise ValueError(f"relocate needs {len(names)} tensors ({', '.join(names)}), got {len(copies)}")
        for name, copy in zip(names, copies):
            old = getattr(self, name)
            if copy.shape != old.shape or copy.dtype != old.dtype or not copy.is_contiguous():
                raise ValueError(f"the copy of {name} must be a contiguous {old.dtype} tensor of shape "
                                 f"{tuple(old.shape)}")
            setattr(self, name, copy)
            setattr(self.record, name, ptr(copy))

    @property
    def nbytes(self) -> int:
        """Bytes the small-batch GEMM reads per forward (packed codes and scales)."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.pd, self.pm) if t is not None)


@dataclass(frozen=True)
class DecoderShape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float
    activation: int  # SWIGLU or GEGLU


@dataclass(frozen=True)
class LayerParts:
    """One decoder layer as the native loop reads it; optional norms are None where the
    architecture has none. The tensors must stay alive as long as the records built from them."""

    qkv: BlockWeights
    o: BlockWeights
    gate_up: BlockWeights
    down: BlockWeights
    attn_norm: torch.Tensor | None  # None: a draft layer's attention input is used as it comes
    mlp_norm: torch.Tensor
    window: int | None
    cos: torch.Tensor  # [P, D] this layer's rope table, sin sign-folded
    sin: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None

    @property
    def linears(self) -> list[BlockWeights]:
        """The layer's packed weights in the order a forward reads them."""
        return [self.qkv, self.o, self.gate_up, self.down]


def decoder_layers(layers: list[LayerParts]) -> ctypes.Array:
    """The native records of a model's layers, built once."""
    return (DecoderLayerRecord * len(layers))(*[
        DecoderLayerRecord(ctypes.pointer(p.qkv.record), ctypes.pointer(p.o.record), ctypes.pointer(p.gate_up.record),
                      ctypes.pointer(p.down.record), ptr(p.attn_norm), ptr(p.mlp_norm), p.window or 0,
                      ptr(p.q_norm), ptr(p.k_norm), ptr(p.post_attn_norm), ptr(p.post_mlp_norm),
                      ptr(p.cos), ptr(p.sin))
        for p in layers
    ])


@dataclass(frozen=True)
class TreeKeys:
    """What each of T tree tokens attends to, as int64 CPU tensors: rope position pos [T], the
    committed prefix slots [lo, hi[t]), then slots keys[key_off[t]:key_off[t + 1]] (root first,
    the node itself last). The key order is the one decoding the node's path token by token reads
    after the path is gathered into contiguous slots, so the node's numbers match that decoding's."""

    pos: torch.Tensor
    hi: torch.Tensor
    key_off: torch.Tensor
    keys: torch.Tensor


@dataclass(frozen=True)
class DraftRows:
    """Where the T rows of a draft layer call go, as int64 CPU tensors: seq [T] the request
    (index into the call's caches), slot [T] the cache slot its key is written to, pos [T] its
    rope position; keys: what each row attends to (TreeKeys, whose pos supersedes pos), or None
    for slots [0, slot] of its own cache (a chain)."""

    seq: torch.Tensor
    slot: torch.Tensor
    pos: torch.Tensor
    keys: TreeKeys | None = None


@dataclass(frozen=True)
class DraftLayer:
    """A draft head's decoder layer as tandem_draft_layer reads it: the layer record (one
    DecoderLayerRecord; its attn_norm is the attention input's norm, used by attn_transform), and the
    head's vocabulary projection with the norm before it, or None."""

    record: ctypes.Array  # decoder_layers([LayerParts]): one record
    shape: DecoderShape
    attn_transform: int
    attn_eps: float
    vocab: BlockWeights | None
    vocab_norm: torch.Tensor | None
    vocab_eps: float


@dataclass(frozen=True)
class DraftChain:
    """The inputs of a greedy draft chain over R requests (BlockKernels.draft_chain): feat
    [R, H] and logits [R, V'] float32 of each request's last fed row, slot0/pos0/budget [R]
    int64 (the first draft step's cache slot and position, the tokens to draft), vocab_ids [V']
    int64 (draft index -> target id) or None, and the target's float32 embedding [V, H] with
    its scale (1.0 where it has none)."""

    feat: torch.Tensor
    logits: torch.Tensor
    slot0: torch.Tensor
    pos0: torch.Tensor
    budget: torch.Tensor
    vocab_ids: torch.Tensor | None
    embed: torch.Tensor
    embed_scale: float
