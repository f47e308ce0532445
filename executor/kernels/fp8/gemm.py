"""The fp8 GEMMs (:mod:`executor.kernels.fp8`): C = A·Bᵀ with A [M, K] and B [N, K] quantised per row to
e4m3 (1 byte an element, an fp32 scale amax/448 a row: :mod:`executor.kernels.fp8.quantize`), products
accumulated in fp32, written in bf16; and the autograd functions that run a linear layer's forward, dgrad
and wgrad, and the experts', through them.

Kernels (CUDA sm90 only): ``torch._scaled_mm`` for dense linears (B column-major, scales [M, 1] and
[1, N]; K and N multiples of 16, zero-padded here when they are not) and ``torch._scaled_grouped_mm`` for
the experts (A row-major, B column-major, fp32 scales, int32 cumulative offsets). Forward and dgrad of
the experts are its 2D×3D form (scales [M] and [G, N]). The expert wgrad is its 2D×2D form, groups along
the contraction dim (the tokens), with scales per (group, row of A) and (group, row of B); that kernel
needs every group's token count a positive multiple of 16, so the rows are copied into a layout where
each group is padded with zero rows to such a count (an empty expert gets 16 zero rows: a zero
gradient), which leaves amax and products unchanged. That fp8 wgrad is opt-in (FOLDTUNE_FP8_WGRAD=fp8): by
default the expert wgrad runs as a bf16 ``torch._grouped_mm``, which on an H100 (the Mixtral proxy of
bench/fp8_step.py, docs/benchmarks.md) steps faster — the 2D×2D fp8 kernel ran only ~1.1× the bf16 one and its two
per-expert quantisations over the largest operands cost more than that saved — and leaves the weight
gradient unquantised.
(The padded layout is :class:`executor.kernels.fp8.quantize.PaddedGroups`.)

Emulation (``kernel=False``): the same quantisation, then dequantise, matmul in fp32, round to bf16 — the
kernels' numbers up to fp32 summation order. It runs where the kernels are absent (CPU, GPUs other than
sm90, FOLDTUNE_FP8_KERNELS=0), for grouped GEMMs whose K or N is not a multiple of 16, and when the
first-use self-check fails; :func:`emulation_reason` and :func:`gemm_counts` say which ran. The LM head,
the router and attention's SDPA stay bf16.

The self-check runs once per device and process through
:func:`executor.kernels.first_use.checked_once` (on a thread of its own; a check that raises turns the
kernels off, with a warning): each kernel against the emulation, within bf16 rounding (2^-7 relative). It
lives here, beside the gate that reads its verdict (``_CHECKED``), as the other kernels' checks do.
"""

from __future__ import annotations

import functools
import os
from collections import Counter

import torch

from executor.kernels.fp8.quantize import (
    ALIGN,
    E4M3,
    dequantize,
    padded_groups,
    quantize_both,
    quantize_groups_colwise,
    quantize_rowwise,
)
from executor.kernels.fp8.weight_cache import quantized_weight
from executor.kernels.torch_backend import TorchBackend, grouped_mm_works
from executor.kernels.first_use import checked_once

OUT = torch.bfloat16  # what the scaled GEMMs write

_COUNTS: Counter = Counter()  # GEMM calls in this process: "kernel" / "emulated"
_CHECKED: dict[tuple, bool] = {}  # first-use verdicts, keyed (device,): True where the kernels equal the emulation


# ---- where the kernels run ----------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _capability(device: str) -> tuple[int, int]:
    """``device``'s compute capability (asked once: :func:`kernels_ok` runs on every GEMM call)."""
    return torch.cuda.get_device_capability(torch.device(device))


def _kernels_absent(device: torch.device) -> str | None:
    """Why the sm90 scaled GEMMs cannot run on ``device`` (None: they can, pending the self-check)."""
    if device.type != "cuda":
        return f"no fp8 GEMM kernels on {device.type}"
    if os.environ.get("FOLDTUNE_FP8_KERNELS", "1") == "0":
        return "FOLDTUNE_FP8_KERNELS=0"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no _scaled_grouped_mm"
    major, minor = _capability(str(device))
    if major != 9:
        return f"rowwise fp8 grouped GEMMs need sm90, this GPU is sm{major}{minor}"
    return None


def kernels_ok(device: torch.device) -> bool:
    """Whether the scaled GEMMs run on ``device``: present (asked every call, so FOLDTUNE_FP8_KERNELS set
    later in the process counts, as :func:`emulation_reason` reports it), and equal to the emulation
    (checked once per device)."""
    return _kernels_absent(device) is None and checked_once(_CHECKED, (str(device),), _check_against_emulation,
                                                            "fp8 scaled GEMMs")


def fast_accum_ok(device: torch.device) -> bool:
    """Whether the forward GEMMs use the kernels' fast accumulation (Transformer Engine's recipe: the forward
    GEMM unpromoted, dgrad and wgrad with promoted accumulation): opt-in with FOLDTUNE_FP8_FAST_ACCUM=1, on
    the kernels only, and only after a first-use check against the emulation (a failure keeps it off)."""
    return (os.environ.get("FOLDTUNE_FP8_FAST_ACCUM", "0") == "1" and kernels_ok(device)
            and checked_once(_CHECKED, ("fast_accum", str(device)), _check_fast_accum, "fp8 fast accumulation"))


def emulation_reason(device: torch.device | str) -> str | None:
    """Why fp8 GEMMs on ``device`` are emulated, None where the kernels run."""
    device = torch.device(device)
    absent = _kernels_absent(device)
    if absent is not None:
        return absent
    return None if kernels_ok(device) else "the kernels failed their self-check against the emulation"


def gemm_counts() -> dict[str, int]:
    """fp8 GEMM calls in this process so far, by path ('kernel', 'emulated')."""
    return dict(_COUNTS)


def reset_gemm_counts() -> None:
    """Start counting afresh: a rank kept between trials (executor.rank_pool) reports each trial's own calls."""
    _COUNTS.clear()


def _fp32_grouped_nt(a_MK: torch.Tensor, b_GNK: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    return TorchBackend().grouped_mm(a_MK, b_GNK, offs_G)


def _fp32_grouped_2d2d(a_NT: torch.Tensor, b_KT: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """[G, N, K]: group g is a[:, offs[g-1]:offs[g]] · b[:, same]ᵀ (fp32; a loop where _grouped_mm refuses)."""
    if grouped_mm_works(a_NT.device, a_NT.dtype):
        return torch._grouped_mm(a_NT, b_KT.t(), offs=offs_G)
    bounds = [0, *offs_G.tolist()]
    return torch.stack([a_NT[:, lo:hi] @ b_KT[:, lo:hi].t() for lo, hi in zip(bounds, bounds[1:])])


# ---- dense: torch._scaled_mm ----------------------------------------------------------------------------

def _pad_dim(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = -x.shape[dim] % multiple
    if not extra:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim)


def _pad_quantised(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 [N, K] and its row scales zero-padded to multiples of 16 in both dims (zero bytes; scale 1 for
    the new rows): the bytes and scales quantising the zero-padded operand gives."""
    n, k = q.shape
    if not (n % ALIGN or k % ALIGN):
        return q, scale
    padded = _pad_dim(_pad_dim(q.view(torch.uint8), 1, ALIGN), 0, ALIGN).view(E4M3)
    return padded, torch.cat([scale, scale.new_ones(padded.shape[0] - n)])


def scaled_mm_nt(a_MK: torch.Tensor | None, b_NK: torch.Tensor | None, kernel: bool,
                 b_quantised: tuple[torch.Tensor, torch.Tensor] | None = None,
                 a_quantised: tuple[torch.Tensor, torch.Tensor] | None = None, fast_accum: bool = False) -> torch.Tensor:
    """a·bᵀ [M, N] in bf16, both operands quantised per row (along K); ``kernel``: torch._scaled_mm;
    ``b_quantised`` / ``a_quantised``: an operand's (q, scale) if made already (:func:`quantized_weight`,
    :func:`quantize_both`), in which case the operand itself may be None; ``fast_accum``: the kernel's
    fast (unpromoted) accumulation (:func:`fast_accum_ok`; the emulation ignores it)."""
    _COUNTS["kernel" if kernel else "emulated"] += 1
    # the padding below is checked on the shape first: each view or copy is a host-side op (about 2 us on an
    # H200's host), and this runs three times a linear's forward + backward
    if a_quantised is not None:
        qa, sa = a_quantised
        if kernel and qa.shape[1] % ALIGN:  # zero bytes: what quantising the zero-padded operand gives
            qa = _pad_dim(qa.view(torch.uint8), 1, ALIGN).view(E4M3)
    else:
        if kernel and a_MK.shape[1] % ALIGN:  # zero columns change neither amax nor the products
            a_MK = _pad_dim(a_MK, 1, ALIGN)
        qa, sa = quantize_rowwise(a_MK)
    qb, sb = b_quantised if b_quantised is not None else quantize_rowwise(b_NK)
    n = qb.shape[0]
    if not kernel:
        return (dequantize(qa, sa) @ dequantize(qb, sb).t()).to(OUT)
    qb, sb = _pad_quantised(qb, sb)
    out = torch._scaled_mm(qa, qb.t(), sa.unsqueeze(1), sb.unsqueeze(0), out_dtype=OUT, use_fast_accum=fast_accum)
    return out[:, :n] if out.shape[1] != n else out


class _Linear(torch.autograd.Function):
    """fp8 forward, dgrad and wgrad of x·wᵀ. Where the weight gets a gradient, x is quantised in both forms
    at once (:func:`quantize_both`): the rowwise one feeds the forward GEMM and the transposed one (xᵀ
    scaled per column of x, the wgrad's B) is what is saved for the backward — 1 byte an element instead of
    x's 2 — and dy likewise gives the dgrad's A and the wgrad's A from one call."""

    @staticmethod
    def forward(ctx, x_MK, w_NK, kernel, grad):
        ctx.kernel = kernel
        ctx.x_dtype, ctx.x_shape = x_MK.dtype, x_MK.shape
        # the weight itself, not through save_for_backward: under activation checkpointing the saved tensors
        # come back as new tensor objects, which the weight cache cannot key on, and the backward's dgrad form
        # would be quantised afresh every micro-batch (36 ms of a 540 ms Mixtral-proxy step under full
        # recompute on an H100, docs/benchmarks.md). What this gives up: autograd's check that the weight was
        # not written between forward and backward; the weight cache keys on its version and re-quantises.
        ctx.weight = w_NK
        needs_x, needs_w = ctx.needs_input_grad[:2]
        w_q = quantized_weight(w_NK, both=grad and needs_x)
        fast = kernel and fast_accum_ok(x_MK.device)
        if not (grad and needs_w):
            return _as(scaled_mm_nt(x_MK, w_NK, kernel, w_q, fast_accum=fast), x_MK.dtype)
        k = x_MK.shape[1]
        if kernel and k % ALIGN:  # zero columns of x change neither amax nor the products (nor xᵀ's per-column scales)
            x_MK = _pad_dim(x_MK, 1, ALIGN)
        x_rows, (xt_q, xt_scale) = quantize_both(_contiguous(x_MK))
        ctx.save_for_backward(*((xt_q, xt_scale) if xt_q.shape[0] == k else (xt_q[:k], xt_scale[:k])))
        return _as(scaled_mm_nt(None, None, kernel, w_q, a_quantised=x_rows, fast_accum=fast), x_MK.dtype)

    @staticmethod
    def backward(ctx, dy_MN):
        w_NK, xt = ctx.weight, ctx.saved_tensors
        needs_x, needs_w = ctx.needs_input_grad[:2]
        dx = dw = None
        if needs_w:
            dy_rows, dyt = quantize_both(_contiguous(dy_MN))
            dw = _as(scaled_mm_nt(None, None, ctx.kernel, xt, a_quantised=dyt), w_NK.dtype)
        else:
            dy_rows = None
        if needs_x:
            w_t = quantized_weight(w_NK, transposed=True)
            dx = _as(scaled_mm_nt(dy_MN, None, ctx.kernel, w_t) if dy_rows is None
                     else scaled_mm_nt(None, None, ctx.kernel, w_t, a_quantised=dy_rows), ctx.x_dtype)
        return dx, dw, None, None


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, skipped where it would return ``t`` itself (the GEMMs write bf16, the usual dtype): a
    no-op ``.to`` still parses its arguments in torch's Python binding, a microsecond on an H200's host."""
    return t if t.dtype == dtype else t.to(dtype)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()``, skipped where ``t`` is contiguous already (the binding's argument parsing saved)."""
    return t if t.is_contiguous() else t.contiguous()


def linear(x: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) (no bias) with fp8 forward, dgrad and wgrad; x is [..., K], the result [..., N]."""
    if x.dim() == 2:  # no reshape and view: two host-side ops and an autograd node fewer in the backward
        return _Linear.apply(x, w_NK, kernels_ok(x.device), torch.is_grad_enabled())
    x_MK = x.reshape(-1, x.shape[-1])
    y = _Linear.apply(x_MK, w_NK, kernels_ok(x.device), torch.is_grad_enabled())
    return y.view(*x.shape[:-1], w_NK.shape[0])


# ---- grouped: torch._scaled_grouped_mm ------------------------------------------------------------------

def _grouped_kernel_fits(*dims: int) -> bool:
    return all(d % ALIGN == 0 for d in dims)


def scaled_grouped_nt(a_MK: torch.Tensor, b_GNK: torch.Tensor, offs_G: torch.Tensor, kernel: bool,
                      b_quantised: tuple[torch.Tensor, torch.Tensor] | None = None,
                      fast_accum: bool = False) -> torch.Tensor:
    """[M, N] bf16: rows offs[g-1]:offs[g] of a times b[g]ᵀ, a quantised per row, b per (group, row);
    ``b_quantised``: b's (q, scale) if made already (:func:`quantized_weight`)."""
    kernel = kernel and _grouped_kernel_fits(*b_GNK.shape[1:])
    _COUNTS["kernel" if kernel else "emulated"] += 1
    qa, sa = quantize_rowwise(a_MK)
    qb, sb = b_quantised if b_quantised is not None else quantize_rowwise(b_GNK)
    if not kernel:
        return _fp32_grouped_nt(dequantize(qa, sa), dequantize(qb, sb), offs_G).to(OUT)
    return torch._scaled_grouped_mm(qa, qb.transpose(-2, -1), sa, sb, offs=offs_G, out_dtype=OUT,
                                    use_fast_accum=fast_accum)

def scaled_grouped_wgrad(dy_MN: torch.Tensor, x_MK: torch.Tensor, offs_G: torch.Tensor, kernel: bool) -> torch.Tensor:
    """[G, N, K] bf16: group g's dy rows ᵀ · its x rows, both quantised per (group, column)."""
    kernel = kernel and _grouped_kernel_fits(dy_MN.shape[1], x_MK.shape[1])
    _COUNTS["kernel" if kernel else "emulated"] += 1
    groups = padded_groups(offs_G, dy_MN.shape[0])
    qa, sa = quantize_groups_colwise(dy_MN, groups)  # [N, rows], [G, N]
    qb, sb = quantize_groups_colwise(x_MK, groups)  # [K, rows], [G, K]
    if kernel:
        return torch._scaled_grouped_mm(qa, qb.t(), sa.flatten(), sb.flatten(), offs=groups.offs_G, out_dtype=OUT)

    def dq(q, scale):  # column r of q is in group group_of_block[r // 16]
        per_block = scale.t()[:, groups.group_of_block].unsqueeze(-1)  # [C, rows/16, 1]
        return (q.float().view(q.shape[0], -1, ALIGN) * per_block).view(q.shape)

    return _fp32_grouped_2d2d(dq(qa, sa), dq(qb, sb), groups.offs_G).to(OUT)


def _bf16_grouped_wgrad(dy_MN: torch.Tensor, x_MK: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """[G, N, K] in dy's dtype without quantisation (FOLDTUNE_FP8_WGRAD=bf16)."""
    if grouped_mm_works(dy_MN.device, dy_MN.dtype):
        return torch._grouped_mm(dy_MN.t(), x_MK, offs=offs_G)
    return _fp32_grouped_2d2d(dy_MN.t().float(), x_MK.t().float(), offs_G).to(dy_MN.dtype)


def fp8_wgrad() -> bool:
    """Whether the expert wgrad runs in fp8 (FOLDTUNE_FP8_WGRAD=fp8) rather than bf16 (the default)."""
    return os.environ.get("FOLDTUNE_FP8_WGRAD", "bf16") == "fp8"


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_GNK, offs_G, kernel, grad):
        ctx.save_for_backward(x_MK, offs_G)
        ctx.weight = w_GNK  # the weight itself, for the weight cache (see _Linear.forward)
        ctx.kernel = kernel
        # where dgrad will run, both weight forms in one pass (the backward then finds its form cached)
        w_q = quantized_weight(w_GNK, both=grad and ctx.needs_input_grad[0])
        fast = kernel and fast_accum_ok(x_MK.device)
        return scaled_grouped_nt(x_MK, w_GNK, offs_G, kernel, w_q, fast_accum=fast).to(x_MK.dtype)

    @staticmethod
    def backward(ctx, dy_MN):
        (x_MK, offs_G), w_GNK = ctx.saved_tensors, ctx.weight
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = scaled_grouped_nt(dy_MN, w_GNK.transpose(-2, -1), offs_G, ctx.kernel,
                                   quantized_weight(w_GNK, transposed=True)).to(x_MK.dtype)
        if ctx.needs_input_grad[1]:
            dw = (scaled_grouped_wgrad(dy_MN, x_MK, offs_G, ctx.kernel) if fp8_wgrad()
                  else _bf16_grouped_wgrad(dy_MN, x_MK, offs_G)).to(w_GNK.dtype)
        return dx, dw, None, None, None


def grouped_mm(x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """KernelBackend.grouped_mm in fp8: rows offs[g-1]:offs[g] of x times w[g]ᵀ (offs int32, offs[-1] == M)."""
    return _GroupedMM.apply(x_MK, w_GNK, offs_G, kernels_ok(x_MK.device), torch.is_grad_enabled())


# ---- first-use self-check: the kernels against the emulation -----------------------------------------

def _check_against_emulation(device: str) -> None:
    """Raise if a kernel differs from the emulation by more than bf16 rounding (2^-7 relative: one or two
    bf16 ulps after a different fp32 summation order) on random data: dense forward and a wgrad whose
    token count is no multiple of 16; grouped forward, dgrad and wgrad with an empty group, a group of 5
    rows and a final group of 67."""
    counted = Counter(_COUNTS)
    try:
        _compare_on(device)
    finally:  # the check's own calls are not the run's
        _COUNTS.clear()
        _COUNTS.update(counted)


def _check_fast_accum(_: str, device: str) -> None:
    """Raise if the forward GEMMs with fast accumulation differ from the emulation by more than the
    kernels' check allows, at a contraction of 4096 (where unpromoted accumulation loses the most)."""
    counted = Counter(_COUNTS)
    try:
        gen = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(256, 4096, device=device, generator=gen).to(torch.bfloat16)
        w = torch.randn(2, 64, 4096, device=device, generator=gen).to(torch.bfloat16)
        offs = torch.tensor([100, 256], device=device, dtype=torch.int32)
        for fast, emulated in ((scaled_mm_nt(x, w[0], True, fast_accum=True), scaled_mm_nt(x, w[0], False)),
                               (scaled_grouped_nt(x, w, offs, True, fast_accum=True),
                                scaled_grouped_nt(x, w, offs, False))):
            torch.testing.assert_close(fast.float(), emulated.float(), rtol=2**-7,
                                       atol=1e-3 * float(emulated.abs().max()))
    finally:
        _COUNTS.clear()
        _COUNTS.update(counted)


def _compare_on(device: str) -> None:
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=device, generator=gen).to(torch.bfloat16)

    def same(kernel, emulated):
        torch.testing.assert_close(kernel.float(), emulated.float(), rtol=2**-7,
                                   atol=1e-3 * float(emulated.abs().max()))

    x, dy, w = rand(72, 64), rand(72, 48), rand(3, 48, 64)
    offs = torch.tensor([5, 5, 72], device=device, dtype=torch.int32)
    same(scaled_mm_nt(x, w[0], True), scaled_mm_nt(x, w[0], False))
    same(scaled_mm_nt(dy.t(), x.t(), True), scaled_mm_nt(dy.t(), x.t(), False))
    same(scaled_grouped_nt(x, w, offs, True), scaled_grouped_nt(x, w, offs, False))
    wt = w.transpose(-2, -1)
    same(scaled_grouped_nt(dy, wt, offs, True), scaled_grouped_nt(dy, wt, offs, False))
    same(scaled_grouped_wgrad(dy, x, offs, True), scaled_grouped_wgrad(dy, x, offs, False))
