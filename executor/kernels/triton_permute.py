"""Fused permutation kernels for CUDA through Triton, where Triton imports.

Index building (``sort_slots``): a stable counting sort of the n·k assignment slots by expert id instead of
a radix argsort over 64-bit keys plus three kernels to invert it. Slots are cut into blocks of 64; one
kernel counts each block's slots per expert into a [E, blocks] table, one cumsum over that table (expert
major) gives each (expert, block) its first sorted position, and a second kernel ranks each slot among
the equal ids before it in its block. It writes the sorted order and its inverse (each slot's row) at once,
identical to ``torch.argsort(ids, stable=True)``.

``permute``: rows[row(t, j)] = x[t], each token row read once and written to its k rows (instead of an
index division and an index_select).

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

from executor.kernels.first_use import checked_once

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda and os.environ.get("FOLDTUNE_FUSED_PERMUTE", "1") != "0"


_CHECKED: dict[tuple, bool] = {}


def _check_sort(num_buckets: int, device: str) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, num_buckets, (300,), device=device, generator=gen)
    ids[:100] = ids[0]  # a long run of one id across blocks
    order, rows = sort_slots(ids, num_buckets)
    want = torch.argsort(ids, stable=True)
    inverse = torch.empty_like(want)
    inverse[want] = torch.arange(want.numel(), device=device)
    if not (torch.equal(order, want) and torch.equal(rows, inverse)):
        raise AssertionError("counting sort differs from the stable argsort")


def _check_permute(k: int, h: int, dtype: torch.dtype, device: str) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    n = 40
    x = torch.randn(n, h, device=device, generator=gen).to(dtype)
    slots = torch.randperm(n * k, device=device, generator=gen)[: n * k - 3]  # three dropped slots
    rows = torch.full((n * k,), slots.numel(), device=device, dtype=torch.long)
    rows[slots] = torch.arange(slots.numel(), device=device)
    if not torch.equal(permute(x, rows, slots.numel(), k), x.index_select(0, slots // k)):
        raise AssertionError("fused permute differs from index_select")


def sort_checked(num_buckets: int, device: torch.device) -> bool:
    """Whether :func:`sort_slots` compiles and matches torch for this many buckets (checked once)."""
    return checked_once(_CHECKED, ("sort", num_buckets, str(device)), lambda _, b, d: _check_sort(b, d),
                        "fused counting sort")


def permute_checked(k: int, h: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :func:`permute` compiles and matches torch for this k, width and dtype (checked once)."""
    return checked_once(_CHECKED, ("permute", k, h, dtype, str(device)),
                        lambda _, k_, h_, t, d: _check_permute(k_, h_, t, d), "fused permute")


if triton is not None:

    @triton.jit
    def _combine_kernel(y_ptr, p_ptr, row_ptr, out_ptr, H, M, stride_y, stride_out,
                        K: tl.constexpr, HAS_P: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            r = tl.load(row_ptr + t * K + j) + tl.zeros([BLOCK], dtype=tl.int64)  # a block (interpreter masks)
            valid = r < M
            v = tl.load(y_ptr + r * stride_y + offs, mask=mask & valid, other=0.0).to(tl.float32)
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
            r = tl.load(row_ptr + t * K + j) + tl.zeros([BLOCK], dtype=tl.int64)  # a block (interpreter masks)
            valid = r < M
            w = tl.load(p_ptr + t * K + j).to(tl.float32)
            y = tl.load(y_ptr + r * stride_y + offs, mask=mask & valid, other=0.0).to(tl.float32)
            tl.store(gy_ptr + r * stride_y + offs, (w * g).to(gy_ptr.dtype.element_ty),
                     mask=mask & valid)
            tl.atomic_add(gp_ptr + t * K + j, tl.sum(g * y, axis=0))

    @triton.jit
    def _permute_kernel(x_ptr, row_ptr, out_ptr, H, M, stride_x, stride_out, K: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < H
        v = tl.load(x_ptr + t.to(tl.int64) * stride_x + offs, mask=mask)
        for j in tl.static_range(K):
            r = tl.load(row_ptr + t * K + j) + tl.zeros([BLOCK], dtype=tl.int64)  # a block: a mask of one shape
            tl.store(out_ptr + r * stride_out + offs, v, mask=mask & (r < M))

    @triton.jit
    def _block_hist_kernel(ids_ptr, hist_ptr, M, NB, E, BS: tl.constexpr, E_PAD: tl.constexpr):
        b = tl.program_id(0)
        offs = b * BS + tl.arange(0, BS)
        ids = tl.load(ids_ptr + offs, mask=offs < M, other=E_PAD)  # past the end: matches no expert
        experts = tl.arange(0, E_PAD)
        h = tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
        tl.store(hist_ptr + experts * NB + b, h, mask=experts < E)

    @triton.jit
    def _block_rank_kernel(ids_ptr, hist_ptr, incl_ptr, order_ptr, row_ptr, M, NB, BS: tl.constexpr):
        b = tl.program_id(0)
        i = tl.arange(0, BS)
        offs = b * BS + i
        valid = offs < M
        ids = tl.load(ids_ptr + offs, mask=valid, other=0)
        cell = ids * NB + b
        start = tl.load(incl_ptr + cell, mask=valid, other=0) - tl.load(hist_ptr + cell, mask=valid, other=0)
        earlier_same = (ids[:, None] == ids[None, :]) & (i[None, :] < i[:, None])
        dest = (start + tl.sum(earlier_same.to(tl.int32), axis=1)).to(tl.int64)
        tl.store(order_ptr + dest, offs.to(tl.int64), mask=valid)
        tl.store(row_ptr + offs, dest, mask=valid)


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


SORT_BLOCK = 64  # slots per block of the counting sort (a 64×64 comparison per block)


def sort_slots(ids: torch.Tensor, num_buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, row of each slot): the stable sort of the flat ``ids`` (all in [0, num_buckets)), int64 both."""
    ids = ids.reshape(-1).contiguous()
    m = ids.numel()
    nb = triton.cdiv(m, SORT_BLOCK)
    hist = torch.empty((num_buckets, nb), device=ids.device, dtype=torch.int32)
    _block_hist_kernel[(nb,)](ids, hist, m, nb, num_buckets, BS=SORT_BLOCK,
                              E_PAD=max(16, triton.next_power_of_2(num_buckets)))
    incl = torch.cumsum(hist.view(-1), 0, dtype=torch.int32)  # expert-major: every earlier expert, then earlier blocks
    order = torch.empty(m, device=ids.device, dtype=torch.long)
    rows = torch.empty(m, device=ids.device, dtype=torch.long)
    _block_rank_kernel[(nb,)](ids, hist, incl, order, rows, m, nb, BS=SORT_BLOCK)
    return order, rows


def permute(x_NH: torch.Tensor, row_of_slot: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """[m, h]: row ``row_of_slot[t·k + j]`` is token t's row of ``x_NH`` (slots with row ≥ m are dropped)."""
    x_NH = x_NH.contiguous()
    n, h = x_NH.shape
    out = torch.empty((m, h), device=x_NH.device, dtype=x_NH.dtype)
    block = 1024 if h >= 1024 else triton.next_power_of_2(h)
    _permute_kernel[(n, triton.cdiv(h, block))](x_NH, row_of_slot, out, h, m, x_NH.stride(0), out.stride(0), K=k,
                                                BLOCK=block)
    return out
