"""Fused unpermute (and permute backward) for CUDA through Triton, where Triton imports.

The torch path gathers every token's k expert rows into an [n·k, h] tensor and reduces it; these kernels
read each row once and write each result once:
- ``combine``: out[t] = Σ_j p[t, j] · y[row(t, j)] (p omitted: plain sum) — unpermute forward and permute
  backward;
- ``combine_backward``: grad_y[row(t, j)] = p[t, j] · g[t] and grad_p[t, j] = y[row(t, j)] · g[t].
``row(t, j)`` equal to the row count means a dropped slot (contributes zero). Set FOLDTUNE_FUSED_PERMUTE=0
to use the torch path. grad_p sums its per-block partial dot products with fp32 atomic adds, so its last
bits may differ between runs (the torch path is deterministic).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda and os.environ.get("FOLDTUNE_FUSED_PERMUTE", "1") != "0"


if triton is not None:

    @triton.jit
    def _combine_kernel(y_ptr, p_ptr, row_ptr, out_ptr, H, M, stride_y, stride_out,
                        K: tl.constexpr, HAS_P: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            r = tl.load(row_ptr + t * K + j)
            valid = r < M
            v = tl.load(y_ptr + r.to(tl.int64) * stride_y + offs, mask=mask & valid, other=0.0).to(tl.float32)
            if HAS_P:
                v = v * tl.load(p_ptr + t * K + j).to(tl.float32)
            acc += v
        tl.store(out_ptr + t.to(tl.int64) * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _combine_bwd_kernel(g_ptr, y_ptr, p_ptr, row_ptr, gy_ptr, gp_ptr, H, M, stride_g, stride_y,
                            K: tl.constexpr, BLOCK: tl.constexpr):
        # one program per (token, block of h): the gradient block is read once for the k slots, and each
        # slot's probability gradient gathers its partial dot products by atomic adds
        t = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < H
        g = tl.load(g_ptr + t.to(tl.int64) * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            r = tl.load(row_ptr + t * K + j)
            valid = r < M
            w = tl.load(p_ptr + t * K + j).to(tl.float32)
            y = tl.load(y_ptr + r.to(tl.int64) * stride_y + offs, mask=mask & valid, other=0.0).to(tl.float32)
            tl.store(gy_ptr + r.to(tl.int64) * stride_y + offs, (w * g).to(gy_ptr.dtype.element_ty),
                     mask=mask & valid)
            tl.atomic_add(gp_ptr + t * K + j, tl.sum(g * y, axis=0))


def combine(y_MH: torch.Tensor, probs_NK: torch.Tensor | None, row_of_slot: torch.Tensor, n: int,
            k: int) -> torch.Tensor:
    """[n, h]: Σ over each token's k slots of (prob ·) its row of ``y_MH``."""
    y_MH = y_MH.contiguous()
    h = y_MH.shape[1]
    out = torch.empty((n, h), device=y_MH.device, dtype=y_MH.dtype)
    block = 1024 if h >= 1024 else triton.next_power_of_2(h)
    p = probs_NK.contiguous() if probs_NK is not None else row_of_slot  # placeholder pointer when unused
    _combine_kernel[(n, triton.cdiv(h, block))](y_MH, p, row_of_slot, out, h, y_MH.shape[0], y_MH.stride(0),
                                                out.stride(0), K=k, HAS_P=probs_NK is not None, BLOCK=block)
    return out


def combine_backward(grad_NH: torch.Tensor, y_MH: torch.Tensor, probs_NK: torch.Tensor,
                     row_of_slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad of y_MH, grad of probs_NK in fp32) of :func:`combine` with probabilities."""
    grad_NH, y_MH, probs_NK = grad_NH.contiguous(), y_MH.contiguous(), probs_NK.contiguous()
    n, k = probs_NK.shape
    h = y_MH.shape[1]
    grad_y = torch.empty_like(y_MH)
    grad_p = torch.zeros((n, k), device=y_MH.device, dtype=torch.float32)
    block = min(1024, triton.next_power_of_2(h))
    _combine_bwd_kernel[(n, triton.cdiv(h, block))](grad_NH, y_MH, probs_NK, row_of_slot, grad_y, grad_p, h, y_MH.shape[0],
                              grad_NH.stride(0), y_MH.stride(0), K=k, BLOCK=block)
    return grad_y, grad_p
