"""Building and choosing the kernels: block_matmul.cpp compiled once per instruction-set variant
with the local g++ into TANDEM_CACHE_DIR/kernels (keyed by the source and the flags, checked
against the sha256 its build recorded), and the variant TANDEM_KERNELS selects."""

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
from pathlib import Path

from tandem.model.kernels.cpu import (VARIANT_NAMES, VARIANTS, compile_flags, cpu_flags, cpu_name, requested_kernels,
                                      selected_variant)
from tandem.model.kernels.library import BlockKernels
from tandem.paths import cache_root, umask

log = logging.getLogger("tandem.kernels")

SOURCE = Path(__file__).with_name("block_matmul.cpp")
COMMON_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


def kernel_description() -> str:
    """What runs the quantized linears here: the block-kernel variant or torch's kernels."""
    k = block_kernels()
    return f"tandem {k.variant}" if k is not None else "torch int4/int8"


def _build(out: Path, flags: list[str], source: Path) -> None:
    """Compile `source` into `out`, with its sha256 beside it (`_intact` checks it before loading)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) found")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent first uses never load a half-written file.
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so", delete=False) as tmp:
        tmp_path = Path(tmp.name)
    try:
        subprocess.run([compiler, *flags, "-o", str(tmp_path), str(source)], check=True, capture_output=True, text=True)
        tmp_path.chmod(0o755 & ~umask())  # readable by the accounts that share the cache, as its other files
        digest = hashlib.sha256(tmp_path.read_bytes()).hexdigest()
        tmp_path.replace(out)
        tmp_digest = out.with_name(f"{out.name}.{os.getpid()}.sha256")
        tmp_digest.write_text(digest + "\n")
        tmp_digest.replace(_digest_path(out))
    except subprocess.CalledProcessError as err:
        raise RuntimeError(err.stderr.strip()[-2000:]) from err
    finally:
        tmp_path.unlink(missing_ok=True)


def _digest_path(lib_path: Path) -> Path:
    return lib_path.with_name(lib_path.name + ".sha256")


def _intact(lib_path: Path) -> bool:
    """Whether a cached build is the file its build wrote (its sha256 beside it): a truncated or
    overwritten library is built again rather than mapped (a truncated one kills the process that
    maps it with SIGBUS)."""
    try:
        return hashlib.sha256(lib_path.read_bytes()).hexdigest() == _digest_path(lib_path).read_text().strip()
    except OSError:
        return False


@functools.cache
def load_variant(name: str, source: Path = SOURCE) -> BlockKernels:
    """The compiled kernels of one variant (compiled on first use); raises if it cannot run here.
    source: another version of block_matmul.cpp, to time against this one (scripts/kernel_ab.py)."""
    variant = next((v for v in VARIANTS if v.name == name), None)
    if variant is None:
        raise ValueError(f"unknown kernel variant {name!r}; known: {', '.join(VARIANT_NAMES)}")
    isa = compile_flags(variant, cpu_flags())
    if isa is None:
        raise ValueError(f"this CPU cannot run the {name} kernels")
    flags = [*COMMON_FLAGS, *isa, f"-DTANDEM_LANES={variant.lanes}"]
    source = Path(source)
    key = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    lib_path = cache_root() / "kernels" / f"block_matmul-{name}-{key}.so"
    if not _intact(lib_path):
        log.info("compiling tandem's %s CPU block kernels into %s", name, lib_path)
        try:
            _build(lib_path, flags, source)
        except OSError as err:  # a cache this user cannot write: a private build, this process only
            log.warning("cannot write tandem's kernel cache (%s); compiling into a temporary directory", err)
            lib_path = Path(tempfile.mkdtemp(prefix="tandem-kernels-")) / lib_path.name
            _build(lib_path, flags, source)
    # torch is imported first, so its libgomp already serves the kernels' OpenMP pool.
    return BlockKernels(ctypes.CDLL(str(lib_path)), name, key)


@functools.cache
def _block_kernels(variant: str | None) -> BlockKernels | None:
    if variant is None:
        if requested_kernels() == "auto":
            warnings.warn("this CPU lacks AVX2/FMA/F16C: using torch's int4/int8 kernels", stacklevel=3)
        else:
            log.info("block kernels: none; torch's int4/int8 kernels (TANDEM_KERNELS=torch)")
        return None
    try:
        kernels = load_variant(variant)
    except (OSError, RuntimeError) as err:
        if requested_kernels() != "auto":  # forced: run it or say why not, never quietly another
            raise ValueError(f"TANDEM_KERNELS={variant}: tandem's {variant} kernels cannot be built or loaded "
                             f"({err})") from None
        warnings.warn(f"could not build tandem's CPU kernels ({err}); using torch's int4/int8 kernels", stacklevel=3)
        return None
    log.info("block kernels: %s (%s)", variant, cpu_name())
    return kernels


def block_kernels() -> BlockKernels | None:
    """The kernels TANDEM_KERNELS selects (default: the best variant this CPU runs), or None
    where torch's kernels serve instead."""
    return _block_kernels(selected_variant())
