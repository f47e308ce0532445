"""What the gated activation of an MLP or expert costs beyond plain SwiGLU (executor/activation.py).

Plain SwiGLU (silu(gate)·up, no clamp, no offset) runs as one fused kernel that keeps only its input. Any
other gated unit (GPT-OSS's quick-GeGLU, a clamp, an offset on up) runs as separate torch ops, each of which
reads and writes whole [tokens, ffn] tensors and keeps its own inputs for backward. Counts are per element of
the activation's output (one FFN column of one token), 16-bit elements in the activation dtype.
"""

from __future__ import annotations

from spec.model_spec import ModelSpec


def is_plain_swiglu(model: ModelSpec) -> bool:
    """Whether the activation is silu(gate)·up with no clamp or offset (the executor's fused formula)."""
    return model.swiglu and model.activation_func_clamp_value is None and not model.glu_linear_offset


def glu_saved_intermediates(model: ModelSpec) -> int:
    """FFN-wide tensors the unfused gated activation keeps beyond its input and its output (0 when plain
    SwiGLU or not gated): the clamped gate (with a clamp), quick-GELU's sigmoid, the activated gate and the
    shifted or clamped up (with a clamp or an offset)."""
    if not model.gated_linear_unit or is_plain_swiglu(model):
        return 0
    clamp = model.activation_func_clamp_value is not None
    return int(clamp) + int(model.quick_geglu) + 1 + int(clamp or bool(model.glu_linear_offset))


def glu_traffic(model: ModelSpec) -> tuple[float, int]:
    """(elements read and written per output element in the forward, kernels) of the gated activation.

    Plain SwiGLU: read gate and up, write the product (3, one kernel). Unfused: two clamps (2 + 2), quick-GELU's
    scale, sigmoid and product (2 + 2 + 3) or SiLU (2), the offset (2) and the final product (3).
    """
    if is_plain_swiglu(model) or not model.gated_linear_unit:
        return 3.0, 1
    elements, kernels = 3.0, 1  # the final product
    if model.activation_func_clamp_value is not None:
        elements, kernels = elements + 4, kernels + 2
    if model.quick_geglu:
        elements, kernels = elements + 7, kernels + 3
    else:
        elements, kernels = elements + 2, kernels + 1
    if model.glu_linear_offset:
        elements, kernels = elements + 2, kernels + 1
    return elements, kernels
