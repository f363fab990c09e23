"""Position-indexed KV cache: one row per sequence, one slot per committed token.

Rejecting drafts means not keeping their slots (`truncate`); accepting a tree path gathers its
nodes' rows into contiguous slots (`commit_path`). Nothing is reallocated while decoding.

On CPU the rows are reserved, not committed: the tensors live in an anonymous private mapping
whose pages the OS commits when a slot is first written, and a released row's pages go back to
the OS (madvise DONTNEED: they read as zeros again). So the memory a server holds grows with the
tokens its requests actually hold, not with max_seqs x max_len, which is the CPU's version of
paged KV blocks without an indirection in the attention kernels.
"""

from __future__ import annotations

import logging
import math
import mmap

import torch

from tandem.config import kv_cache_dtype_name
from tandem.model.arch import ModelConfig
from tandem.model.transformer import LayerCache

log = logging.getLogger("tandem.kv_cache")


# Slots per block of keys when the cache stores them blocked (KVCache.block_keys).
KEY_BLOCK = 16


class CacheFullError(RuntimeError):
    pass


class LazyZeros:
    """A zero tensor of `shape` over an anonymous private mapping: no memory is committed until a
    page is written, and `forget(offset, nbytes)` returns the whole pages of a byte range."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        try:
            self._map = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as err:  # not even the address space: say what asked for it
            raise ValueError(f"the KV cache would span {nbytes / 2**30:.1f} GiB of address space ({err.strerror}): "
                             "lower max_model_len, max_num_seqs or max_total_tokens (tandem serve's --max-model-len, "
                             "--max-running-requests or --max-total-tokens)") from err
        self.tensor = torch.frombuffer(self._map, dtype=dtype, count=math.prod(shape)).view(shape)

    def forget(self, offset: int, nbytes: int) -> None:
        start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (offset + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)


def kv_cache_dtype(activation_dtype: torch.dtype, device: str | torch.device, requested: str = "auto",
                   fused: bool = False) -> torch.dtype:
    """The dtype the cache stores (`--kv-cache-dtype`).

    auto: fp16 for a model on the fused CPU path, whose kernels widen it to fp32 in registers
    (half the bytes a long context reads per step); else fp32 on CPU whatever the activations
    (without native bf16, attention over a bf16 cache measured ~5x slower than over fp32 here);
    the activation dtype on GPUs. float32 / float16 force one. Verification matches plain
    decoding bit for bit within one KV dtype, not across them.
    """
    name = kv_cache_dtype_name(requested)
    if name != "auto":
        return getattr(torch, name)
    on_cpu = str(device).startswith("cpu")
    if on_cpu and fused:
        return torch.float16
    return torch.float32 if on_cpu else activation_dtype


def available_memory_bytes(device: str | torch.device) -> int | None:
    """Memory free for new allocations: MemAvailable on CPU (Linux), free device memory on CUDA."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        max_seqs: int,
        max_len: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        storage: torch.dtype | None = None,
    ) -> None:
        """dtype: the model's activation dtype; storage: the dtype the cache holds (default:
        kv_cache_dtype's choice for a model off the fused path)."""
        self._cfg = cfg
        self.keys_blocked = False
        self._allocate(max_seqs, max_len, storage or kv_cache_dtype(dtype, device), device)
        self.bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * self.k.element_size()
        # Position of the token stored in each slot: equal to the slot index for committed
        # tokens, the tree depth position for uncommitted tree nodes (the general path's sliding
        # window masks read it; the fused kernels, whose cache has blocked keys, never do).
        self.slot_positions = torch.zeros(max_seqs, max_len, dtype=torch.long, device=device)
        self.max_seqs = max_seqs
        self.max_len = max_len
        self.lengths = [0] * max_seqs
        self.last_start = [0] * max_seqs
        self._written = [False] * max_seqs  # a row has pages to give back
        self._free = list(range(max_seqs - 1, -1, -1))

    def _allocate(self, max_seqs: int, max_len: int, dtype: torch.dtype, device: str | torch.device) -> None:
        """The k and v tensors. Layout [L, S, Hkv, M, D]: a sequence's keys for one layer are a
        contiguous [Hkv, M, D] block, so a batch-1 read is a view and attention needs no gather.
        With keys_blocked, keys are [L, S, Hkv, M / 16, D, 16] (block_keys) and M is rounded up to
        whole blocks for both."""
        cfg = self._cfg
        slots = -(-max_len // KEY_BLOCK) * KEY_BLOCK if self.keys_blocked else max_len
        shape = (cfg.num_layers, max_seqs, cfg.num_kv_heads, slots, cfg.head_dim)
        k_shape = shape[:3] + (slots // KEY_BLOCK, cfg.head_dim, KEY_BLOCK) if self.keys_blocked else shape
        self._lazy = [LazyZeros(k_shape, dtype), LazyZeros(shape, dtype)] if torch.device(device).type == "cpu" else []
        if self._lazy:
            self.k, self.v = (z.tensor for z in self._lazy)
        else:
            self.k = torch.zeros(k_shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.slots_per_row = slots
        # The general path's per-layer views (the fused kernels read k and v whole).
        self.layers = [] if self.keys_blocked else [LayerCache(self.k[i], self.v[i]) for i in range(cfg.num_layers)]

    def block_keys(self) -> None:
        """Store keys in blocks of KEY_BLOCK slots, each block [D, 16]: dim d of 16 keys side by
        side, which the fused CPU kernels score 16 keys per multiply-add from (block_matmul.cpp,
        score_key_block). Only before anything is written; the general path does not read it."""
        if self.keys_blocked:
            return
        if any(self._written):
            raise ValueError("the cache's keys can change layout only before anything is written")
        self.keys_blocked = True
        self._allocate(self.max_seqs, self.max_len, self.k.dtype, self.k.device)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise CacheFullError(f"all {self.max_seqs} cache rows are in use")
        seq = self._free.pop()
        self.lengths[seq] = 0
        self.last_start[seq] = 0
        return seq

    def release(self, seq: int) -> None:
        if seq in self._free:
            raise ValueError(f"cache row {seq} released twice")
        self.lengths[seq] = 0
        self._forget(seq)
        self._free.append(seq)

    def token_budget(self, mem_fraction: float, requested: int | None = None) -> int:
        """The KV slots all rows may hold together: `requested` (at most every row full; a
        warning where that is more than the memory available now), or every row full, capped at
        `mem_fraction` of the memory available now (the rows' pages are committed as written)."""
        full = self.max_seqs * self.max_len
        free = available_memory_bytes(self.k.device)
        if requested is not None:
            budget = min(requested, full)
            if free is not None and budget * self.bytes_per_token > free:
                log.warning("max_total_tokens %d needs %.0f MB of KV cache; %.0f MB are available now",
                            budget, budget * self.bytes_per_token / 1e6, free / 1e6)
            return budget
        if free is None:
            return full
        return max(self.max_len, min(full, int(mem_fraction * free) // self.bytes_per_token))

    @property
    def tokens_held(self) -> int:
        """Slots in use across the rows (committed tokens and the last forward's drafts)."""
        return sum(self.lengths)

    def _forget(self, seq: int) -> None:
        """Give the pages row `seq` wrote back to the OS (CPU only; a no-op for an unused row)."""
        if not self._lazy or not self._written[seq]:
            return
        L, S, Hkv, M, D = self.v.shape
        row = Hkv * M * D * self.k.element_size()  # one layer's [Hkv, M, D] block of this row (blocked keys too)
        for layer in range(L):
            for z in self._lazy:
                z.forget((layer * S + seq) * row, row)
        self._written[seq] = False

    def reserve(self, seq: int, num_new: int) -> int:
        """Claim the next `num_new` slots of `seq` for a forward; returns the first slot."""
        start = self.lengths[seq]
        if start + num_new > self.max_len:
            raise CacheFullError(f"sequence needs {start + num_new} slots; max_model_len is {self.max_len}")
        self.last_start[seq] = start
        self.lengths[seq] = start + num_new
        self._written[seq] = True
        return start

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Row `dst` (just allocated) starts with the first `length` slots of row `src`."""
        if not 0 < length <= self.lengths[src] or self.lengths[dst]:
            raise ValueError(f"cannot copy {length} slots of row {src} (length {self.lengths[src]}) into row {dst}")
        if self.keys_blocked:  # whole blocks: slots past `length` are never read before being written
            blocks = -(-length // KEY_BLOCK)
            self.k[:, dst, :, :blocks] = self.k[:, src, :, :blocks]
        else:
            self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
        self.slot_positions[dst, :length] = self.slot_positions[src, :length]
        self.lengths[dst] = self.last_start[dst] = length
        self._written[dst] = True

    def truncate(self, seq: int, length: int) -> None:
        """Keep the first `length` slots of `seq` (drops rejected draft tokens)."""
        if not 0 <= length <= self.lengths[seq]:
            raise ValueError(f"cannot truncate sequence of length {self.lengths[seq]} to {length}")
        self.lengths[seq] = length

    def keep(self, seq: int, rows: list[int]) -> None:
        """Keep rows `rows` (indices among the last forward's new tokens, in order) as the
        continuation of the committed prefix and drop the rest: a chain's accepted prefix is a
        truncation, a tree's accepted path a gather (commit_path)."""
        if rows == list(range(len(rows))):
            self.truncate(seq, self.last_start[seq] + len(rows))
        else:
            self.commit_path(seq, rows)

    def commit_path(self, seq: int, node_indices: list[int]) -> None:
        """Keep the tree nodes `node_indices` (indices among the last forward's new tokens, root
        first) as the contiguous continuation of the committed prefix.

        Example: the last forward wrote nodes 0..6 at slots 40..46 and the path 0 -> 2 -> 5 is
        accepted: slots 40, 42, 45 are copied to 40, 41, 42 and the length becomes 43.
        """
        base = self.last_start[seq]
        if any(not 0 <= i < self.lengths[seq] - base for i in node_indices):
            raise ValueError(f"node indices {node_indices} outside the last forward of sequence {seq}")
        src = torch.tensor([base + i for i in node_indices], dtype=torch.long, device=self.k.device)
        dst = slice(base, base + len(node_indices))
        if self.keys_blocked:  # slot s is block s // 16, lane s % 16 of [L, Hkv, M / 16, D, 16]
            to = torch.arange(base, base + len(node_indices), device=self.k.device)
            keys = self.k[:, seq]
            keys[:, :, to // KEY_BLOCK, :, to % KEY_BLOCK] = keys[:, :, src // KEY_BLOCK, :, src % KEY_BLOCK]
        else:
            self.k[:, seq, :, dst] = self.k[:, seq, :, src]
        self.v[:, seq, :, dst] = self.v[:, seq, :, src]
        self.slot_positions[seq, dst] = torch.arange(base, base + len(node_indices), device=self.k.device)
        self.lengths[seq] = base + len(node_indices)
