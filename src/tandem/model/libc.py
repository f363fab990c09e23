"""What tandem asks of the C library: freed heap memory back to the OS, and transparent huge pages
for the weight buffer. Both are best effort: where the library or the call is missing, nothing
happens and the caller goes on."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name or "libc.so.6", use_errno=True)
    except OSError:
        return None


def trim_heap() -> None:
    """malloc_trim(0): glibc keeps freed heap pages resident until trimmed."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def advise_huge_pages(address: int, length: int) -> bool:
    """madvise(MADV_HUGEPAGE) on [address, address + length), to be called before the range is
    first touched; False where the OS has no such advice or refuses it."""
    madvise = getattr(_libc(), "madvise", None) if sys.platform.startswith("linux") and length > 0 else None
    if madvise is None:
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise(address, length, MADV_HUGEPAGE) == 0
