"""One buffer for all the packed weights a forward streams, in the order it reads them.

Each BlockWeights is packed into tensors of its own, which the allocator scatters over the heap
between other allocations. A decode step reads every layer's weights once, one linear after the
other, and the GEMM prefetches a few blocks past the end of each matrix: with the matrices back
to back, those prefetches fetch the start of the next one instead of unrelated memory, and the
stream never jumps. The buffer is also aligned to 2 MiB and offered to the kernel for transparent
huge pages (madvise MADV_HUGEPAGE, Linux), so that streaming ~100 MB does not walk the page
tables every 4 KiB. Only addresses change: every number the kernels compute is the same.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from tandem.model.kernels.records import BlockWeights
from tandem.model.libc import advise_huge_pages

log = logging.getLogger("tandem.kernels")

HUGE_PAGE = 2 << 20
ALIGN = 64  # every tensor starts on a cache line


def _aligned(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def place_contiguously(weights: Sequence[BlockWeights]) -> torch.Tensor | None:
    """Copy every tensor of `weights` (codes, scales, mins, bias) into one new buffer, in the
    order given, and point the weights (and the native records the kernels read, updated in
    place) at their copies. Returns the buffer (the copies are views of it and keep it alive);
    None when there is nothing to place. A weight listed twice is placed once."""
    unique = list({id(w): w for w in weights}.values())
    parts = [w.tensors for w in unique]
    total = sum(_aligned(t.numel() * t.element_size(), ALIGN) for ts in parts for t in ts)
    if total == 0:
        return None
    buffer = torch.empty(total + HUGE_PAGE, dtype=torch.uint8)
    start = _aligned(buffer.data_ptr(), HUGE_PAGE) - buffer.data_ptr()
    huge = advise_huge_pages(buffer.data_ptr() + start, _aligned(total, HUGE_PAGE))
    offset = start
    for w, tensors in zip(unique, parts):
        copies = []
        for t in tensors:
            n = t.numel() * t.element_size()
            copy = buffer[offset : offset + n].view(t.dtype).view(t.shape)
            copy.copy_(t)
            copies.append(copy)
            offset += _aligned(n, ALIGN)
        w.relocate(*copies)
    log.debug("%d packed weights placed in one %.1f MB buffer%s", len(unique), total / 2**20,
              " (huge pages asked for)" if huge else "")
    return buffer
