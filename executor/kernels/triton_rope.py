"""Fused rotary embedding of q and k in one kernel launch (forward and backward), through Triton on CUDA.

The torch expression (:func:`executor.attention.apply_rope`) runs five kernels per tensor forward (negate,
cat, two products, a sum, each rounding to bf16 and writing a full-size temporary) and as many backward, for
q and k separately. This kernel reads each token's q and k heads once, rotates them in fp32 with one rounding
and writes them once; backward applies the transposed rotation to the output gradients the same way (RoPE is
linear: its backward needs only cos and sin, nothing is saved).

Layout: q [s, b, hq, d] and k [s, b, hk, d] as the Q/K projections give them (views with any row strides:
the column slices of a fused QKV output work); token (i, j) is at position i of the [s, d] fp32 cos/sin
tables. Outputs are contiguous [s, b, h, d]. With x = (x1, x2) the two halves of a head:
forward  y1 = x1·c1 − x2·s1,  y2 = x2·c2 + x1·s2   (= x·cos + cat(−x2, x1)·sin)
backward g1' = g1·c1 + g2·s2, g2' = g2·c2 − g1·s1  (the transpose of the same linear map).
"""

from __future__ import annotations

import torch

from executor.kernels.first_use import checked_once

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


_CHECKED: dict[tuple, bool] = {}


def available(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the Triton kernel runs on these q/k ([s, b, h, d]): CUDA, and its first-use check against
    torch passed for their dtype and head counts (a failure costs speed, never the run)."""
    if triton is None or not q.is_cuda:
        return False
    key = (q.dtype, str(q.device), q.shape[2], k.shape[2], q.shape[3])
    return checked_once(_CHECKED, key, _check_against_torch, "fused RoPE")


def _reference(x_SBHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x_SBHD.shape[-1] // 2
    c, s = cos[:, None, None, :], sin[:, None, None, :]
    return x_SBHD * c + torch.cat([-x_SBHD[..., half:], x_SBHD[..., :half]], dim=-1) * s


def _check_against_torch(dtype: torch.dtype, device: str, hq: int, hk: int, d: int) -> None:
    """Raise if the kernel differs from the fp32 torch rotation (beyond one rounding of ``dtype``), fwd and bwd."""
    gen = torch.Generator(device=device).manual_seed(0)
    s, b = 19, 2
    angles = torch.rand(s, d, device=device, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    q = torch.randn(s, b, hq, d, device=device, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(s, b, hk, d, device=device, generator=gen).to(dtype).requires_grad_()
    qo, ko = fused_rope(q, k, cos, sin)
    rq, rk = _reference(q.float(), cos, sin), _reference(k.float(), cos, sin)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(qo.float(), rq, **tol)
    torch.testing.assert_close(ko.float(), rk, **tol)
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    got = torch.autograd.grad((qo, ko), (q, k), (gq, gk))
    want = torch.autograd.grad((rq, rk), (q, k), (gq.float(), gk.float()))
    for a, b_ in zip(got, want):
        torch.testing.assert_close(a.float(), b_.float(), **tol)


if triton is not None:

    @triton.jit
    def _rotate_heads(x_ptr, y_ptr, c1, c2, s1, s2, x_off, y_off, x_head_stride, heads, half,
                      BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BACKWARD: tl.constexpr):
        # All heads of one token: a [BLOCK_H, BLOCK_HALF] tile per half.
        h = tl.arange(0, BLOCK_H)[:, None]
        j = tl.arange(0, BLOCK_HALF)[None, :]
        mask = (h < heads) & (j < half)
        x_at = x_ptr + x_off + h * x_head_stride + j
        x1 = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_at + half, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        y_at = y_ptr + y_off + h * (2 * half) + j
        tl.store(y_at, y1.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_at + half, y2.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, b, hq, hk, half,
                     q_s_stride, q_b_stride, q_h_stride, k_s_stride, k_b_stride, k_h_stride,
                     BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                     BACKWARD: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)  # s·b programs, one per token
        i = token // b
        jb = token % b
        j = tl.arange(0, BLOCK_HALF)[None, :]
        jmask = j < half
        c1 = tl.load(cos_ptr + i * 2 * half + j, mask=jmask, other=0.0)
        c2 = tl.load(cos_ptr + i * 2 * half + half + j, mask=jmask, other=0.0)
        s1 = tl.load(sin_ptr + i * 2 * half + j, mask=jmask, other=0.0)
        s2 = tl.load(sin_ptr + i * 2 * half + half + j, mask=jmask, other=0.0)
        _rotate_heads(q_ptr, qo_ptr, c1, c2, s1, s2, i * q_s_stride + jb * q_b_stride, token * hq * 2 * half,
                      q_h_stride, hq, half, BLOCK_HQ, BLOCK_HALF, BACKWARD)
        _rotate_heads(k_ptr, ko_ptr, c1, c2, s1, s2, i * k_s_stride + jb * k_b_stride, token * hk * 2 * half,
                      k_h_stride, hk, half, BLOCK_HK, BLOCK_HALF, BACKWARD)


def _launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    s, b, hq, d = q.shape
    hk = k.shape[2]
    if q.stride(3) != 1 or k.stride(3) != 1:
        q, k = q.contiguous(), k.contiguous()
    qo = torch.empty((s, b, hq, d), device=q.device, dtype=q.dtype)
    ko = torch.empty((s, b, hk, d), device=k.device, dtype=k.dtype)
    half = d // 2
    _rope_kernel[(s * b,)](q, k, qo, ko, cos, sin, b, hq, hk, half,
                           q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                           BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk),
                           BLOCK_HALF=triton.next_power_of_2(half), BACKWARD=backward)
    return qo, ko


class _FusedRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _launch(q, k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, gq, gk):
        cos, sin = ctx.saved_tensors
        dq, dk = _launch(gq, gk, cos, sin, backward=True)
        return dq, dk, None, None


def fused_rope(q_SBHD: torch.Tensor, k_SBHD: torch.Tensor, cos_SD: torch.Tensor,
               sin_SD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotated q, rotated k), contiguous [s, b, h, d] in the inputs' dtype; ``cos_SD``/``sin_SD`` [s, d] fp32.
    Head dim even; q and k share s and b."""
    if q_SBHD.shape[-1] % 2:
        raise ValueError(f"rotary head dim must be even, got {q_SBHD.shape[-1]}")
    cos_SD, sin_SD = cos_SD.float().contiguous(), sin_SD.float().contiguous()
    return _FusedRope.apply(q_SBHD, k_SBHD, cos_SD, sin_SD)
