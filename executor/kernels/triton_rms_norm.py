"""RMSNorm over the last dim in one Triton kernel each way, on CUDA: 16-bit in, fp32 math, 16-bit out.

The torch path (``TorchBackend.rms_norm``: ``F.rms_norm(x.float(), w.float()).to(x.dtype)``) writes an fp32
copy of the input, normalises it, and casts back, and its backward does the same casts in reverse: about six
full-size passes, three of them fp32, per direction. These kernels read a row once and write it once forward
(keeping the fp32 reciprocal RMS per row for backward), and read the row and its gradient once backward.
Numerics are the torch path's: y = cast(x·r·w) with r = rsqrt(mean(x²) + eps), all in fp32;
dx = r·(g·w) − x·r³·mean(g·w·x), dw = Σ_rows g·x·r (fp32 partial sums per program, summed by torch).
"""

from __future__ import annotations

import torch

from executor.kernels.first_use import checked_once

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

#: Row programs of the backward (each accumulates a partial dw over its rows).
BWD_PROGRAMS = 512
#: The widest row one program holds (fp32 in registers).
MAX_WIDTH = 16384
#: Values one program's tile holds: rows narrower than this are taken several at a time.
TILE_ELEMENTS = 2048


_CHECKED: dict[tuple, bool] = {}


def available(t: torch.Tensor) -> bool:
    """Whether the kernels run on ``t``: CUDA, a row of at most MAX_WIDTH, and their first-use check against
    torch passed for this dtype and width (a failure costs speed, never the run)."""
    if triton is None or not t.is_cuda or t.shape[-1] > MAX_WIDTH:
        return False
    return checked_once(_CHECKED, (t.dtype, str(t.device), t.shape[-1]), _check_against_torch, "fused RMSNorm")


def _check_against_torch(dtype: torch.dtype, device: str, n: int) -> None:
    """Raise if the kernels differ from torch's fp32 RMSNorm (beyond one rounding of ``dtype``), fwd and bwd;
    1100 rows: more than one row per backward program, and a last tile of narrow rows cut short."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1100, n, device=device, generator=gen).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(n, device=device, generator=gen)).to(dtype).requires_grad_()
    y = fused_rms_norm(x, w, 1e-5)
    ref = torch.nn.functional.rms_norm(x.float(), (n,), w.float(), 1e-5)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(y.float(), ref, **tol)
    g = torch.randn(y.shape, device=device, generator=gen).to(dtype)
    got = torch.autograd.grad(y, (x, w), g)
    want = torch.autograd.grad(ref, (x, w), g.float())
    torch.testing.assert_close(got[0].float(), want[0].float(), **tol)
    torch.testing.assert_close(got[1].float(), want[1].float(), rtol=tol["rtol"], atol=tol["atol"] * 100)


if triton is not None:

    @triton.jit
    def _fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, rows, n, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        rmask, cmask = r < rows, cols < n
        mask = rmask[:, None] & cmask[None, :]
        offs = r[:, None] * n + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n + eps)
        tl.store(rstd_ptr + r, rstd, mask=rmask)
        tl.store(y_ptr + offs, (x * rstd[:, None] * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _bwd_kernel(x_ptr, w_ptr, g_ptr, rstd_ptr, dx_ptr, dw_ptr, rows, n, rows_per_program,
                    BLOCK: tl.constexpr, ROWS: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        cmask = cols < n
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        dw = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        start = pid * rows_per_program  # a multiple of ROWS
        for i in range(0, rows_per_program, ROWS):
            r = (start + i + tl.arange(0, ROWS)).to(tl.int64)
            rmask = r < rows
            mask = rmask[:, None] & cmask[None, :]
            offs = r[:, None] * n + cols[None, :]
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + r, mask=rmask, other=0.0)
            xhat = x * rstd[:, None]
            gw = g * w[None, :]
            dot = tl.sum(gw * xhat, axis=1) / n
            tl.store(dx_ptr + offs, ((gw - xhat * dot[:, None]) * rstd[:, None]).to(dx_ptr.dtype.element_ty),
                     mask=mask)
            dw += g * xhat
        tl.store(dw_ptr + pid * n + cols, tl.sum(dw, axis=0), mask=cmask)


def _tile(n: int) -> tuple[int, int, int]:
    """(BLOCK, ROWS, num_warps) for rows of ``n``: a row padded to a power of two, and as many rows a tile as
    fill TILE_ELEMENTS, so that narrow rows (Qwen3's per-head q/k norms over 128 values) do not leave a
    one-warp program a row latency-bound."""
    block = triton.next_power_of_2(n)
    rows = max(1, TILE_ELEMENTS // block)
    return block, rows, min(max(block * rows // 256, 1), 16)


class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        rows, n = x2.shape
        y = torch.empty_like(x2)
        rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
        block, tile_rows, warps = _tile(n)
        _fwd_kernel[(triton.cdiv(rows, tile_rows),)](x2, weight, y, rstd, rows, n, eps, BLOCK=block,
                                                     ROWS=tile_rows, num_warps=warps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, g):
        x2, weight, rstd = ctx.saved_tensors
        rows, n = x2.shape
        g2 = g.reshape(-1, n)
        if not g2.is_contiguous():
            g2 = g2.contiguous()
        dx = torch.empty_like(x2)
        block, tile_rows, warps = _tile(n)
        programs = max(min(BWD_PROGRAMS, triton.cdiv(rows, tile_rows)), 1)
        per = triton.cdiv(triton.cdiv(rows, programs), tile_rows) * tile_rows
        programs = triton.cdiv(rows, per)
        dw = torch.empty(programs, n, device=x2.device, dtype=torch.float32)
        _bwd_kernel[(programs,)](x2, weight, g2, rstd, dx, dw, rows, n, per, BLOCK=block, ROWS=tile_rows,
                                 num_warps=warps)
        return dx.view(ctx.shape), dw.sum(0).to(weight.dtype), None


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dim times ``weight``, fp32 math, in ``x``'s dtype (as the torch path)."""
    return _FusedRMSNorm.apply(x, weight, eps)


def pick_rms_norm(fused: bool, kernels):
    """The RMSNorm a module calls: the fused kernel where it runs (CUDA) when ``fused``, else the kernel
    backend's ``rms_norm`` (looked up at each call, so a backend patched later is the one used)."""

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if fused and available(x):
            return fused_rms_norm(x, weight, eps)
        return kernels.rms_norm(x, weight, eps)

    return rms_norm
