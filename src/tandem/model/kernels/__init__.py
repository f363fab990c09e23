"""tandem's own CPU kernels (block_matmul.cpp): block-quantized weights times int8-quantized
activations, with AVX2, in the style of llama.cpp's Q4_1 x Q8_1 dot products.

The source is compiled with the local g++ at first use (a few seconds) into
TANDEM_CACHE_DIR/kernels, keyed by the source and flags, and called through ctypes. Machines
without AVX2/FMA or a compiler fall back to torch's int4/int8 kernels with one warning;
TANDEM_KERNELS=torch forces that fallback (to compare the two).
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
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("tandem.kernels")

SOURCE = Path(__file__).with_name("block_matmul.cpp")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
BLOCK = 32


def cpu_has_avx2() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags and "f16c" in flags


IDENTITY, RMS_NORM, SWIGLU, GEGLU = 0, 1, 2, 3  # input transforms fused into a linear


class _LinearArgs(ctypes.Structure):
    _fields_ = [
        ("x", ctypes.c_void_p), ("n", ctypes.c_int64), ("K", ctypes.c_int64), ("x_stride", ctypes.c_int64),
        ("transform", ctypes.c_int), ("norm_w", ctypes.c_void_p), ("eps", ctypes.c_float),
        ("qs", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p), ("N", ctypes.c_int64),
        ("bias", ctypes.c_void_p), ("residual", ctypes.c_void_p), ("y", ctypes.c_void_p), ("threads", ctypes.c_int),
    ]


class _AttendArgs(ctypes.Structure):
    _fields_ = [
        ("qkv", ctypes.c_void_p), ("T", ctypes.c_int64), ("Hq", ctypes.c_int64), ("Hkv", ctypes.c_int64),
        ("D", ctypes.c_int64), ("seq", ctypes.c_void_p), ("slot", ctypes.c_void_p), ("pos", ctypes.c_void_p),
        ("hi", ctypes.c_void_p), ("key_off", ctypes.c_void_p), ("keys", ctypes.c_void_p),
        ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("kcache", ctypes.c_void_p), ("vcache", ctypes.c_void_p),
        ("M", ctypes.c_int64), ("window", ctypes.c_int64), ("scale", ctypes.c_float), ("out", ctypes.c_void_p),
        ("threads", ctypes.c_int),
    ]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class BlockKernels:
    """The compiled library. Inputs must be contiguous float32 CPU tensors; outputs are new
    float32 tensors unless `out` is given."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._q4 = lib.tandem_q4_linear
        self._q8 = lib.tandem_q8_linear
        self._q4_dense = lib.tandem_q4_linear_dense
        self._q8_dense = lib.tandem_q8_linear_dense
        self._attend = lib.tandem_attend
        for fn, args in ((self._q4, _LinearArgs), (self._q8, _LinearArgs), (self._q4_dense, _LinearArgs),
                         (self._q8_dense, _LinearArgs), (self._attend, _AttendArgs)):
            fn.argtypes = [ctypes.POINTER(args)]
            fn.restype = None

    def linear(self, x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
               bias: torch.Tensor | None = None, *, transform: int = IDENTITY, norm_weight: torch.Tensor | None = None,
               eps: float = 0.0, residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
               prefill: bool = False) -> torch.Tensor:
        """transform(x [n, *]) @ W^T (+ bias) (+ residual) -> [n, N], W in q4 blocks (m given) or q8.

        transform RMS_NORM needs norm_weight [K]; SWIGLU/GEGLU read rows of width 2K (gate | up).
        out may be the residual tensor itself (an in-place residual add). prefill: the fp32 path
        for many rows (weights dequantized per chunk, no activation rounding; other numbers than
        the integer path's, equally row-independent): for prompt tokens only.
        """
        n, width = x.shape
        K = qs.shape[1] * 2 if m is not None else qs.shape[1]
        N = qs.shape[0]
        expected = 2 * K if transform in (SWIGLU, GEGLU) else K
        if width != expected:
            raise ValueError(f"input rows have width {width}, the layer needs {expected}")
        y = torch.empty(n, N, dtype=torch.float32) if out is None else out
        args = _LinearArgs(
            _ptr(x), n, K, width, transform, _ptr(norm_weight), eps, _ptr(qs), _ptr(d), _ptr(m), N,
            _ptr(bias), _ptr(residual), _ptr(y), torch.get_num_threads(),
        )
        if prefill:
            (self._q4_dense if m is not None else self._q8_dense)(ctypes.byref(args))
        else:
            (self._q4 if m is not None else self._q8)(ctypes.byref(args))
        return y

    def q4_matmul(self, x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                  prefill: bool = False) -> torch.Tensor:
        return self.linear(x, qs, d, m, prefill=prefill)

    def q8_matmul(self, x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, prefill: bool = False) -> torch.Tensor:
        return self.linear(x, qs, d, None, prefill=prefill)

    def attend(self, qkv: torch.Tensor, seq: torch.Tensor, slot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, window: int | None,
               scale: float, tree: "TreeKeys | None" = None) -> torch.Tensor:
        """Per token t: RoPE(q, k) at position slot[t], k/v written to the cache row seq[t] at
        slot[t], attention over that row's slots [lo, slot[t]] -> [T, num_heads * D].

        tree: tree nodes instead (see TreeKeys): RoPE at tree.pos[t], attention over slots
        [lo, tree.hi[t]) and then the node's own path of slots.
        """
        T = qkv.shape[0]
        D = cos.shape[1]
        out = torch.empty(T, num_heads * D, dtype=torch.float32)
        pos, hi, key_off, keys = (None,) * 4 if tree is None else (tree.pos, tree.hi, tree.key_off, tree.keys)
        args = _AttendArgs(
            _ptr(qkv), T, num_heads, num_kv_heads, D, _ptr(seq), _ptr(slot), _ptr(pos), _ptr(hi), _ptr(key_off),
            _ptr(keys), _ptr(cos), _ptr(sin), _ptr(k_cache), _ptr(v_cache), k_cache.shape[2], window or 0, scale,
            _ptr(out), torch.get_num_threads(),
        )
        self._attend(ctypes.byref(args))
        return out


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


def _build(out: Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) found")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent first uses never load a half-written file.
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so", delete=False) as tmp:
        tmp_path = Path(tmp.name)
    try:
        subprocess.run([compiler, *FLAGS, "-o", str(tmp_path), str(SOURCE)], check=True, capture_output=True, text=True)
        tmp_path.replace(out)
    except subprocess.CalledProcessError as err:
        tmp_path.unlink(missing_ok=True)
        raise RuntimeError(err.stderr.strip()[-2000:]) from err


@functools.cache
def block_kernels() -> BlockKernels | None:
    """The compiled kernels, or None where they cannot run here (then callers use torch's)."""
    if os.environ.get("TANDEM_KERNELS", "auto") == "torch":
        return None
    if not cpu_has_avx2():
        warnings.warn("this CPU lacks AVX2/FMA/F16C: using torch's int4/int8 kernels", stacklevel=2)
        return None
    from tandem.model.loader import cache_root

    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    lib_path = cache_root() / "kernels" / f"block_matmul-{key}.so"
    try:
        if not lib_path.exists():
            log.info("compiling tandem's CPU block kernels into %s", lib_path)
            _build(lib_path)
        # torch is imported first, so its libgomp already serves the kernels' OpenMP pool.
        return BlockKernels(ctypes.CDLL(str(lib_path)))
    except (OSError, RuntimeError) as err:
        warnings.warn(f"could not build tandem's CPU kernels ({err}); using torch's int4/int8 kernels", stacklevel=2)
        return None
