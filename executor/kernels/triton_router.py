"""Fused softmax top-k routing for CUDA through Triton, where Triton imports.

The torch router turns the gate logits into routes with a chain of small kernels (cast to fp32, softmax,
top-k, gather, softmax over the k, scaling, and four more to count tokens per expert), each a launch the
GPU waits for at the start of every MoE layer. ``softmax_topk`` does it in one kernel per block of tokens
(plus the zeroed counts): it reads a token's logits once, picks the k largest by repeated arg-max (ties go
to the lower expert id), writes the k expert ids, their probabilities and adds to the per-expert counts
(integer atomics, so the counts are exact). Its backward is one kernel that writes the whole [n, E]
logits gradient. Both Megatron softmax variants are covered:

- post-softmax (``pre_softmax=False``): p = scale · softmax over the k selected logits;
- pre-softmax: p = scale · softmax over all E logits, at the k selected experts.

Forced balancing (Megatron's --moe-router-force-load-balancing) runs in the same kernel: the k experts of
token t are (first + t·k + j) mod E instead of the arg-maxes, the probabilities as above. Sigmoid scores,
group-limited selection and expert bias keep the torch path. Set
FOLDTUNE_FUSED_ROUTER=0 to use the torch path on CUDA too.
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
    return triton is not None and t.is_cuda and os.environ.get("FOLDTUNE_FUSED_ROUTER", "1") != "0"


_CHECKED: dict[tuple, bool] = {}


def forced_experts(first: int, n: int, k: int, e: int, device: torch.device) -> torch.Tensor:
    """Forced balancing's experts [n, k]: token t takes (first + t·k + j) mod e."""
    return (torch.arange(first, first + n * k, device=device) % e).view(n, k)


def _check_against_torch(e: int, k: int, pre_softmax: bool, scale: float, dtype: torch.dtype,
                         device: torch.device, forced: bool = False) -> None:
    """Raise if the kernels differ from the torch router on 64 random tokens of this shape."""
    gen = torch.Generator(device=device).manual_seed(0)  # leaves the global RNG streams alone
    logits = torch.randn(64, e, device=device, generator=gen).to(dtype).requires_grad_()
    first = 3 * 64 * k if forced else None  # an offset as a later TP rank has
    experts, probs, counts = softmax_topk(logits, k, pre_softmax, scale, forced_first=first)
    x = logits.float()
    picked = x.gather(1, experts)
    if forced:
        if not torch.equal(experts, forced_experts(first, 64, k, e, experts.device)):
            raise AssertionError("forced experts differ from the round-robin rule")
    elif not torch.equal(picked, x.topk(k, -1).values):  # same values: on ties another id may be picked
        raise AssertionError("top-k picks differ from torch.topk")
    if not torch.equal(counts, torch.bincount(experts.reshape(-1), minlength=e)):
        raise AssertionError("counts differ from bincount")
    ref = (torch.softmax(x, -1).gather(1, experts) if pre_softmax else torch.softmax(picked, -1)) * scale
    torch.testing.assert_close(probs, ref, rtol=1e-4, atol=1e-5)
    g = torch.randn(probs.shape, device=device, generator=gen)
    got, want = torch.autograd.grad(probs, logits, g)[0], torch.autograd.grad(ref, logits, g)[0]
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-2)


def self_checked(e: int, k: int, pre_softmax: bool, scale: float, dtype: torch.dtype, device: torch.device,
                 forced: bool = False) -> bool:
    """Whether the kernels of this shape (and routing rule: top-k or forced balance) compile and agree with
    torch (checked once per shape; on a failure a warning says why and the caller keeps the torch path)."""
    return checked_once(_CHECKED, (e, k, pre_softmax, scale, dtype, str(device), forced), _check_against_torch,
                        "fused router forced balance" if forced else "fused router top-k")


if triton is not None:

    @triton.jit
    def _logit_rows(x_ptr, rows, cols, rmask, E, stride_x):
        # [BT, E_PAD] fp32 logits: -inf past E (never picked), 0 in rows past N (finite, never stored)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :],
                    mask=rmask[:, None] & (cols[None, :] < E), other=0.0).to(tl.float32)
        return tl.where(cols[None, :] < E, x, float("-inf"))

    @triton.jit
    def _topk_kernel(x_ptr, experts_ptr, probs_ptr, counts_ptr, N, E, stride_x, scale, first,
                     K: tl.constexpr, K_PAD: tl.constexpr, PRE: tl.constexpr, E_PAD: tl.constexpr,
                     BT: tl.constexpr, FORCED: tl.constexpr):
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        cols = tl.arange(0, E_PAD)
        kc = tl.arange(0, K_PAD)
        rmask = rows < N
        x = _logit_rows(x_ptr, rows, cols, rmask, E, stride_x)
        row_max = tl.max(x, axis=1)
        work = x
        vals = tl.full([BT, K_PAD], float("-inf"), tl.float32)
        ids = tl.zeros([BT, K_PAD], dtype=tl.int64)
        for j in tl.static_range(K):
            if FORCED:
                idx = (rows.to(tl.int64) * K + j + first) % E
                m = tl.sum(tl.where(cols[None, :] == idx[:, None], x, 0.0), axis=1)
            else:
                m = tl.max(work, axis=1)
                idx = tl.min(tl.where(work == m[:, None], cols[None, :], E_PAD), axis=1)
                work = tl.where(cols[None, :] == idx[:, None], float("-inf"), work)
            vals = tl.where(kc[None, :] == j, m[:, None], vals)
            ids = tl.where(kc[None, :] == j, idx[:, None].to(tl.int64), ids)
        if PRE:
            shift = row_max
            denom = tl.sum(tl.exp(x - shift[:, None]), axis=1)
        else:
            # the largest pick (the row maximum under top-k; forced picks may all lie far below it)
            shift = tl.max(vals, axis=1)
            denom = tl.sum(tl.exp(vals - shift[:, None]), axis=1)
        p = tl.exp(vals - shift[:, None]) / denom[:, None] * scale
        kmask = rmask[:, None] & (kc[None, :] < K)
        out = rows[:, None] * K + kc[None, :]
        tl.store(experts_ptr + out, ids, mask=kmask)
        tl.store(probs_ptr + out, p, mask=kmask)
        tl.atomic_add(counts_ptr + ids, tl.full([BT, K_PAD], 1, tl.int64), mask=kmask)

    @triton.jit
    def _topk_bwd_kernel(g_ptr, probs_ptr, experts_ptr, x_ptr, out_ptr, N, E, stride_x, stride_o, inv_scale,
                         K: tl.constexpr, K_PAD: tl.constexpr, PRE: tl.constexpr, E_PAD: tl.constexpr,
                         BT: tl.constexpr):
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        cols = tl.arange(0, E_PAD)
        kc = tl.arange(0, K_PAD)
        rmask = rows < N
        kmask = rmask[:, None] & (kc[None, :] < K)
        at = rows[:, None] * K + kc[None, :]
        g = tl.load(g_ptr + at, mask=kmask, other=0.0).to(tl.float32)
        p = tl.load(probs_ptr + at, mask=kmask, other=0.0).to(tl.float32)
        ids = tl.load(experts_ptr + at, mask=kmask, other=-1)
        dot = tl.sum(p * g, axis=1)  # Σ_j p_j g_j
        emask = rmask[:, None] & (cols[None, :] < E)
        if PRE:
            # p_j = s·q[e_j], q = softmax(x): dx = q ⊙ (G − Σ_j p_j g_j), G_e = s·g_j where e = e_j
            x = _logit_rows(x_ptr, rows, cols, rmask, E, stride_x)
            q = tl.exp(x - tl.max(x, axis=1)[:, None])
            q = q / tl.sum(q, axis=1)[:, None]
            big_g = tl.zeros([BT, E_PAD], dtype=tl.float32)
            for j in tl.static_range(K):
                id_j = tl.sum(tl.where(kc[None, :] == j, ids, 0), axis=1)
                g_j = tl.sum(tl.where(kc[None, :] == j, g, 0.0), axis=1)
                big_g = tl.where(cols[None, :] == id_j[:, None], g_j[:, None] / inv_scale, big_g)
            dx = q * (big_g - dot[:, None])
        else:
            # p = s·softmax(v), v_j = x[e_j]: dv_j = p_j·(g_j − Σ_i p_i g_i / s), zero off the k picks
            dv = p * (g - dot[:, None] * inv_scale)
            dx = tl.zeros([BT, E_PAD], dtype=tl.float32)
            for j in tl.static_range(K):
                id_j = tl.sum(tl.where(kc[None, :] == j, ids, 0), axis=1)
                dv_j = tl.sum(tl.where(kc[None, :] == j, dv, 0.0), axis=1)
                dx = tl.where(cols[None, :] == id_j[:, None], dv_j[:, None], dx)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :],
                 dx.to(out_ptr.dtype.element_ty), mask=emask)


def _blocks(e: int, k: int) -> tuple[int, int, int]:
    """(E_PAD, K_PAD, tokens per program): about 4096 logits per program in registers."""
    e_pad = max(16, triton.next_power_of_2(e))
    k_pad = max(2, triton.next_power_of_2(k))
    return e_pad, k_pad, max(1, min(128, 4096 // e_pad))


def topk_forward(logits_NE: torch.Tensor, k: int, pre_softmax: bool, scale: float, forced_first: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(experts [n, k] int64 in descending score order, probs [n, k] fp32, counts [E] int64); with
    ``forced_first`` the experts of forced balancing (see :func:`forced_experts`) instead of the top-k."""
    logits_NE = logits_NE.contiguous()
    n, e = logits_NE.shape
    experts = torch.empty((n, k), device=logits_NE.device, dtype=torch.long)
    probs = torch.empty((n, k), device=logits_NE.device, dtype=torch.float32)
    counts = torch.zeros(e, device=logits_NE.device, dtype=torch.long)
    e_pad, k_pad, bt = _blocks(e, k)
    forced = forced_first is not None
    _topk_kernel[(triton.cdiv(n, bt),)](logits_NE, experts, probs, counts, n, e, logits_NE.stride(0), float(scale),
                                        (forced_first % e) if forced else 0, K=k, K_PAD=k_pad, PRE=pre_softmax,
                                        E_PAD=e_pad, BT=bt, FORCED=forced)
    return experts, probs, counts


def topk_backward(grad_NK: torch.Tensor, probs_NK: torch.Tensor, experts_NK: torch.Tensor, logits_NE: torch.Tensor,
                  pre_softmax: bool, scale: float) -> torch.Tensor:
    """Gradient of :func:`topk_forward`'s probabilities w.r.t. the logits, [n, E] in the logits' dtype."""
    logits_NE, grad_NK = logits_NE.contiguous(), grad_NK.contiguous()
    n, e = logits_NE.shape
    k = probs_NK.shape[1]
    out = torch.empty_like(logits_NE)
    e_pad, k_pad, bt = _blocks(e, k)
    _topk_bwd_kernel[(triton.cdiv(n, bt),)](grad_NK, probs_NK, experts_NK, logits_NE, out, n, e, logits_NE.stride(0),
                                            out.stride(0), 1.0 / float(scale), K=k, K_PAD=k_pad, PRE=pre_softmax,
                                            E_PAD=e_pad, BT=bt)
    return out


class _SoftmaxTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NE, k, pre_softmax, scale, forced_first):
        experts, probs, counts = topk_forward(logits_NE, k, pre_softmax, scale, forced_first)
        ctx.save_for_backward(logits_NE, probs, experts)
        ctx.pre_softmax, ctx.scale = pre_softmax, scale
        ctx.mark_non_differentiable(experts, counts)
        return experts, probs, counts

    @staticmethod
    def backward(ctx, _g_experts, grad_probs, _g_counts):
        logits_NE, probs, experts = ctx.saved_tensors
        grad = topk_backward(grad_probs, probs, experts, logits_NE, ctx.pre_softmax, ctx.scale)
        return grad, None, None, None, None


def softmax_topk(logits_NE: torch.Tensor, k: int, pre_softmax: bool, scale: float, forced_first: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Differentiable (experts [n, k], probs [n, k] fp32, counts [E]) from raw gate logits (any float dtype);
    ``forced_first``: the slot offset of this rank's first token under forced balancing (None: top-k)."""
    return _SoftmaxTopK.apply(logits_NE, k, pre_softmax, scale, forced_first)
