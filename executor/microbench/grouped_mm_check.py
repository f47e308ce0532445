"""Each grouped GEMM of the executor's bf16 and fp8 expert paths against an fp64 per-group loop on the same
operands, at routing-like group sizes (:data:`COUNTS`: an empty expert, sizes that are no multiple of 16 or 8,
one large group): which product, if any, computes wrong on a device.

Products: ``bf16 fwd`` / ``bf16 dgrad`` / ``bf16 wgrad`` (``torch._grouped_mm`` as
:mod:`executor.grouped_swiglu` calls it), ``fp8 fwd`` / ``fp8 dgrad`` / ``fp8 wgrad``
(:mod:`executor.kernels.fp8.gemm`: kernels where they run, else the emulation), and ``swiglu dx`` /
``swiglu dw13`` / ``swiglu dw2`` (grouped_swiglu's backward against autograd through the fp64 loop). Each is
reported as the largest per-group relative error ||got − ref|| / ||ref|| (Frobenius; an empty group's ref is
0, so its error is ||got||, which must be 0): bf16 products sit near 2^-8, fp8 ones at a few per cent; 0.1 or
more is a wrong result. ``bench/grouped_mm_probe.py`` prints it and fails on such a product.
"""

from __future__ import annotations

import torch

from executor.grouped_swiglu import grouped_swiglu
from executor.kernels.fp8 import gemm as fp8_gemm
from executor.kernels.torch_backend import grouped_mm_works

# tokens per expert: an empty expert, sizes that are no multiple of 8 or 16, one large group
COUNTS = (0, 37, 1, 515, 16, 250, 2000, 93)
HIDDEN, FFN = 256, 384  # multiples of 16 (the fp8 kernels' granularity); small enough for a CPU run


def _group_bounds(counts: tuple[int, ...]) -> list[tuple[int, int]]:
    ends = torch.tensor(counts).cumsum(0).tolist()
    return list(zip([0, *ends[:-1]], ends))


def _rel_errors(got: torch.Tensor, ref: torch.Tensor, slices: list) -> float:
    """The largest per-group ||got − ref|| / ||ref|| (||got|| where ref is 0: an empty group)."""
    worst = 0.0
    for sl in slices:
        g, r = got[sl].double(), ref[sl].double()
        den = float(r.norm())
        err = float((g - r).norm()) / den if den else float(g.norm())
        worst = max(worst, err)
    return worst


def probe(device: str, seed: int = 0) -> dict[str, float]:
    """Product name -> the largest per-group relative error of that grouped product on ``device`` (the module
    doc); the bf16 and SwiGLU products only where ``torch._grouped_mm`` runs on the device."""
    gen = torch.Generator().manual_seed(seed)
    m, e = sum(COUNTS), len(COUNTS)
    x = torch.randn(m, HIDDEN, generator=gen).to(device, torch.bfloat16)
    dy = torch.randn(m, 2 * FFN, generator=gen).to(device, torch.bfloat16)
    w13 = (torch.randn(e, 2, FFN, HIDDEN, generator=gen) * 0.05).to(device, torch.bfloat16)
    w2 = (torch.randn(e, HIDDEN, FFN, generator=gen) * 0.05).to(device, torch.bfloat16)
    gy = torch.randn(m, HIDDEN, generator=gen).to(device, torch.bfloat16)
    offs = torch.tensor(COUNTS, device=device).cumsum(0).to(torch.int32)
    bounds = _group_bounds(COUNTS)
    rows = [slice(lo, hi) for lo, hi in bounds]
    experts = list(range(e))
    w = w13.flatten(1, 2)  # [E, 2F, H]
    xd, dyd, wd = x.double(), dy.double(), w.double()
    fwd_ref = torch.cat([xd[lo:hi] @ wd[g].t() for g, (lo, hi) in enumerate(bounds)])
    dgrad_ref = torch.cat([dyd[lo:hi] @ wd[g] for g, (lo, hi) in enumerate(bounds)])
    wgrad_ref = torch.stack([dyd[lo:hi].t() @ xd[lo:hi] for lo, hi in bounds])
    out = {}
    if grouped_mm_works(torch.device(device), torch.bfloat16):
        out["bf16 fwd"] = _rel_errors(torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), fwd_ref, rows)
        out["bf16 dgrad"] = _rel_errors(torch._grouped_mm(dy, w, offs=offs), dgrad_ref, rows)
        out["bf16 wgrad"] = _rel_errors(torch._grouped_mm(dy.t(), x, offs=offs), wgrad_ref, experts)
    kernel = fp8_gemm.kernels_ok(torch.device(device))
    out["fp8 fwd"] = _rel_errors(fp8_gemm.scaled_grouped_nt(x, w, offs, kernel), fwd_ref, rows)
    out["fp8 dgrad"] = _rel_errors(fp8_gemm.scaled_grouped_nt(dy, w.transpose(-2, -1), offs, kernel), dgrad_ref, rows)
    out["fp8 wgrad"] = _rel_errors(fp8_gemm.scaled_grouped_wgrad(dy, x, offs, kernel), wgrad_ref, experts)
    if grouped_mm_works(torch.device(device), torch.bfloat16):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w13, w2)]
        grouped_swiglu(leaves[0], leaves[1], leaves[2], offs).backward(gy)
        ref = [t.detach().double().requires_grad_() for t in (x, w13, w2)]
        w13r = ref[1].flatten(1, 2)
        parts = []
        for g, (lo, hi) in enumerate(bounds):
            gate_up = ref[0][lo:hi] @ w13r[g].t()
            act = torch.nn.functional.silu(gate_up[:, :FFN]) * gate_up[:, FFN:]
            parts.append(act @ ref[2][g].t())
        torch.cat(parts).backward(gy.double())
        out["swiglu dx"] = _rel_errors(leaves[0].grad, ref[0].grad, rows)
        out["swiglu dw13"] = _rel_errors(leaves[1].grad, ref[1].grad, experts)
        out["swiglu dw2"] = _rel_errors(leaves[2].grad, ref[2].grad, experts)
    return out
