"""The gated activation of a model's MLPs and experts: SwiGLU, or GPT-OSS's clamped quick-GeGLU.

Megatron's names: ``swiglu`` is silu(gate)·up; ``quick_geglu`` is quick_gelu(gate)·up with quick_gelu(x) =
x·sigmoid(1.702·x); ``activation_func_clamp_value`` c clamps gate to (−∞, c] and up to [−c, c] before the
product; ``glu_linear_offset`` is added to up (GPT-OSS: c = 7, offset 1).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from spec.model_spec import ModelSpec

QUICK_GELU_ALPHA = 1.702


def _glu(gate: torch.Tensor, up: torch.Tensor, quick: bool, clamp: float | None, offset: float) -> torch.Tensor:
    if clamp is not None:
        gate = gate.clamp(max=clamp)
        up = up.clamp(-clamp, clamp)
    act = gate * torch.sigmoid(QUICK_GELU_ALPHA * gate) if quick else F.silu(gate)
    return act * (up + offset) if offset else act * up


def is_plain_swiglu(spec: ModelSpec) -> bool:
    """Whether the activation is silu(gate)·up with no clamp or offset (the fused kernels' formula)."""
    return spec.swiglu and spec.activation_func_clamp_value is None and not spec.glu_linear_offset


def gated_activation(spec: ModelSpec) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """act(gate, up) → [..., f] for ``spec``'s gated linear unit (gate and up of equal shape)."""
    return partial(_glu, quick=spec.quick_geglu, clamp=spec.activation_func_clamp_value,
                   offset=spec.glu_linear_offset)


def mlp_activation(spec: ModelSpec) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """What a dense MLP or shared expert applies to (gate, up): None for plain SwiGLU (its own expression)."""
    return None if is_plain_swiglu(spec) else gated_activation(spec)


def fused_rows_activation(spec: ModelSpec) -> Callable[[torch.Tensor], torch.Tensor]:
    """act of a fused gate/up GEMM's output [rows, 2f] (gate = first half) → [rows, f], torch formula."""
    act = gated_activation(spec)

    def on_rows(x_M2F: torch.Tensor) -> torch.Tensor:
        f = x_M2F.shape[1] // 2
        return act(x_M2F[:, :f], x_M2F[:, f:])
    return on_rows
