"""FP8 training GEMMs with dynamic ("current") rowwise scaling, through torch's scaled (grouped) GEMMs.

Every GEMM here is C = A·Bᵀ with both operands quantised to e4m3 along the contraction dim: each row of
A [M, K] and of B [N, K] gets its own fp32 scale amax/448 (448: e4m3's largest finite value), the kernel
multiplies the e4m3 values (products exact), accumulates in fp32, applies scale_a[m]·scale_b[n] in its
epilogue and writes bf16. The three GEMMs of a linear layer all take that form, each operand quantised
along the axis its GEMM contracts:

    forward  y  = x·wᵀ     A = x [M, K]     B = w [N, K]
    dgrad    dx = dy·w     A = dy [M, N]    B = wᵀ [K, N]
    wgrad    dw = dyᵀ·x    A = dyᵀ [N, M]   B = xᵀ [K, M]

so no quantised copy serves two GEMMs; autograd saves the bf16 inputs, as on the bf16 path (fp8 buys GEMM
throughput here, not activation memory). Parameters, activations and gradients stay bf16.

One module a job:

- :mod:`.quantize`: e4m3 quantisation (per-row fp32 scales, e4m3 bytes) in torch ops, the reference, and in
  Triton on CUDA, with the first-use check of the Triton paths against the torch ops; the expert wgrad's
  padded per-expert layout.
- :mod:`.weight_cache`: weights quantised once per value, not per call.
- :mod:`.gemm`: where the kernels run (with their first-use check against the emulation), the scaled GEMMs
  (``torch._scaled_mm``, ``torch._scaled_grouped_mm``) and their emulation, and the autograd functions
  behind :func:`linear` and :func:`grouped_mm`.
- :mod:`.backend`: :class:`TorchFp8Backend`, the 'torch-fp8' kernel backend.
- :mod:`.grouped_quant` and :mod:`.grouped_gemm`: foldtune's own persistent grouped fp8 GEMM for the experts
  (rowwise or DeepSeek-V3 blockwise scaling), which ``ExecutorOptions.fp8_expert_gemm`` puts in place of
  torch's; imported from their modules (``from executor.kernels.fp8 import grouped_gemm``).
- :mod:`.expert_pick`: fp8 or bf16 per expert GEMM shape, fp8 where its first call timed it faster by more than
  ``spec.fp8_choice.FP8_CHOICE_MARGIN``
  (``ExecutorOptions.fp8_expert_gemm`` 'fastest', the default).

Imports run one way, quantize ← weight_cache ← gemm ← backend: each self-check sits in the module whose
paths it checks, beside the gate that reads its verdict.

This module re-exports their public names (``from executor.kernels.fp8 import X``). Private helpers and the
module-level state (``_CHECKED`` in quantize and gemm, ``_COUNTS``, ``_WEIGHT_CACHE``, ``_WEIGHT_COUNTS``)
live in the module that owns them: read and patch them there.
"""

from __future__ import annotations

from executor.kernels.fp8.backend import TorchFp8Backend
from executor.kernels.fp8.gemm import (
    OUT,
    emulation_reason,
    fp8_wgrad,
    gemm_counts,
    reset_gemm_counts,
    grouped_mm,
    kernels_ok,
    linear,
    scaled_grouped_nt,
    scaled_grouped_wgrad,
    scaled_mm_nt,
)
from executor.kernels.fp8.quantize import (
    ALIGN,
    E4M3,
    E4M3_MAX,
    FP32_TINY,
    INV_E4M3_MAX,
    TILES,
    PaddedGroups,
    dequantize,
    padded_groups,
    quantize_groups_colwise,
    quantize_rowwise,
)
from executor.kernels.fp8.weight_cache import (clear_weight_cache, quantized_weight, reset_weight_counts,
                                               weight_cache_enabled, weight_counts)

__all__ = [
    "ALIGN", "E4M3", "E4M3_MAX", "FP32_TINY", "INV_E4M3_MAX", "OUT", "TILES", "PaddedGroups", "TorchFp8Backend", "clear_weight_cache", "dequantize", "emulation_reason",
    "fp8_wgrad", "gemm_counts", "grouped_mm", "kernels_ok", "linear", "padded_groups", "quantize_groups_colwise",
    "reset_gemm_counts", "reset_weight_counts",
    "quantize_rowwise", "quantized_weight", "scaled_grouped_nt", "scaled_grouped_wgrad", "scaled_mm_nt",
    "weight_cache_enabled", "weight_counts",
]
