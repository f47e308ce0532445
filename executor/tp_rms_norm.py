"""RMSNorm of rows that TP splits: OLMoE's q/k norms over a token's whole q (heads·d) or k (kv_heads·d).

Each TP rank holds a slice [..., width/tp] of every row and the matching slice of the weight. The mean square
spans the full ``width``: the fp32 sums of squares of the slices are summed over TP. Forward numerics are
the executor's ``rms_norm`` (fp32 math, cast to the input dtype, then times the weight). Autograd keeps only
the input, the weight and the fp32 reciprocal RMS (one per row), as a fused norm kernel does.

Backward, with r = rsqrt(S/width + eps), S the full row's sum of squares and g the output gradient:
dx = r·(g·w) − x·r³/width·Σ_full(g·w·x) (cast after the weight as forward does: g·w against the cast
normalised row), dw = Σ_rows g·(x·r). The dot Σ_full spans every rank's slice: summed over TP as well.
"""

from __future__ import annotations

import torch

from executor.parallel.collectives import all_reduce_
from executor.parallel.groups import Group


def _reduce_grad(dot: torch.Tensor, group: Group) -> torch.Tensor:
    """The backward's sum over TP of each row's Σ g·w·x (left out, a rank would see only its own slice)."""
    return all_reduce_(dot, group)


class _TPRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, width, eps, group):
        xf = x.float()
        total = all_reduce_(xf.square().sum(dim=-1, keepdim=True), group)
        rstd = torch.rsqrt(total / width + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.width, ctx.group = width, group
        return (xf * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xf, gw = x.float(), (grad * weight).float()
        dot = _reduce_grad((gw * xf).sum(dim=-1, keepdim=True), ctx.group)
        dx = rstd * gw - xf * rstd.pow(3) * (dot / ctx.width)
        normed = (xf * rstd).to(x.dtype)
        dw = (grad.float() * normed.float()).reshape(-1, weight.shape[-1]).sum(dim=0)
        return dx.to(x.dtype), dw.to(weight.dtype), None, None, None


def tp_rms_norm(x: torch.Tensor, weight: torch.Tensor, width: int, eps: float, group: Group) -> torch.Tensor:
    """RMSNorm over ``width`` elements per row, of which this rank holds ``x`` [..., width/tp] and ``weight``
    [width/tp]; the squares are summed over ``group`` (TP)."""
    return _TPRMSNorm.apply(x, weight, width, eps, group)
