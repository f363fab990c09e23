"""tandem's own CPU kernels (block_matmul.cpp): block-quantized weights times int8-quantized
activations, a small-batch GEMM that reads each weight block once for every row of a call, the
decoder layer loop in one native call, and sampling (the default processing of a row of logits,
draws from it and the chain rule of verification).

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

from tandem.model.kernels.build import block_kernels, kernel_description, load_variant
from tandem.model.kernels.cpu import (
    KERNEL_CHOICES,
    VARIANT_NAMES,
    VARIANTS,
    cpu_flags,
    cpu_model,
    cpu_name,
    selected_variant,
    supported_variants,
)
from tandem.model.kernels.library import BlockKernels
from tandem.model.kernels.records import (
    GEGLU,
    IDENTITY,
    RMS_NORM,
    RMS_NORM_HALVES,
    SWIGLU,
    BlockWeights,
    DecoderShape,
    DraftChain,
    DraftLayer,
    DraftRows,
    LayerParts,
    RowProcessing,
    SampleStatus,
    TreeKeys,
    decoder_layers,
)

# The package's face: the kernels, what they read, and which variant runs here.
__all__ = [
    "GEGLU", "IDENTITY", "KERNEL_CHOICES", "RMS_NORM", "RMS_NORM_HALVES", "SWIGLU", "VARIANTS", "VARIANT_NAMES",
    "BlockKernels", "BlockWeights", "DecoderShape", "DraftChain", "DraftLayer", "DraftRows", "LayerParts",
    "RowProcessing", "SampleStatus", "TreeKeys",
    "block_kernels", "cpu_flags", "cpu_model", "cpu_name", "decoder_layers", "kernel_description", "load_variant",
    "selected_variant", "supported_variants",
]
