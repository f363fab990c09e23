"""The target's forward cost curve for the adaptive speculation policy: measured once, then loaded.

Profiles are JSON files ({"sizes": [...], "seconds": [...]} at a "context"-token prefix, what
each key a row reads adds, "per_key" and "per_key_row", plus what they were measured on), cached
under the tandem cache dir keyed by model, quantization, dtype, device and threads, so a restart
does not pay the measurement again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from pathlib import Path

import torch

from tandem.model.cost import CONTEXT_FOR_CURVE, forward_cost_curve, prefix_costs
from tandem.model.kernels import block_kernels, cpu_name, kernel_description
from tandem.model.loader import LoadedModel
from tandem.paths import cache_root
from tandem.progress import progress
from tandem.scheduler.cost_model import CostCurve, fit_context_costs

log = logging.getLogger("tandem.server")

# Dense at small sizes (where batch-1 draft lengths are decided), sparse beyond; max_num_seqs
# (draft length + 1) past 96 is extrapolated linearly, which is how a compute-bound forward grows.
PROFILE_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 96)
PROFILE_ROUNDS = 5
# Sizes also measured at a LONG_CONTEXT-token prefix, to price the keys attention reads; a model
# whose positions stop short of MIN_EXTRA_KEYS past the curve's prefix prices every prefix alike.
# The difference is a fraction of a forward, so each pair is the fastest of more repeats.
CONTEXT_SIZES = (1, 2, 4, 8)
LONG_CONTEXT = 1000
CONTEXT_REPEATS = 15
# Profiles measured before the prefix was priced, or before a size that follows a larger one
# was settled first (cost.fastest_of), are measured anew.
PROFILE_FORMAT = "context-priced-settled"
MIN_EXTRA_KEYS = 256


def profile_key(loaded: LoadedModel, device: str, threads: int) -> str:
    """Names one measured curve: the model, its weights and dtype, the KV cache's dtype, the
    kernels that run them (a TANDEM_KERNELS override or a new kernel build measures anew) and
    the machine (the CPU's model name)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(loaded.name).name)
    dtype = str(loaded.dtype).replace("torch.", "")
    kv = str(loaded.kv_dtype(device)).replace("torch.", "")
    kernels = kernel_description() if loaded.kernels == "block" else loaded.kernels
    running = block_kernels() if loaded.kernels == "block" else None
    build = running.build_key if running is not None else ""  # new kernel code measures anew
    machine = cpu_name() if device == "cpu" else device
    digest = hashlib.sha1("|".join((loaded.name, kernels, build, machine, PROFILE_FORMAT)).encode()).hexdigest()[:8]
    variant = re.sub(r"[^A-Za-z0-9_.-]+", "_", kernels)
    return f"{name}-{digest}-{loaded.quantization}-{dtype}-kv_{kv}-{variant}-{device}-t{threads}"


def default_profile_path(loaded: LoadedModel, device: str, threads: int) -> Path:
    return cache_root() / "profiles" / f"{profile_key(loaded, device, threads)}.json"


def load_profile(path: str | Path) -> CostCurve:
    try:
        data = json.loads(Path(path).read_text())
        return CostCurve(tuple(int(n) for n in data["sizes"]), tuple(float(s) for s in data["seconds"]),
                         int(data.get("context", 0)), float(data.get("per_key", 0.0)),
                         float(data.get("per_key_row", 0.0)))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"cannot read the cost profile {path}: {err}; delete it or pass --reprofile to measure again"
        ) from err


def save_profile(curve: CostCurve, path: str | Path, meta: dict) -> None:
    """Written beside the target and renamed: a server or test starting meanwhile reads the old
    profile or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**meta, "sizes": list(curve.sizes), "seconds": list(curve.seconds),
                               "context": curve.context, "per_key": curve.per_key,
                               "per_key_row": curve.per_key_row}, indent=1))
    os.replace(tmp, path)


def cost_curve_for(
    loaded: LoadedModel, device: str, threads: int, path: str | None = None, remeasure: bool = False
) -> CostCurve:
    """The saved profile at `path` (default: the cache), or measure it now and save it there."""
    target = Path(path) if path else default_profile_path(loaded, device, threads)
    if target.exists() and not remeasure:
        curve = load_profile(target).convex()  # profiles saved before the curves were made convex
        log.info("forward cost curve from %s", target)
        return curve
    # Rounds over every size, keeping each size's fastest time: on a shared CPU other tenants only
    # ever add time, and a burst of theirs hits one round of all sizes rather than one size.
    points: dict[int, float] = {}
    for _ in progress(range(PROFILE_ROUNDS), desc="profiling forward cost (once per model/threads)", unit="round"):
        for n, seconds in forward_cost_curve(loaded, repeats=1, sizes=PROFILE_SIZES).items():
            points[n] = min(seconds, points.get(n, seconds))
    # A row never costs less than the rows before it (a scheduler prices rows by differences).
    curve = CostCurve.from_points(points).monotone().convex()
    # The same sizes at a longer prefix: what each key a row reads adds (CostCurve.context_seconds).
    long_context = min(LONG_CONTEXT, loaded.config.max_position_embeddings - max(CONTEXT_SIZES) - 1)
    if long_context >= CONTEXT_FOR_CURVE + MIN_EXTRA_KEYS:
        both = prefix_costs(loaded, CONTEXT_SIZES, (CONTEXT_FOR_CURVE, long_context), repeats=CONTEXT_REPEATS)
        per_key, per_key_row = fit_context_costs(both[CONTEXT_FOR_CURVE], both[long_context],
                                                 long_context - CONTEXT_FOR_CURVE)
        curve = dataclasses.replace(curve, context=CONTEXT_FOR_CURVE, per_key=per_key, per_key_row=per_key_row)
    log.info("forward cost curve saved to %s", target)
    save_profile(curve, target, {"model": loaded.name, "quantization": loaded.quantization,
                                 "dtype": str(loaded.dtype), "device": device, "threads": threads,
                                 "torch": torch.__version__})
    return curve
