"""tandem's own CPU kernels (block_matmul.cpp): block-quantized weights times int8-quantized
activations, a small-batch GEMM that reads each weight block once for every row of a call, and
the decoder layer loop in one native call.

The source is compiled with the local g++ at first use (a few seconds) once per instruction-set
variant, cached under TANDEM_CACHE_DIR/kernels keyed by the source and flags, and called through
ctypes. The best variant the CPU supports is chosen from /proc/cpuinfo:

    avx512   AVX-512 VNNI: vpdpbusd on zmm, 16 output rows per instruction
    vnni256  256-bit VNNI (AVX-VNNI, or AVX512-VL with VNNI): vpdpbusd on ymm, 8 rows
    avx2     AVX2 + FMA: vpmaddubsw + vpmaddwd, 8 rows

TANDEM_KERNELS=avx512|vnni256|avx2 forces one (an error if this CPU cannot run it), and
TANDEM_KERNELS=torch uses torch's int4/int8 kernels instead. Machines without AVX2/FMA or a
compiler fall back to torch's kernels with one warning.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.paths import cache_root

log = logging.getLogger("tandem.kernels")

SOURCE = Path(__file__).with_name("block_matmul.cpp")
COMMON_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
BLOCK = 32


@dataclass(frozen=True)
class Variant:
    name: str
    lanes: int
    cpu_flags: tuple[tuple[str, ...], ...]  # any one of these flag sets suffices
    compile_flags: tuple[tuple[str, ...], ...]  # the flags for the matching cpu_flags entry


_AVX2 = ("avx2", "fma", "f16c")
_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = (*_AVX2, "avx512f", "avx512bw", "avx512vl", "avx512_vnni")
_AVX512_FLAGS = (*_AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")

# Best first: auto picks the first one the CPU runs.
VARIANTS = (
    Variant("avx512", 16, (_AVX512,), (_AVX512_FLAGS,)),
    Variant("vnni256", 8, ((*_AVX2, "avx_vnni"), _AVX512), ((*_AVX2_FLAGS, "-mavxvnni"), _AVX512_FLAGS)),
    Variant("avx2", 8, (_AVX2,), (_AVX2_FLAGS,)),
)
VARIANT_NAMES = tuple(v.name for v in VARIANTS)
KERNEL_CHOICES = ("auto", *VARIANT_NAMES, "torch")


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_name() -> str:
    """The CPU's model name, for figures and profile keys."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def cpu_model() -> str | None:
    """'family F model M' of the CPU (one model name covers several generations: AMD EPYC is
    Zen 3 at family 25 model 1, Zen 4 at 25/17, Zen 5 at 26/2), or None where /proc/cpuinfo
    does not say."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("cpu family", "model") and key not in fields:
                fields[key] = value.strip()
            if not line.strip():
                break
    except OSError:
        return None
    if "cpu family" not in fields or "model" not in fields:
        return None
    return f"family {fields['cpu family']} model {fields['model']}"


def _compile_flags(variant: Variant, flags: frozenset[str]) -> tuple[str, ...] | None:
    for needed, compile_flags in zip(variant.cpu_flags, variant.compile_flags):
        if set(needed) <= flags:
            return compile_flags
    return None


def supported_variants() -> list[str]:
    """The block-kernel variants this CPU can run, best first."""
    return list(_supported(cpu_flags()))


@functools.cache
def _supported(flags: frozenset[str]) -> tuple[str, ...]:
    # Cached per flag set: every block linear's forward asks which kernels run.
    return tuple(v.name for v in VARIANTS if _compile_flags(v, flags) is not None)


def requested_kernels() -> str:
    choice = os.environ.get("TANDEM_KERNELS", "auto")
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"TANDEM_KERNELS={choice!r}: choose one of {', '.join(KERNEL_CHOICES)}")
    return choice


def selected_variant() -> str | None:
    """The variant block_kernels() runs: TANDEM_KERNELS's, or the best this CPU supports; None
    for torch's kernels."""
    choice = requested_kernels()
    if choice == "torch":
        return None
    supported = _supported(cpu_flags())
    if choice == "auto":
        return supported[0] if supported else None
    if choice not in supported:
        raise ValueError(f"TANDEM_KERNELS={choice}: this CPU cannot run it (it runs: {', '.join(supported) or 'none'})")
    return choice


def kernel_description() -> str:
    """What runs the quantized linears here: the block-kernel variant or torch's kernels."""
    k = block_kernels()
    return f"tandem {k.variant}" if k is not None else "torch int4/int8"


# Input transforms fused into a linear; RMS_NORM_HALVES norms each half of a row on its own
# (EAGLE-3's [embedding | feature] attention input).
IDENTITY, RMS_NORM, SWIGLU, GEGLU, RMS_NORM_HALVES = 0, 1, 2, 3, 4


class _Weights(ctypes.Structure):
    _fields_ = [
        ("packed", ctypes.c_void_p), ("pd", ctypes.c_void_p), ("pm", ctypes.c_void_p), ("bias", ctypes.c_void_p),
        ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("q4", ctypes.c_int),
    ]


class _LinearCall(ctypes.Structure):
    _fields_ = [
        ("w", ctypes.POINTER(_Weights)), ("x", ctypes.c_void_p), ("n", ctypes.c_int64), ("x_stride", ctypes.c_int64),
        ("transform", ctypes.c_int), ("norm_w", ctypes.c_void_p), ("eps", ctypes.c_float),
        ("residual", ctypes.c_void_p), ("y", ctypes.c_void_p), ("threads", ctypes.c_int),
    ]


class _AttendArgs(ctypes.Structure):
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


class _DecoderLayer(ctypes.Structure):
    _fields_ = [
        ("qkv", ctypes.POINTER(_Weights)), ("o", ctypes.POINTER(_Weights)), ("gate_up", ctypes.POINTER(_Weights)),
        ("down", ctypes.POINTER(_Weights)), ("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p),
        ("window", ctypes.c_int64), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
        ("post_attn_norm", ctypes.c_void_p), ("post_mlp_norm", ctypes.c_void_p),
        ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
    ]


class _DecoderArgs(ctypes.Structure):
    _fields_ = [
        ("layers", ctypes.POINTER(_DecoderLayer)), ("num_layers", ctypes.c_int64),
        ("H", ctypes.c_int64), ("Hq", ctypes.c_int64), ("Hkv", ctypes.c_int64), ("D", ctypes.c_int64),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("activation", ctypes.c_int),
        ("x", ctypes.c_void_p), ("T", ctypes.c_int64),
        ("seq", ctypes.c_void_p), ("slot", ctypes.c_void_p), ("pos", ctypes.c_void_p), ("hi", ctypes.c_void_p),
        ("key_off", ctypes.c_void_p), ("keys", ctypes.c_void_p), ("kcache", ctypes.c_void_p), ("vcache", ctypes.c_void_p), ("M", ctypes.c_int64), ("layer_stride", ctypes.c_int64),
        ("capture", ctypes.POINTER(ctypes.c_void_p)), ("threads", ctypes.c_int), ("kv_half", ctypes.c_int),
        ("k_blocked", ctypes.c_int),
    ]


class _DraftLayerArgs(ctypes.Structure):
    _fields_ = [
        ("layer", ctypes.POINTER(_DecoderLayer)),
        ("H", ctypes.c_int64), ("Hq", ctypes.c_int64), ("Hkv", ctypes.c_int64), ("D", ctypes.c_int64),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("activation", ctypes.c_int),
        ("x", ctypes.c_void_p), ("attn_in", ctypes.c_void_p), ("attn_width", ctypes.c_int64),
        ("attn_transform", ctypes.c_int), ("attn_eps", ctypes.c_float), ("T", ctypes.c_int64),
        ("seq", ctypes.c_void_p), ("slot", ctypes.c_void_p), ("pos", ctypes.c_void_p), ("hi", ctypes.c_void_p),
        ("key_off", ctypes.c_void_p), ("keys", ctypes.c_void_p),
        ("seq_k", ctypes.POINTER(ctypes.c_void_p)), ("seq_v", ctypes.POINTER(ctypes.c_void_p)), ("seq_M", ctypes.c_void_p),
        ("head", ctypes.POINTER(_Weights)), ("head_norm", ctypes.c_void_p), ("head_eps", ctypes.c_float),
        ("head_index", ctypes.c_void_p), ("head_rows", ctypes.c_int64),
        ("logits", ctypes.c_void_p), ("threads", ctypes.c_int), ("kv_half", ctypes.c_int),
    ]


class _DraftChainArgs(ctypes.Structure):
    _fields_ = [
        ("layer", _DraftLayerArgs), ("R", ctypes.c_int64), ("feat", ctypes.c_void_p), ("logits", ctypes.c_void_p),
        ("slot0", ctypes.c_void_p), ("pos0", ctypes.c_void_p), ("budget", ctypes.c_void_p), ("width", ctypes.c_int64),
        ("vocab_ids", ctypes.c_void_p), ("embed", ctypes.c_void_p), ("embed_scale", ctypes.c_float),
        ("tokens", ctypes.c_void_p),
    ]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _own_caches(caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[ctypes.Array, ctypes.Array, torch.Tensor]:
    """Per-sequence caches as AttendArgs reads them: key and value base addresses, capacities."""
    k_ptrs = (ctypes.c_void_p * len(caches))(*[_ptr(k) for k, _ in caches])
    v_ptrs = (ctypes.c_void_p * len(caches))(*[_ptr(v) for _, v in caches])
    return k_ptrs, v_ptrs, torch.tensor([k.shape[1] for k, _ in caches], dtype=torch.int64)


def _kv_half(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """1 for an fp16 KV cache, 0 for float32 (the two the kernels read)."""
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"the block kernels read a float32 or float16 KV cache, not {k_cache.dtype}/{v_cache.dtype}")
    return int(k_cache.dtype == torch.float16)


class BlockWeights:
    """One linear layer's weights as the kernels read them: the GGUF blocks repacked into groups
    of `lanes` output rows (see block_matmul.cpp). Built once per layer by BlockKernels.pack;
    holds the tensors its native record points into."""

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
        self.record = _Weights(_ptr(self.packed), _ptr(self.pd), _ptr(self.pm), _ptr(self.bias), N, K,
                               int(m is not None))

    @property
    def nbytes(self) -> int:
        """Bytes the small-batch GEMM reads per forward (packed codes and scales)."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.pd, self.pm) if t is not None)


class BlockKernels:
    """The compiled library of one variant. Inputs must be contiguous float32 CPU tensors;
    outputs are new float32 tensors unless `out` is given."""

    def __init__(self, lib: ctypes.CDLL, variant: str, build_key: str = "") -> None:
        self.variant = variant
        self.build_key = build_key  # hash of the source and flags it was compiled from
        self.lanes = lib.tandem_lanes()
        self._q8_bias = lib.tandem_q8_bias()
        self._linear = lib.tandem_linear
        self._attend = lib.tandem_attend
        self._decoder = lib.tandem_decoder_forward
        self._draft_layer = lib.tandem_draft_layer
        self._draft_chain = lib.tandem_draft_chain
        self._linear_argmax = lib.tandem_linear_argmax
        self._linear_argmax.argtypes = [ctypes.POINTER(_LinearCall), ctypes.c_void_p, ctypes.c_void_p]
        self._linear_argmax.restype = None
        self._peak = lib.tandem_int8_peak
        self._peak.argtypes = [ctypes.c_int64, ctypes.c_int]
        self._peak.restype = ctypes.c_int64
        for fn, args in ((self._linear, _LinearCall), (self._attend, _AttendArgs), (self._decoder, _DecoderArgs),
                         (self._draft_layer, _DraftLayerArgs), (self._draft_chain, _DraftChainArgs)):
            fn.argtypes = [ctypes.POINTER(args)]
            fn.restype = None

    def int8_peak(self, threads: int | None = None, seconds: float = 0.3) -> float:
        """Multiply-adds per second of this variant's int8 instruction (vpdpbusd, or
        vpmaddubsw + vpmaddwd on AVX2) in a register-only loop on `threads` threads: best of 5."""
        threads = threads or torch.get_num_threads()
        iters = 1 << 16
        while True:  # size the loop to about `seconds`
            t = time.perf_counter()
            macs = self._peak(iters, threads)
            elapsed = time.perf_counter() - t
            if elapsed > seconds / 4:
                break
            iters *= 4
        best = elapsed
        for _ in range(4):
            t = time.perf_counter()
            self._peak(iters, threads)
            best = min(best, time.perf_counter() - t)
        return macs / best

    def pack(self, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None,
             bias: torch.Tensor | None = None) -> BlockWeights:
        """q4 (m given: qs uint8 [N, K/2], GGUF Q4_1 layout) or q8 (qs int8 [N, K]) blocks, with
        d (and m) [N, K/32], in the layout this variant reads."""
        return BlockWeights(qs, d, m, bias, self.lanes, self._q8_bias)

    def linear(self, x: torch.Tensor, w: BlockWeights, *, transform: int = IDENTITY,
               norm_weight: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """transform(x [n, *]) @ W^T (+ bias) (+ residual) -> [n, N].

        transform RMS_NORM needs norm_weight [K]; SWIGLU/GEGLU read rows of width 2K (gate | up).
        out may be the residual tensor itself (an in-place residual add).
        """
        n, width = x.shape
        expected = 2 * w.in_features if transform in (SWIGLU, GEGLU) else w.in_features
        if width != expected:
            raise ValueError(f"input rows have width {width}, the layer needs {expected}")
        y = torch.empty(n, w.out_features, dtype=torch.float32) if out is None else out
        call = _LinearCall(ctypes.pointer(w.record), _ptr(x), n, width, transform, _ptr(norm_weight), eps,
                           _ptr(residual), _ptr(y), torch.get_num_threads())
        self._linear(ctypes.byref(call))
        return y

    def linear_argmax(self, x: torch.Tensor, w: BlockWeights, *, transform: int = IDENTITY,
                      norm_weight: torch.Tensor | None = None, eps: float = 0.0
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`linear`, and of each output row its argmax (the first index of the largest value, as
        numpy's) and whether it is all finite: (y [n, N], argmax [n] int64, finite [n] bool),
        found by the threads that wrote each row's columns while they are in cache."""
        n, width = x.shape
        expected = 2 * w.in_features if transform in (SWIGLU, GEGLU) else w.in_features
        if width != expected:
            raise ValueError(f"input rows have width {width}, the layer needs {expected}")
        y = torch.empty(n, w.out_features, dtype=torch.float32)
        best = torch.empty(n, dtype=torch.int64)
        finite = torch.empty(n, dtype=torch.int32)
        call = _LinearCall(ctypes.pointer(w.record), _ptr(x), n, width, transform, _ptr(norm_weight), eps,
                           None, _ptr(y), torch.get_num_threads())
        self._linear_argmax(ctypes.byref(call), _ptr(best), _ptr(finite))
        return y, best, finite.bool()

    def attend(self, qkv: torch.Tensor, seq: torch.Tensor, slot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, window: int | None,
               scale: float, tree: "TreeKeys | None" = None, q_norm: torch.Tensor | None = None,
               k_norm: torch.Tensor | None = None, eps: float = 0.0, keys_blocked: bool = False) -> torch.Tensor:
        """Per token t: RoPE(q, k) at position slot[t], k/v written to the cache row seq[t] at
        slot[t], attention over that row's slots [lo, slot[t]] -> [T, num_heads * D].

        v_cache [S, Hkv, M, D]; k_cache the same, or with keys_blocked [S, Hkv, M / 16, D, 16]
        (KVCache.block_keys). tree: tree nodes instead (see TreeKeys): RoPE at tree.pos[t],
        attention over slots [lo, tree.hi[t]) and then the node's own path of slots.
        q_norm/k_norm [D]: an RMSNorm of every q/k head before RoPE (Qwen3, Gemma 3).
        """
        T = qkv.shape[0]
        D = cos.shape[1]
        out = torch.empty(T, num_heads * D, dtype=torch.float32)
        pos, hi, key_off, keys = (None,) * 4 if tree is None else (tree.pos, tree.hi, tree.key_off, tree.keys)
        args = _AttendArgs(
            _ptr(qkv), T, num_heads, num_kv_heads, D, _ptr(seq), _ptr(slot), _ptr(pos), _ptr(hi), _ptr(key_off),
            _ptr(keys), _ptr(cos), _ptr(sin), _ptr(k_cache), _ptr(v_cache), v_cache.shape[2], window or 0, scale,
            _ptr(out), torch.get_num_threads(), _ptr(q_norm), _ptr(k_norm), eps, _kv_half(k_cache, v_cache),
            None, None, None, int(keys_blocked),
        )
        self._attend(ctypes.byref(args))
        return out

    def attend_own_caches(self, qkv: torch.Tensor, rows: "DraftRows", cos: torch.Tensor, sin: torch.Tensor,
                          caches: list[tuple[torch.Tensor, torch.Tensor]], num_heads: int, num_kv_heads: int,
                          scale: float) -> torch.Tensor:
        """`attend` where every sequence has a cache of its own (a drafter's RowCaches): row t
        belongs to request rows.seq[t], whose keys and values are caches[rows.seq[t]] = (k, v)
        [Hkv, M_s, D], goes to slot rows.slot[t] at rope position rows.pos[t], and sees what
        rows.keys says (None: its cache up to its own slot)."""
        T, D = qkv.shape[0], cos.shape[1]
        out = torch.empty(T, num_heads * D, dtype=torch.float32)
        tree = rows.keys
        hi, key_off, keys = (None,) * 3 if tree is None else (tree.hi, tree.key_off, tree.keys)
        k_ptrs, v_ptrs, capacity = _own_caches(caches)
        args = _AttendArgs(
            _ptr(qkv), T, num_heads, num_kv_heads, D, _ptr(rows.seq), _ptr(rows.slot), _ptr(rows.pos), _ptr(hi),
            _ptr(key_off), _ptr(keys), _ptr(cos), _ptr(sin), None, None, 0, 0, scale, _ptr(out),
            torch.get_num_threads(), None, None, 0.0, _kv_half(*caches[0]), k_ptrs, v_ptrs, _ptr(capacity),
        )
        self._attend(ctypes.byref(args))
        return out

    def decoder(self, layers: ctypes.Array, x: torch.Tensor, seq: torch.Tensor, slot: torch.Tensor,
                tree: "TreeKeys | None", k_cache: torch.Tensor, v_cache: torch.Tensor, shape: "DecoderShape",
                capture: dict[int, torch.Tensor], keys_blocked: bool = False) -> None:
        """Run every decoder layer over x [T, H] in place (see block_matmul.cpp decoder_forward):
        layers is a ctypes array of _DecoderLayer (decoder_layers builds it once per model);
        v_cache [L, S, Hkv, M, D] float32 or float16, k_cache the same or, keys_blocked, in blocks of
        16 slots [L, S, Hkv, M / 16, D, 16] (KVCache.block_keys); capture {layer: [T, H] tensor}
        receives layer outputs."""
        pos, hi, key_off, keys = (None,) * 4 if tree is None else (tree.pos, tree.hi, tree.key_off, tree.keys)
        L = len(layers)
        slots = (ctypes.c_void_p * L)(*[_ptr(capture.get(li)) for li in range(L)]) if capture else None
        args = _DecoderArgs(
            layers, L, shape.hidden, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.eps, shape.scale,
            shape.activation, _ptr(x), x.shape[0], _ptr(seq), _ptr(slot), _ptr(pos), _ptr(hi), _ptr(key_off),
            _ptr(keys), _ptr(k_cache), _ptr(v_cache), v_cache.shape[3],
            v_cache[0].numel(), slots, torch.get_num_threads(), _kv_half(k_cache, v_cache), int(keys_blocked),
        )
        self._decoder(ctypes.byref(args))

    def draft_layer(self, layer: "DraftLayer", x: torch.Tensor, attn_in: torch.Tensor, rows: "DraftRows",
                    caches: list[tuple[torch.Tensor, torch.Tensor]],
                    logit_rows: torch.Tensor | str | None = None) -> torch.Tensor | None:
        """One draft head layer over x [T, H] in place (block_matmul.cpp draft_layer): the
        attention input attn_in [T, Din] (transformed as the layer says), per request r the
        caches[r] = (k, v) [Hkv, M_r, D] its rows (rows.seq == r) write and attend over; then,
        where the layer has a vocabulary head, the logits [n, V'] of the output rows
        logit_rows names (int64 indices, or "all"), returned; else None."""
        logits = index = None
        count = 0
        if logit_rows is not None and layer.vocab is not None:
            if isinstance(logit_rows, str):
                count = x.shape[0]
            else:
                index, count = logit_rows.to(torch.int64).contiguous(), len(logit_rows)
            logits = torch.empty(count, layer.vocab.out_features, dtype=torch.float32)
        tree = rows.keys
        hi, key_off, keys = (None,) * 3 if tree is None else (tree.hi, tree.key_off, tree.keys)
        args, alive = self._draft_layer_args(layer, caches, logits is not None)
        args.x, args.attn_in, args.attn_width, args.T = _ptr(x), _ptr(attn_in), attn_in.shape[1], x.shape[0]
        args.seq, args.slot, args.pos = _ptr(rows.seq), _ptr(rows.slot), _ptr(rows.pos)
        args.hi, args.key_off, args.keys = _ptr(hi), _ptr(key_off), _ptr(keys)
        if logits is not None:
            args.head_index, args.head_rows, args.logits = _ptr(index), count, _ptr(logits)
        self._draft_layer(ctypes.byref(args))
        del alive
        return logits

    def draft_chain(self, layer: "DraftLayer", chain: "DraftChain",
                    caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Greedy draft steps for R requests in one call (block_matmul.cpp draft_chain), for a
        layer with a vocabulary head whose input is [embedding | feature]: the keys of step s
        of request r go to slot chain.slot0[r] + s of caches[r], which must have room for
        budget[r] - 1 steps. Returns the drafted target ids [R, max budget], -1 past each
        request's chain."""
        if layer.vocab is None:
            raise ValueError("a draft chain needs a layer with its vocabulary head")
        R = len(caches)
        width = int(chain.budget.max())
        tokens = torch.empty(R, width, dtype=torch.int64)
        args, alive = self._draft_layer_args(layer, caches, True)
        call = _DraftChainArgs(args, R, _ptr(chain.feat), _ptr(chain.logits), _ptr(chain.slot0), _ptr(chain.pos0),
                               _ptr(chain.budget), width, _ptr(chain.vocab_ids), _ptr(chain.embed), chain.embed_scale,
                               _ptr(tokens))
        self._draft_chain(ctypes.byref(call))
        del alive
        return tokens

    def _draft_layer_args(self, layer: "DraftLayer", caches: list[tuple[torch.Tensor, torch.Tensor]],
                          with_head: bool) -> tuple["_DraftLayerArgs", tuple]:
        """The fields of a draft layer call that do not depend on its rows, and the objects
        they point into (kept alive by the caller until the call returns)."""
        shape = layer.shape
        k_ptrs, v_ptrs, capacity = _own_caches(caches)
        head = ctypes.pointer(layer.vocab.record) if with_head else None
        args = _DraftLayerArgs(
            ctypes.cast(layer.record, ctypes.POINTER(_DecoderLayer)), shape.hidden, shape.num_heads,
            shape.num_kv_heads, shape.head_dim, shape.eps, shape.scale, shape.activation, None, None, 0,
            layer.attn_transform, layer.attn_eps, 0, None, None, None, None, None, None, k_ptrs, v_ptrs,
            _ptr(capacity), head, _ptr(layer.vocab_norm), layer.vocab_eps, None, 0, None, torch.get_num_threads(),
            _kv_half(caches[0][0], caches[0][1]),
        )
        return args, (k_ptrs, v_ptrs, capacity, head)


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


def decoder_layers(layers: list[LayerParts]) -> ctypes.Array:
    """The native records of a model's layers, built once."""
    return (_DecoderLayer * len(layers))(*[
        _DecoderLayer(ctypes.pointer(p.qkv.record), ctypes.pointer(p.o.record), ctypes.pointer(p.gate_up.record),
                      ctypes.pointer(p.down.record), _ptr(p.attn_norm), _ptr(p.mlp_norm), p.window or 0,
                      _ptr(p.q_norm), _ptr(p.k_norm), _ptr(p.post_attn_norm), _ptr(p.post_mlp_norm),
                      _ptr(p.cos), _ptr(p.sin))
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
    _DecoderLayer; its attn_norm is the attention input's norm, used by attn_transform), and the
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


def _build(out: Path, flags: list[str], source: Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) found")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent first uses never load a half-written file.
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so", delete=False) as tmp:
        tmp_path = Path(tmp.name)
    try:
        subprocess.run([compiler, *flags, "-o", str(tmp_path), str(source)], check=True, capture_output=True, text=True)
        tmp_path.replace(out)
    except subprocess.CalledProcessError as err:
        tmp_path.unlink(missing_ok=True)
        raise RuntimeError(err.stderr.strip()[-2000:]) from err


@functools.cache
def load_variant(name: str, source: Path = SOURCE) -> BlockKernels:
    """The compiled kernels of one variant (compiled on first use); raises if it cannot run here.
    source: another version of block_matmul.cpp, to time against this one (scripts/kernel_ab.py)."""
    variant = next((v for v in VARIANTS if v.name == name), None)
    if variant is None:
        raise ValueError(f"unknown kernel variant {name!r}; known: {', '.join(VARIANT_NAMES)}")
    isa = _compile_flags(variant, cpu_flags())
    if isa is None:
        raise ValueError(f"this CPU cannot run the {name} kernels")
    flags = [*COMMON_FLAGS, *isa, f"-DTANDEM_LANES={variant.lanes}"]
    source = Path(source)
    key = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    lib_path = cache_root() / "kernels" / f"block_matmul-{name}-{key}.so"
    if not lib_path.exists():
        log.info("compiling tandem's %s CPU block kernels into %s", name, lib_path)
        _build(lib_path, flags, source)
    # torch is imported first, so its libgomp already serves the kernels' OpenMP pool.
    return BlockKernels(ctypes.CDLL(str(lib_path)), name, key)


@functools.cache
def _block_kernels(variant: str | None) -> BlockKernels | None:
    if variant is None:
        if requested_kernels() == "auto":
            warnings.warn("this CPU lacks AVX2/FMA/F16C: using torch's int4/int8 kernels", stacklevel=3)
        return None
    try:
        kernels = load_variant(variant)
    except (OSError, RuntimeError) as err:
        warnings.warn(f"could not build tandem's CPU kernels ({err}); using torch's int4/int8 kernels", stacklevel=3)
        return None
    log.info("block kernels: %s (%s)", variant, cpu_name())
    return kernels


def block_kernels() -> BlockKernels | None:
    """The kernels TANDEM_KERNELS selects (default: the best variant this CPU runs), or None
    where torch's kernels serve instead."""
    return _block_kernels(selected_variant())
