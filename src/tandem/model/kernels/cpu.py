"""Which of tandem's block-kernel variants this CPU runs: its flags from /proc/cpuinfo, the
variants best first, and TANDEM_KERNELS's choice among them (the package docstring lists them)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path


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


def compile_flags(variant: Variant, flags: frozenset[str]) -> tuple[str, ...] | None:
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
    return tuple(v.name for v in VARIANTS if compile_flags(v, flags) is not None)


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
