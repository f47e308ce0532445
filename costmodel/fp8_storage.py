"""What fp8 tensors cost in memory, per scaling recipe: Transformer Engine's (``TrainingSpec.fp8_recipe``, with
``transformer_engine_fp8``) and foldtune's executor's.

An fp8 tensor is one byte per element plus its scales. A GEMM input that Transformer Engine saves for the weight
gradient is kept in the one form that GEMM reads (``update_usage(rowwise_usage=False)`` in TE's linear modules
after the forward GEMM), a weight in both forms (rowwise for forward, columnwise for the input gradient). Scales:
one fp32 per tensor (tensorwise, delayed), one fp32 per 1x128 tile of an activation and per 128x128 tile of a
weight in each form (blockwise), one E8M0 byte per 32 elements in each form (mxfp8). The executor quantises with
its own rowwise scales (executor/kernels/fp8) and keeps each GEMM weight in both forms, 2 bytes per element plus
an fp32 scale per row (executor/kernels/fp8/weight_cache.py; the row scales are left out here, as before).
"""

from __future__ import annotations

from spec.training_spec import TrainingSpec

_FP32 = 4

#: Bytes per element of one saved fp8 GEMM input (one form, its scales included), per Transformer Engine recipe.
TE_SAVED_INPUT_BYTES = {"tensorwise": 1.0, "delayed": 1.0, "blockwise": 1.0 + _FP32 / 128, "mxfp8": 1.0 + 1 / 32}
#: Bytes per element of one fp8 GEMM weight in both forms (scales included), per Transformer Engine recipe.
TE_WEIGHT_BYTES = {"tensorwise": 2.0, "delayed": 2.0, "blockwise": 2.0 * (1.0 + _FP32 / (128 * 128)),
                   "mxfp8": 2.0 * (1.0 + 1 / 32)}
#: Bytes per element of the executor's cached fp8 GEMM weight (both forms).
EXECUTOR_FP8_WEIGHT_BYTES = 2.0


def te_saved_input_bytes(training: TrainingSpec) -> float | None:
    """Bytes per element of a GEMM input that Transformer Engine saves in fp8 for backward, or None when the GEMM
    inputs are saved at the activation width (not fp8, or the executor's fp8, which keeps its 16-bit inputs)."""
    if training.precision != "fp8" or not training.transformer_engine_fp8:
        return None
    return TE_SAVED_INPUT_BYTES[training.fp8_recipe]


def fp8_weight_extra_bytes(training: TrainingSpec) -> float:
    """Bytes per GEMM weight element beyond its ``param_bytes`` copy: the fp8 weight in both forms that fp8
    training keeps beside it (Transformer Engine's per-recipe cache, or the executor's), or, with
    ``fp8_param_gather`` (the weights themselves are fp8 tensors in both forms, no 16-bit copy), what those forms
    take beyond the 16-bit bytes they replace (their scales). 0 without fp8."""
    if training.precision != "fp8":
        return 0.0
    forms = TE_WEIGHT_BYTES[training.fp8_recipe] if training.transformer_engine_fp8 else EXECUTOR_FP8_WEIGHT_BYTES
    if training.fp8_param_gather:
        return forms - training.param_bytes
    return forms
