"""Hidden-state capture: the target runs over prompt + answer, and the hidden states of the layers
a head needs become training batches.

`capture` stores them on disk (bf16 safetensors shards, resumable, memory bounded);
`capture_in_memory` keeps them in device memory; `CapturedData` serves either as batches.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tandem.drafters.heads.base import TrainBatch
from tandem.model.kv_cache import KVCache
from tandem.model.runner import ModelRunner, SeqInput
from tandem.paths import save_safetensors
from tandem.progress import progress
from tandem.train.data import atomic_write, check_cache_meta

log = logging.getLogger("tandem.train")


@dataclass(frozen=True)
class Sequence:
    """One self-distilled training sequence: prompt + the target's answer."""

    key: str
    token_ids: list[int]
    prompt_len: int


def sequences(records: list[dict]) -> list[Sequence]:
    """Records with a non-empty answer -> sequences (skipped prompts drop out here)."""
    return [Sequence(r["key"], r["prompt_ids"] + r["answer_ids"], len(r["prompt_ids"])) for r in records if r["answer_ids"]]


def capture(
    loaded,
    seqs: list[Sequence],
    directory: str | Path,
    layers: tuple[int, ...],
    shard_size: int = 64,
    batch_size: int = 8,
    store_dtype: torch.dtype = torch.bfloat16,
    desc: str = "capture",
) -> list[Path]:
    """Run the target over every sequence; store the hidden states of `layers` in shards.

    Shard capture-NNNNN.safetensors holds, for its sequences concatenated: token_ids [N] int32,
    offsets [S + 1] (sequence s is rows offsets[s]:offsets[s+1]), prompt_lens [S], and
    hidden.<layer> [N, H] in `store_dtype`. Layer convention: i < L is decoder layer i's output,
    L the final normed hidden state. Shards already on disk (same keys) are kept, so a rerun
    resumes after the last finished shard.
    """
    return write_captures(loaded.name, loaded.config.num_layers, engine_forward_factory(loaded, batch_size), seqs,
                          directory, layers, shard_size, batch_size, store_dtype, desc)


def engine_forward_factory(loaded, batch_size: int):
    """forward_factory (see write_captures) running the target through tandem's engine."""
    def forward_factory(max_len: int):
        device = loaded.model.embed.device
        cache = KVCache(loaded.config, batch_size, max_len, loaded.dtype, device, loaded.kv_dtype(device))
        runner = ModelRunner(loaded.model, cache)

        def forward(group: list[Sequence], wanted: tuple[int, ...]) -> dict[int, list[torch.Tensor]]:
            rows = [cache.allocate() for _ in group]
            try:
                return runner.forward([SeqInput(r, s.token_ids) for r, s in zip(rows, group)], hidden_layers=wanted).hidden
            finally:
                for r in rows:
                    cache.release(r)

        return forward

    return forward_factory


def write_captures(target_name: str, num_layers: int, forward_factory, seqs: list[Sequence], directory: str | Path,
                   layers: tuple[int, ...], shard_size: int = 64, batch_size: int = 8,
                   store_dtype: torch.dtype = torch.bfloat16, desc: str = "capture") -> list[Path]:
    """The resumable shard loop of `capture`, whatever runs the target.

    forward_factory(longest sequence) -> forward(sequences, layers) -> {layer: [hidden [n_s, H] per sequence]}.
    """
    directory = Path(directory)
    layers = tuple(sorted(set(layers)))
    if any(not 0 <= layer <= num_layers for layer in layers):
        raise ValueError(f"hidden layers must lie in [0, {num_layers}] for {target_name}, got {layers}")
    check_cache_meta(directory, {"target": target_name, "layers": list(layers), "dtype": str(store_dtype)})
    shards = [seqs[i : i + shard_size] for i in range(0, len(seqs), shard_size)]
    paths = [directory / f"capture-{i:05d}.safetensors" for i in range(len(shards))]
    todo = [i for i, (chunk, path) in enumerate(zip(shards, paths)) if _shard_keys(path) != [s.key for s in chunk]]
    if not todo:
        return paths
    forward = forward_factory(max(len(s.token_ids) for i in todo for s in shards[i]))
    bar = progress(total=sum(len(shards[i]) for i in todo), desc=desc, unit="seq")
    for i in todo:
        tensors = _shard_tensors(shards[i], forward, layers, batch_size, "cpu", store_dtype, bar)
        meta = {"keys": json.dumps([s.key for s in shards[i]])}
        atomic_write(paths[i], lambda p: save_safetensors(tensors, p, metadata=meta))
    bar.close()
    return paths


def _shard_tensors(chunk: list[Sequence], forward, layers: tuple[int, ...], batch_size: int, device,
                   store_dtype: torch.dtype, bar) -> dict[str, torch.Tensor]:
    """One shard's tensors (the layout `capture` documents), its hidden states stored on `device`."""
    hidden: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    for start in range(0, len(chunk), batch_size):
        group = chunk[start : start + batch_size]
        out = forward(group, layers)
        for layer in layers:
            hidden[layer].extend(h.to(device, store_dtype) for h in out[layer])
        bar.update(len(group))
    lengths = torch.tensor([len(s.token_ids) for s in chunk])
    tensors = {
        "token_ids": torch.tensor([t for s in chunk for t in s.token_ids], dtype=torch.int32),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "prompt_lens": torch.tensor([s.prompt_len for s in chunk]),
        **{f"hidden.{layer}": torch.cat(hidden[layer]).contiguous() for layer in layers},
    }
    return {name: t.to(device) for name, t in tensors.items()}


def capture_in_memory(forward_factory, seqs: list[Sequence], layers: tuple[int, ...], device: str | torch.device,
                      max_prompt_context: int | None = None, shard_size: int = 64, batch_size: int = 32,
                      store_dtype: torch.dtype = torch.bfloat16, desc: str = "capture") -> "CapturedData":
    """The hidden states of `capture`, kept in `device` memory instead of written to disk.

    For a GPU with room for them (tokens x layers x hidden x 2 bytes): nothing is written, no
    shard is read back, and the whole prompt fits in the context at no disk cost. Sequences are
    grouped by length into shards, so a batch (drawn within a shard) pads little. Recomputed by
    every run: the forwards cost far less than reading the shards back.
    """
    if not seqs:
        raise ValueError("no captured shards: the training set is empty (no prompt got an answer)")
    layers = tuple(sorted(set(layers)))
    ordered = sorted(seqs, key=lambda s: len(s.token_ids))
    chunks = [ordered[i : i + shard_size] for i in range(0, len(ordered), shard_size)]
    forward = forward_factory(len(ordered[-1].token_ids))
    bar = progress(total=len(ordered), desc=desc, unit="seq")
    shards = [_shard_tensors(chunk, forward, layers, batch_size, device, store_dtype, bar) for chunk in chunks]
    bar.close()
    size = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
    log.info("%s: %d sequences, %.2f GB in %s memory", desc, len(ordered), size / 1e9, device)
    return CapturedData.resident(shards, layers, max_prompt_context)


def _shard_keys(path: Path) -> list[str] | None:
    if not path.exists():
        return None
    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["keys"])


def _check_context(max_prompt_context: int | None) -> None:
    if max_prompt_context is not None and max_prompt_context < 1:
        raise ValueError(f"max_prompt_context must be >= 1, got {max_prompt_context}")


class CapturedData:
    """Captured shards as training batches, one shard in memory at a time.

    The batch order of an epoch is a pure function of (seed, epoch): shards in a shuffled order,
    sequences shuffled within their shard. A resumed run therefore replays exactly the batches an
    uninterrupted run would have seen from the same step on.
    """

    def __init__(self, paths: list[Path], layers: tuple[int, ...], max_prompt_context: int | None = None) -> None:
        """max_prompt_context: keep only the last N prompt tokens of each sequence in its batch rows
        (the loss is on answer tokens; a long prompt would otherwise pad every row of its batch)."""
        _check_context(max_prompt_context)
        self.max_prompt_context = max_prompt_context
        if not paths:
            raise ValueError("no captured shards: the training set is empty (no prompt got an answer)")
        self.paths, self.layers = list(paths), tuple(layers)
        self.counts = []
        for path in self.paths:
            with safe_open(str(path), "pt") as f:
                missing = [layer for layer in self.layers if f"hidden.{layer}" not in f.keys()]
                if missing:
                    raise ValueError(f"{path} has no hidden states of layers {missing}; capture them again")
                self.counts.append(len(json.loads(f.metadata()["keys"])))
        self._loaded: tuple[int, dict[str, torch.Tensor]] | None = None
        self._resident: list[dict[str, torch.Tensor]] | None = None

    @classmethod
    def resident(cls, shards: list[dict[str, torch.Tensor]], layers: tuple[int, ...],
                 max_prompt_context: int | None = None) -> "CapturedData":
        """Shards already in memory (capture_in_memory), in the layout of the files."""
        _check_context(max_prompt_context)
        data = cls.__new__(cls)
        data.max_prompt_context, data.paths, data.layers = max_prompt_context, [], tuple(layers)
        data.counts = [len(shard["prompt_lens"]) for shard in shards]
        data._loaded, data._resident = None, shards
        return data

    @property
    def num_sequences(self) -> int:
        return sum(self.counts)

    def epoch_plan(self, epoch: int, batch_size: int, seed: int) -> list[tuple[int, list[int]]]:
        """[(shard index, sequence indices)] batches of one epoch."""
        rng = random.Random(seed * 1_000_003 + epoch)
        order = list(range(len(self.counts)))
        rng.shuffle(order)
        plan = []
        for shard in order:
            idx = list(range(self.counts[shard]))
            rng.shuffle(idx)
            plan.extend((shard, idx[i : i + batch_size]) for i in range(0, len(idx), batch_size))
        return plan

    def in_order(self, batch_size: int) -> list[tuple[int, list[int]]]:
        """Every sequence once, in storage order (evaluation)."""
        return [(s, list(range(i, min(i + batch_size, n)))) for s, n in enumerate(self.counts) for i in range(0, n, batch_size)]

    def to_device(self, device: str | torch.device) -> "CapturedData":
        """Keep every shard resident on `device` (the layers this data serves only), so batches
        are assembled there: on a GPU, host-side assembly and copies would bound the step time."""
        if self._resident is not None:  # already in memory
            self._resident = [{name: t.to(device) for name, t in shard.items()} for shard in self._resident]
            return self
        keep = ["token_ids", "offsets", "prompt_lens", *(f"hidden.{layer}" for layer in self.layers)]
        self._resident = []
        for path in self.paths:
            with safe_open(str(path), "pt") as f:
                self._resident.append({name: f.get_tensor(name).to(device) for name in keep})
        return self

    def _shard(self, shard: int) -> dict[str, torch.Tensor]:
        if self._resident is not None:
            return self._resident[shard]
        if self._loaded is None or self._loaded[0] != shard:
            self._loaded = (shard, load_file(str(self.paths[shard])))
        return self._loaded[1]

    def batch(self, shard: int, indices: list[int], device: str | torch.device = "cpu"):
        """Right-padded TrainBatch (hidden states as float32) of the given sequences."""
        data = self._shard(shard)
        offsets, prompt_lens = data["offsets"].tolist(), data["prompt_lens"].tolist()
        spans = [(offsets[i], offsets[i + 1], prompt_lens[i]) for i in indices]
        if self.max_prompt_context is not None:  # drop the prompt's head (positions are relative)
            keep = self.max_prompt_context
            spans = [(lo + max(0, p - keep), hi, min(p, keep)) for lo, hi, p in spans]
        B, T = len(spans), max(hi - lo for lo, hi, _ in spans)
        at = data["token_ids"].device  # where the shard lives: assembled there, then moved
        token_ids = torch.zeros(B, T, dtype=torch.long, device=at)
        loss_mask = torch.zeros(B, T, dtype=torch.bool, device=at)
        hidden = {layer: torch.zeros(B, T, data[f"hidden.{layer}"].shape[-1], device=at) for layer in self.layers}
        for b, (lo, hi, p) in enumerate(spans):
            n = hi - lo
            token_ids[b, :n] = data["token_ids"][lo:hi].long()
            # Position t learns to predict token t + 1 when that token belongs to the answer.
            loss_mask[b, p - 1 : n - 1] = True
            for layer in self.layers:
                hidden[layer][b, :n] = data[f"hidden.{layer}"][lo:hi].float()
        lengths = torch.tensor([hi - lo for lo, hi, _ in spans])
        return TrainBatch(
            token_ids.to(device), lengths.to(device), loss_mask.to(device),
            {layer: h.to(device) for layer, h in hidden.items()},
        )
