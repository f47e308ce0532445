"""Fused SwiGLU, silu(gate) · up, on the fused gate/up GEMM's output, for CUDA through Triton, where Triton imports.

The input is the [M, 2f] output of one grouped GEMM against the experts' ``w13`` (gate = columns [0, f),
up = [f, 2f)). The torch expression on its two halves runs two kernels forward (silu, then the product,
with an [M, f] temporary written and read back) and, backward, several more plus two zero-filled [M, 2f]
buffers (one per slice) summed into the input's gradient. These kernels read gate and up once forward
(fp32 math, one rounding) and once more backward, writing both gradients into one [M, 2f] buffer in one
pass — the gradient the fused GEMM's backward takes, with no cat; only the [M, 2f] input is kept.
``swiglu_pair`` runs the same kernels on two separate [M, f] tensors (the ideal expert FFN's three
separate GEMMs in bench/executor_gpu.py). Set FOLDTUNE_FUSED_SWIGLU=0 to use the torch path on CUDA too.
"""

from __future__ import annotations

import os

import torch

from executor.kernels.first_use import checked_once

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

# A program covers BLOCK_M rows × BLOCK_F columns of one half (1024 elements); expert FFN widths are
# multiples of 128 in practice, so column tiles are full and every row segment is one contiguous run.
BLOCK_M = 8
BLOCK_F = 128


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda and os.environ.get("FOLDTUNE_FUSED_SWIGLU", "1") != "0"


if triton is not None:

    @triton.jit
    def _tile(m, f, in_stride, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
        # This program's BLOCK_M × BLOCK_F tile: (mask, offsets into gate/up, whose rows are ``in_stride``
        # apart — 2f for the halves of one [m, 2f] tensor, f for two [m, f] — offsets into a contiguous
        # [m, f]). Rows on grid axis 0 (up to 2^31 - 1 programs; axis 1 allows only 65535), columns on axis 1.
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        mask = (rows[:, None] < m) & (cols[None, :] < f)
        return mask, rows[:, None] * in_stride + cols[None, :], rows[:, None] * f + cols[None, :]

    @triton.jit
    def _swiglu_kernel(g_ptr, u_ptr, out_ptr, m, f, in_stride, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
        mask, at, out_at = _tile(m, f, in_stride, BLOCK_M, BLOCK_F)
        g = tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + at, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + out_at, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(g_ptr, u_ptr, d_ptr, dg_ptr, du_ptr, m, f, in_stride, BLOCK_M: tl.constexpr,
                           BLOCK_F: tl.constexpr):
        # The gradients are laid out like the inputs (dg/du rows ``in_stride`` apart too).
        mask, at, d_at = _tile(m, f, in_stride, BLOCK_M, BLOCK_F)
        g = tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + at, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(d_ptr + d_at, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        # d silu(g)/dg = s · (1 + g · (1 − s))
        tl.store(dg_ptr + at, (d * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty), mask=mask)
        tl.store(du_ptr + at, (d * g * s).to(du_ptr.dtype.element_ty), mask=mask)


def _forward(gate: torch.Tensor, up: torch.Tensor, in_stride: int) -> torch.Tensor:
    """silu(gate) · up as a new contiguous [m, f]; gate/up are [m, f] views with row stride ``in_stride``."""
    m, f = gate.shape
    out = gate.new_empty((m, f))
    if out.numel():
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(f, BLOCK_F))
        _swiglu_kernel[grid](gate, up, out, m, f, in_stride, BLOCK_M=BLOCK_M, BLOCK_F=BLOCK_F)
    return out


def _backward(gate, up, grad, d_gate, d_up, in_stride: int) -> None:
    """Both gradients into ``d_gate``/``d_up`` (laid out like gate/up); ``grad`` is contiguous [m, f]."""
    m, f = grad.shape
    if grad.numel():
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(f, BLOCK_F))
        _swiglu_bwd_kernel[grid](gate, up, grad, d_gate, d_up, m, f, in_stride, BLOCK_M=BLOCK_M, BLOCK_F=BLOCK_F)


class _SwiGLU(torch.autograd.Function):
    """On the [m, 2f] output of the fused gate/up GEMM; its gradient is one [m, 2f] buffer."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        f = x.shape[1] // 2
        ctx.save_for_backward(x)
        return _forward(x[:, :f], x[:, f:], 2 * f)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        f = x.shape[1] // 2
        d_x = torch.empty_like(x)
        _backward(x[:, :f], x[:, f:], grad.contiguous(), d_x[:, :f], d_x[:, f:], 2 * f)
        return d_x


class _SwiGLUPair(torch.autograd.Function):
    """On separate gate and up tensors (two GEMMs): the ideal expert FFN of bench/executor_gpu.py."""

    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return _forward(gate, up, gate.shape[1])

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
        _backward(gate, up, grad.contiguous(), d_gate, d_up, gate.shape[1])
        return d_gate, d_up


def swiglu(x_M2F: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :f]) · x[:, f:] of a [M, 2f] tensor → [M, f] (same dtype), differentiable."""
    if x_M2F.dim() != 2 or x_M2F.shape[1] % 2:
        raise ValueError(f"fused SwiGLU takes [rows, 2f], got {tuple(x_M2F.shape)}")
    return _SwiGLU.apply(x_M2F)


def swiglu_pair(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up of two [M, f] tensors (same shape and dtype), differentiable."""
    if gate.dim() != 2 or gate.shape != up.shape:
        raise ValueError(f"fused SwiGLU takes two equal [rows, f], got {tuple(gate.shape)}, {tuple(up.shape)}")
    return _SwiGLUPair.apply(gate, up)


def reference(x_M2F: torch.Tensor) -> torch.Tensor:
    """The torch formula the fused kernels must match (and the path used where they are off)."""
    f = x_M2F.shape[1] // 2
    return torch.nn.functional.silu(x_M2F[:, :f]) * x_M2F[:, f:]


_CHECKED: dict[tuple, bool] = {}


def _check_against_torch(dtype: torch.dtype, device: str) -> None:
    """Raise if the fused SwiGLU (both entries) differs from torch (beyond one rounding of ``dtype``) on
    random data, forward and backward. f = 160 covers a full and a partial column tile, 37 rows a partial
    row tile."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(37, 2 * 160, device=device, generator=gen).to(dtype).requires_grad_()
    out = swiglu(x)
    ref = reference(x.float())
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out.float(), ref, **tol)
    g = torch.randn(out.shape, device=device, generator=gen).to(dtype)
    (got,) = torch.autograd.grad(out, x, g)
    (want,) = torch.autograd.grad(ref, x, g.float())
    torch.testing.assert_close(got.float(), want.float(), **tol)
    gate, up = (t.detach().contiguous().requires_grad_() for t in x.chunk(2, 1))  # the two-tensor entry
    pair = swiglu_pair(gate, up)
    torch.testing.assert_close(pair.float(), ref, **tol)
    for got, want in zip(torch.autograd.grad(pair, (gate, up), g), want.chunk(2, 1)):
        torch.testing.assert_close(got.float(), want.float(), **tol)


def swiglu_checked(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the fused SwiGLU compiles and matches torch for this dtype (checked once)."""
    return checked_once(_CHECKED, (dtype, str(device)), _check_against_torch, "fused SwiGLU")
