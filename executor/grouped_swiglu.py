"""The routed experts' SwiGLU FFN as one autograd node: grouped GEMM (gate|up) → SwiGLU → grouped GEMM (down).

Autograd would build three nodes (two ``torch._grouped_mm`` and the SwiGLU) and the engine would visit each
with its own bookkeeping; at the fine-grained shapes (Qwen3-30B-A3B: 128 experts of ffn 768, 256 rows each
at 4096 tokens) the layer is short enough on the GPU that the host's time to issue it sets its speed. One
node issues the same kernels with less host work: forward the two GEMMs and the SwiGLU, backward

    d_act  = gy · w2[e]                      (grouped, [M, F])
    d_w2   = Σ_rows gyᵀ · act                 (grouped over the row dimension, [E, H, F])
    d_gu   = SwiGLU'(gate_up) · d_act         ([M, 2F])
    dx     = d_gu · w13[e]                   (grouped, [M, H])
    d_w13  = Σ_rows d_guᵀ · x                 (grouped over the row dimension, [E, 2F, H]: w13's own layout)

Notation: M rows sorted by expert, E local experts, H hidden, F the (ETP-sliced) expert FFN size; ``offs``
the cumulative rows per expert (int32, last = M). With ``recompute_act`` (selective recompute of
``moe_act``) the activation is not kept and is recomputed from ``gate_up`` in backward, as Megatron's
moe_act recompute does. Used where the plain torch backend runs the experts (``torch._grouped_mm``
available, plain SwiGLU, no expert biases); everything else keeps the autograd path.
"""

from __future__ import annotations

import torch

from executor.kernels import triton_swiglu as fused_act


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up of [M, 2F] → [M, F] (no autograd)."""
    f = gate_up.shape[1] // 2
    if fused_act.available(gate_up) and fused_act.swiglu_checked(gate_up.dtype, gate_up.device):
        return fused_act._forward(gate_up[:, :f], gate_up[:, f:], 2 * f)
    return torch.nn.functional.silu(gate_up[:, :f]) * gate_up[:, f:]


def _swiglu_grad(gate_up: torch.Tensor, d_act: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`_swiglu` w.r.t. its [M, 2F] input, given the output's gradient ``d_act``."""
    f = gate_up.shape[1] // 2
    d_gate_up = torch.empty_like(gate_up)
    if fused_act.available(gate_up) and fused_act.swiglu_checked(gate_up.dtype, gate_up.device):
        fused_act._backward(gate_up[:, :f], gate_up[:, f:], d_act.contiguous(), d_gate_up[:, :f],
                            d_gate_up[:, f:], 2 * f)
        return d_gate_up
    g, u = gate_up[:, :f].float(), gate_up[:, f:].float()
    s = torch.sigmoid(g)
    d = d_act.float()
    d_gate_up[:, :f] = d * u * s * (1.0 + g * (1.0 - s))  # d silu(g)/dg = s · (1 + g · (1 − s))
    d_gate_up[:, f:] = d * g * s
    return d_gate_up


class _GroupedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MH, w13_E2FH, w2_EHF, offs_E, recompute_act):
        w13 = w13_E2FH.flatten(1, 2)  # [E, 2F, H]
        gate_up = torch._grouped_mm(x_MH, w13.transpose(-2, -1), offs=offs_E)
        act = _swiglu(gate_up)
        y = torch._grouped_mm(act, w2_EHF.transpose(-2, -1), offs=offs_E)
        ctx.recompute_act = recompute_act
        ctx.save_for_backward(x_MH, w13_E2FH, w2_EHF, offs_E, gate_up, None if recompute_act else act)
        return y

    @staticmethod
    def backward(ctx, gy_MH):
        x_MH, w13_E2FH, w2_EHF, offs_E, gate_up, act = ctx.saved_tensors
        if ctx.recompute_act:
            act = _swiglu(gate_up)
        gy_MH = gy_MH.contiguous()
        d_act = torch._grouped_mm(gy_MH, w2_EHF, offs=offs_E)
        d_w2 = torch._grouped_mm(gy_MH.t(), act, offs=offs_E) if ctx.needs_input_grad[2] else None
        d_gate_up = _swiglu_grad(gate_up, d_act)
        w13 = w13_E2FH.flatten(1, 2)
        dx = torch._grouped_mm(d_gate_up, w13, offs=offs_E) if ctx.needs_input_grad[0] else None
        d_w13 = (torch._grouped_mm(d_gate_up.t(), x_MH, offs=offs_E).view_as(w13_E2FH)
                 if ctx.needs_input_grad[1] else None)
        return dx, d_w13, d_w2, None, None


def grouped_swiglu(x_MH: torch.Tensor, w13_E2FH: torch.Tensor, w2_EHF: torch.Tensor, offs_E: torch.Tensor,
                   recompute_act: bool = False) -> torch.Tensor:
    """[M, H] expert output of the rows ``x_MH`` (sorted by expert, ``offs_E`` cumulative int32 counts):
    down(silu(gate(x)) · up(x)) with ``w13_E2FH`` [E, 2, F, H] (gate, up) and ``w2_EHF`` [E, H, F]."""
    return _GroupedSwiGLU.apply(x_MH, w13_E2FH, w2_EHF, offs_E, recompute_act)
