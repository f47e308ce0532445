"""Fused SwiGLU, silu(gate) · up, for CUDA through Triton, where Triton imports.

The torch expression runs two kernels forward (silu, then the product, with an [M, f] temporary written
and read back) and three backward, and keeps gate, up and silu(gate) for backward. These kernels read
gate and up once forward (fp32 math, one rounding) and once more backward, writing both gradients in one
pass; only gate and up are kept. Set FOLDTUNE_FUSED_SWIGLU=0 to use the torch path on CUDA too.
"""

from __future__ import annotations

import os

import torch

from executor.kernels.triton_permute import checked_once

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK = 1024


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda and os.environ.get("FOLDTUNE_FUSED_SWIGLU", "1") != "0"


if triton is not None:

    @triton.jit
    def _swiglu_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        out = g * tl.sigmoid(g) * u
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(g_ptr, u_ptr, d_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(d_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        # d silu(g)/dg = s · (1 + g · (1 − s))
        tl.store(du_ptr + offs, (d * g * s).to(du_ptr.dtype.element_ty), mask=mask)
        tl.store(dg_ptr + offs, (d * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty), mask=mask)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        out = torch.empty_like(gate)
        n = gate.numel()
        _swiglu_kernel[(triton.cdiv(n, BLOCK),)](gate, up, out, n, BLOCK=BLOCK)
        return out

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grad = grad.contiguous()
        d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        _swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, grad, d_gate, d_up, n, BLOCK=BLOCK)
        return d_gate, d_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up (same shape and dtype), differentiable."""
    return _SwiGLU.apply(gate, up)


_CHECKED: dict[tuple, bool] = {}


def _check_against_torch(dtype: torch.dtype, device: str) -> None:
    """Raise if the fused SwiGLU differs from torch (beyond one rounding of ``dtype``) on random data."""
    gen = torch.Generator(device=device).manual_seed(0)
    gate, up = (torch.randn(37, 96, device=device, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    out = swiglu(gate, up)
    ref = torch.nn.functional.silu(gate.float()) * up.float()
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out.float(), ref, **tol)
    g = torch.randn(out.shape, device=device, generator=gen).to(dtype)
    for got, want in zip(torch.autograd.grad(out, (gate, up), g), torch.autograd.grad(ref, (gate, up), g.float())):
        torch.testing.assert_close(got.float(), want.float(), **tol)


def swiglu_checked(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the fused SwiGLU compiles and matches torch for this dtype (checked once)."""
    return checked_once(_CHECKED, (dtype, str(device)), _check_against_torch, "fused SwiGLU")
