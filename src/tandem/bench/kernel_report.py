"""The kernel part of `tandem bench base`: what the CPU allows and how close tandem's step gets.

All measured in the same run: read bandwidth, the int8 multiply-add peak of the running kernel
variant and what its q4 GEMM reaches with its weights in L1 (the ceiling of its instruction mix),
the bytes a decode step must read (tandem's and the GGUF's own) and the floor they give,
tandem's decode step at a stated context and its cost curve for n = 1..32 new tokens, the cost of
each extra verified row against the peak, and torch's bf16 dense matmuls over the same linears as
the reference of what this CPU does for small batches.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from tandem.model.block_linear import BlockQ4Linear, BlockQ8Linear
from tandem.model.cost import fastest_of, forward_cost_curve
from tandem.model.kernels import block_kernels, cpu_flags, cpu_model, cpu_name, kernel_description

CURVE = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32)
STEP_CONTEXT = 300
ISA_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16")
# Where a CPU has none of these, oneDNN multiplies bf16 by widening it to fp32 first.
BF16_MULTIPLY_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass
class KernelReport:
    cpu: str
    cpu_model: str | None  # "family F model M": which generation the name covers
    isa: list[str]
    kernels: str
    threads: int
    bandwidth_gb_s: float
    int8_peak_gmac_s: float | None
    tandem_bytes: int
    gguf_bytes: int | None
    floor_ms: float | None
    macs_per_row: int
    context: int
    step_ms: float
    curve: dict[int, float]  # n -> time relative to n = 1
    extra_row_ms: float  # (c(16) - c(1)) / 15, in ms
    extra_row_efficiency: float | None  # the row's multiply-adds at peak / its measured cost
    bf16_step_ms: float | None = None
    bf16_curve: dict[int, float] = field(default_factory=dict)
    q4_cached_gmac_s: float | None = None  # the q4 GEMM over 8 rows with its weights in L1

    def as_dict(self) -> dict:
        return asdict(self)


def measure_bandwidth(mb: int = 1024, repeats: int = 7) -> float:
    """Read bandwidth in GB/s with all threads: the best of several `sum()` passes over `mb` MB."""
    x = torch.ones(mb * 1024 * 1024 // 4)
    return x.numel() * 4 / fastest_of(lambda _: x.sum(), (1,), repeats)[1] / 1e9


def gguf_step_bytes(path) -> int:
    """Bytes of the GGUF's own tensors a decode step reads: all of them, except the token
    embedding when a separate output matrix serves as the LM head (then it is only a lookup)."""
    from gguf import (
        GGUFReader,  # lazy: keeps `tandem --help` fast; only a GGUF target reads one
    )

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def model_weight_bytes(model: torch.nn.Module, skip: tuple[str, ...] = ("embed",)) -> int:
    """Bytes one decode step must read: every weight except the embedding table (a lookup);
    block-quantized linears count as the kernels read them (packed codes, fp16 scales)."""
    kernels = block_kernels()
    total, counted = 0, set()
    for name, mod in model.named_modules():
        if kernels is not None and isinstance(mod, (BlockQ4Linear, BlockQ8Linear)):
            packed = mod.blocks(kernels)
            total += packed.nbytes + (0 if packed.bias is None else packed.bias.numel() * 4)
            counted.update(f"{name}.{b}" for b, _ in mod.named_buffers())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name not in counted and not any(name == s or name.startswith(s + ".") for s in skip):
            total += t.numel() * t.element_size()
    return total


def linear_macs(model) -> int:
    """Multiply-adds of one token row through every linear and the LM head."""
    macs = 0
    for layer in model.layers:
        for mod in (layer.qkv, layer.o, layer.gate_up, layer.down):
            macs += mod.in_features * mod.out_features
    return macs + model.lm_head.in_features * model.lm_head.out_features


def bf16_dense_curve(model, repeats: int = 5, sizes=CURVE) -> dict[int, float]:
    """torch's bf16 F.linear (oneDNN) over the same linears and LM head, back to back: what
    this CPU does for small batches when a kernel reuses each weight across rows."""
    weights = [mod.dequantize(torch.bfloat16) for layer in model.layers
               for mod in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    weights.append(model.lm_head.dequantize(torch.bfloat16))
    inputs = {n: [torch.randn(n, w.shape[1], dtype=torch.bfloat16) for w in weights] for n in sizes}

    def run(n):
        for w, x in zip(weights, inputs[n]):
            F.linear(x, w)

    with torch.inference_mode():
        return fastest_of(run, sizes, repeats, size=int)  # measured as tandem's curve is


def kernel_report(loaded, gguf_path=None, with_bf16: bool = True) -> KernelReport:
    model = loaded.model
    bandwidth = measure_bandwidth()
    k = block_kernels() if loaded.kernels == "block" else None
    # Peaks are what the CPU can do, so the best reading counts: measured before and after the
    # curve, since a shared host can slow a whole second (a run here read 247 GMAC/s where its
    # neighbours read 430-533).
    peak = k.int8_peak() if k is not None else None
    cached = k.q4_cached_peak() if k is not None else None
    gguf = gguf_step_bytes(gguf_path) if gguf_path is not None else None
    seconds = forward_cost_curve(loaded, repeats=20, sizes=CURVE, context=STEP_CONTEXT)
    if k is not None:
        peak, cached = max(peak, k.int8_peak()), max(cached, k.q4_cached_peak())
    macs = linear_macs(model)
    extra = (seconds[16] - seconds[1]) / 15
    bf16 = bf16_dense_curve(model) if with_bf16 else {}
    flags = cpu_flags()
    return KernelReport(
        cpu=cpu_name(), cpu_model=cpu_model(), isa=[f for f in ISA_FLAGS if f in flags], threads=torch.get_num_threads(),
        kernels=kernel_description() if loaded.kernels == "block" else loaded.kernels,
        bandwidth_gb_s=bandwidth, int8_peak_gmac_s=peak / 1e9 if peak else None,
        tandem_bytes=model_weight_bytes(model), gguf_bytes=gguf,
        floor_ms=gguf / (bandwidth * 1e9) * 1e3 if gguf else None, macs_per_row=macs, context=STEP_CONTEXT,
        step_ms=seconds[1] * 1e3, curve={n: s / seconds[1] for n, s in seconds.items()}, extra_row_ms=extra * 1e3,
        extra_row_efficiency=macs / peak / extra if peak else None,
        bf16_step_ms=bf16[1] * 1e3 if bf16 else None, bf16_curve={n: s / bf16[1] for n, s in bf16.items()},
        q4_cached_gmac_s=cached / 1e9 if cached else None,
    )


def print_kernel_report(r: KernelReport) -> None:
    model = f" {r.cpu_model}" if r.cpu_model else ""
    print(f"CPU: {r.cpu}{model} ({' '.join(r.isa)}); {r.threads} threads; quantized linears on {r.kernels}")
    print(f"read bandwidth {r.bandwidth_gb_s:.1f} GB/s (best of 7 sum() passes over 1 GB)", end="")
    print(f"; int8 peak {r.int8_peak_gmac_s:.0f} GMAC/s (register loop)" if r.int8_peak_gmac_s else "")
    if r.q4_cached_gmac_s and r.int8_peak_gmac_s:
        print(f"q4 GEMM over 8 rows, its weights in L1: {r.q4_cached_gmac_s:.0f} GMAC/s = "
              f"{r.q4_cached_gmac_s / r.int8_peak_gmac_s * 100:.0f}% of the peak (the ceiling of its instruction mix)")
    gguf = f", the GGUF's own {r.gguf_bytes / 1e6:.0f} MB" if r.gguf_bytes else ""
    print(f"weights read per step: tandem {r.tandem_bytes / 1e6:.0f} MB{gguf}")
    if r.floor_ms:
        print(f"decode step at a {r.context}-token context: {r.step_ms:.2f} ms = {r.step_ms / r.floor_ms:.2f}x "
              f"the weight-read floor {r.floor_ms:.2f} ms (GGUF bytes / bandwidth)")
    else:
        print(f"decode step at a {r.context}-token context: {r.step_ms:.2f} ms")
    print("cost curve c(n) = forward over n new tokens / over 1:")
    print("  n        " + " ".join(f"{n:>5}" for n in r.curve))
    print("  tandem   " + " ".join(f"{c:5.2f}" for c in r.curve.values()))
    if r.bf16_curve:
        print("  bf16 F.linear reference (same linears + LM head, step %.2f ms):" % r.bf16_step_ms)
        print("           " + " ".join(f"{c:5.2f}" for c in r.bf16_curve.values()))
        if not set(BF16_MULTIPLY_FLAGS) & set(r.isa):
            print("  (this CPU has no bf16 multiply instructions (AVX512-BF16, AMX-BF16): oneDNN widens the weights "
                  "to fp32 for each product, so this line is not the small-batch reference it is where they exist)")
    eff = f" = {r.extra_row_efficiency * 100:.0f}% of the int8 peak" if r.extra_row_efficiency else ""
    if r.extra_row_efficiency and r.q4_cached_gmac_s:
        of_ceiling = r.extra_row_efficiency * r.int8_peak_gmac_s / r.q4_cached_gmac_s
        eff += f", {of_ceiling * 100:.0f}% of the q4 GEMM's ceiling"
    print(f"each extra verified row (n = 1..16): {r.extra_row_ms:.2f} ms for {r.macs_per_row / 1e6:.0f}M "
          f"multiply-adds{eff}")
