"""FP8 training GEMMs with dynamic ("current") rowwise scaling, through torch's scaled (grouped) GEMMs.

Every GEMM here is C = A·Bᵀ with both operands quantised to e4m3 along the contraction dim: each row of
A [M, K] and of B [N, K] gets its own fp32 scale amax/448 (448: e4m3's largest finite value), the kernel
multiplies the e4m3 values (products exact), accumulates in fp32, applies scale_a[m]·scale_b[n] in its
epilogue and writes bf16. The three GEMMs of a linear layer all take that form, each operand quantised
along the axis its GEMM contracts:

    forward  y  = x·wᵀ     A = x [M, K]     B = w [N, K]
    dgrad    dx = dy·w     A = dy [M, N]    B = wᵀ [K, N]
    wgrad    dw = dyᵀ·x    A = dyᵀ [N, M]   B = xᵀ [K, M]

so no quantised copy serves two GEMMs; autograd saves the bf16 inputs, as on the bf16 path (fp8 buys GEMM
throughput here, not activation memory). Parameters, activations and gradients stay bf16.

Kernels (CUDA sm90 only): ``torch._scaled_mm`` for dense linears (B column-major, scales [M, 1] and
[1, N]; K and N multiples of 16, zero-padded here when they are not) and ``torch._scaled_grouped_mm`` for
the experts (A row-major, B column-major, fp32 scales, int32 cumulative offsets). Forward and dgrad of
the experts are its 2D×3D form (scales [M] and [G, N]). The expert wgrad is its 2D×2D form, groups along
the contraction dim (the tokens), with scales per (group, row of A) and (group, row of B); that kernel
needs every group's token count a positive multiple of 16, so the rows are copied into a layout where
each group is padded with zero rows to such a count (an empty expert gets 16 zero rows: a zero
gradient), which leaves amax and products unchanged. FOLDTUNE_FP8_WGRAD=bf16 runs the expert wgrad as a
bf16 ``torch._grouped_mm`` instead (no quantisation passes over the two largest operands).

Quantisation on CUDA is Triton: a row-contiguous operand (activations, a weight's forward form) in one
kernel (amax, scale, cast); any other layout as torch's max-|x| reduction, then one Triton pass that
multiplies by 1/scale, rounds to e4m3 exactly as torch's cast does and writes the layout the GEMM takes
(transposed operands and the wgrad's per-expert padded layout included, with no bf16 or fp32 copy in
between); the wgrad's per-(expert, column) amax is a Triton segmented reduction. The torch ops (an fp32
product and a rounding copy) are the reference, run on CPU, without Triton, with FOLDTUNE_FP8_TRITON=0, or
if the first-use check (Triton against torch, byte for byte) fails.

Weights are quantised once per value, not per call (:func:`quantized_weight`): their forward and dgrad
forms are cached, keyed on the parameter, its version counter and data pointer, as Transformer Engine
caches fp8 weights across the micro-batches of a step. The cache holds 1 byte per weight element per form (2 once
forward and dgrad have run) plus fp32 scales per row; FOLDTUNE_FP8_WEIGHT_CACHE=0 turns it off.

Emulation (``kernel=False``): the same quantisation, then dequantise, matmul in fp32, round to bf16 — the
kernels' numbers up to fp32 summation order. It runs where the kernels are absent (CPU, GPUs other than
sm90, FOLDTUNE_FP8_KERNELS=0), for grouped GEMMs whose K or N is not a multiple of 16, and when the
first-use self-check (kernels against emulation on the device) fails; :func:`emulation_reason` and
:func:`gemm_counts` say which ran. The LM head, the router and attention's SDPA stay bf16.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections import Counter
from dataclasses import dataclass

import torch

from executor.kernels.torch_backend import TorchBackend, grouped_mm_works
from executor.kernels.triton_permute import checked_once

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# 1/448 rounded to fp32: scales are amax times this (one fp32 rounding, the same on every device and in
# Triton; ``amax / 448`` is a true division on CPU but a multiply by the reciprocal on CUDA)
INV_E4M3_MAX = torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32).item()
FP32_TINY = torch.finfo(torch.float32).tiny
ALIGN = 16  # the scaled GEMMs' granularity: 16 bytes of e4m3 (dims, wgrad group sizes)
OUT = torch.bfloat16  # what the scaled GEMMs write

_CHECKED: dict[tuple, bool] = {}
_COUNTS: Counter = Counter()  # GEMM calls in this process: "kernel" / "emulated"


# ---- quantisation: torch ops (the reference; CPU and the fallback) ------------------------------------

def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """amax/448 in fp32 (as amax · fp32(1/448)); 1 where amax is 0 (an all-zero row quantises to zeros
    instead of 0/0); at least fp32's smallest normal, so that its reciprocal stays finite."""
    scale = torch.where(amax > 0, amax * INV_E4M3_MAX, torch.ones_like(amax))
    return scale.clamp_(min=FP32_TINY)


def _cast(out_BRC: torch.Tensor, x_BRC: torch.Tensor, inv: torch.Tensor, row_div: int = 1) -> None:
    """out[b, i, j] = e4m3(x[b, i, j] · inv[b, i // row_div, j]) for [B, R, C] views of any strides (``inv``,
    fp32, broadcasts through stride-0 dims): an fp32 product, then the rounding (to nearest even) copy, which
    also transposes where ``out``'s strides differ from ``x``'s. No clamp: with inv = 448/amax every
    |x · inv| is at most 448·(1 + 2^-22), which rounds to 448 (only from 464 up would it round past)."""
    b, r, c = x_BRC.shape
    if row_div > 1:
        out_BRC.view(b, r // row_div, row_div, c).copy_(torch.mul(x_BRC.view(b, r // row_div, row_div, c),
                                                                  inv.unsqueeze(2)))
    else:
        out_BRC.copy_(torch.mul(x_BRC, inv))


def _as_brc(t: torch.Tensor) -> torch.Tensor:
    if t.dim() not in (2, 3):
        raise ValueError(f"fp8 quantisation takes 2-D or 3-D tensors, got {tuple(t.shape)}")
    return t.unsqueeze(0) if t.dim() == 2 else t


def _rowwise_scale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1/scale) per row of the last dim, fp32 (one read of ``x``: torch's max-|x| reduction, exact)."""
    amax = torch.linalg.vector_norm(x, float("inf"), dim=-1).float()  # max |x| per row, no |x| temporary
    scale = _scale_of(amax)
    return scale, 1.0 / scale


def _quantize_rowwise_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale, inv = _rowwise_scale(x)
    q = torch.empty(x.shape, dtype=E4M3, device=x.device)
    x3 = _as_brc(x)
    _cast(_as_brc(q), x3, _as_brc(inv.unsqueeze(-1)).expand(x3.shape))
    return q, scale


def _group_colwise_scale_torch(x_MC: torch.Tensor, groups: PaddedGroups) -> tuple[torch.Tensor, torch.Tensor]:
    """(the padded rows of ``x`` [rows, C] bf16, scale [G, C]): amax per (group, column) over 16-row blocks."""
    c, g = x_MC.shape[1], groups.offs_G.numel()
    padded = x_MC.new_zeros(groups.rows, c).index_copy_(0, groups.dest_M, x_MC)
    blocks = padded.view(groups.rows // ALIGN, ALIGN, c)  # every 16-row block lies in one group
    block_amax = torch.linalg.vector_norm(blocks, float("inf"), dim=1).float()
    index = groups.group_of_block.unsqueeze(1).expand(-1, c)
    amax = block_amax.new_zeros(g, c).scatter_reduce_(0, index, block_amax, "amax")
    return padded, _scale_of(amax)


def _quantize_groups_colwise_torch(x_MC: torch.Tensor, groups: PaddedGroups) -> tuple[torch.Tensor, torch.Tensor]:
    padded, scale = _group_colwise_scale_torch(x_MC, groups)
    q = torch.empty(x_MC.shape[1], groups.rows, dtype=E4M3, device=x_MC.device)
    _cast(q.t().unsqueeze(0), padded.unsqueeze(0), (1.0 / scale)[groups.group_of_block].unsqueeze(0), ALIGN)
    return q, scale


# ---- quantisation: Triton (CUDA) ------------------------------------------------------------------------
# The torch path's cast is an fp32 product into a temporary the size of the operand, then a rounding copy
# into e4m3 (which, for a transposed operand, writes across the grain), and the wgrad's per-expert layout
# is first built as a padded bf16 copy: 4-6 passes over the operand. Here: a row-contiguous operand in
# one kernel (_rows_kernel: amax, the scale arithmetic of _scale_of with correctly rounded divisions, the
# cast); any other layout as torch's amax reduction and scale arithmetic, then one cast pass that reads
# the operand in its own layout and writes e4m3 in the GEMM's (Triton moves tiles between the two
# layouts through shared memory); the wgrad's per-(expert, column) amax as a segmented Triton reduction.
# Triton's max ignores NaN where torch's propagates it: a row holding a NaN gets a finite scale here (its
# NaN still quantises to NaN), the only inputs on which the paths differ. The rounding is torch's
# fp32 → e4m3fn conversion written in integer operations on the product's bits (round to nearest even,
# subnormals below 2^-6; beyond 448 it saturates as torch 2.13's cast does — torch versions differ there,
# some give NaN from 464 up, but amax scaling never gets there), so it does not depend on the hardware's
# cvt or Triton's lowering of it; the first use on a device checks it byte for byte against the torch path
# (every bf16 value up to 448 among the cases) and keeps the torch path if it differs.

if triton is not None:

    @triton.jit
    def _e4m3_byte(v):
        """The e4m3fn byte of fp32 ``v`` as torch casts it, in integer ops: round to nearest even (subnormals
        below 2^-6 too), ±448 from 448 up (infinities included), NaN stays NaN."""
        bits = v.to(tl.uint32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF
        # normal (mag >= 2^-6): rebias the exponent (127 → 7), round 23 mantissa bits to 3, ties to even
        odd = (mag >> 20) & 1
        normal = (mag - (120 << 23) + 0x7FFFF + odd) >> 20
        # below 2^-6: the subnormal code round(v / 2^-9), ties to even, from the integer mantissa
        exp_field = mag >> 23
        mant = (mag & 0x7FFFFF) | tl.where(exp_field > 0, 0x800000, 0).to(tl.uint32)
        shift = tl.minimum(tl.where(exp_field > 0, 141 - exp_field.to(tl.int32), 140), 31).to(tl.uint32)
        sub = mant >> shift
        rem = mant & ((tl.full(mant.shape, 1, tl.uint32) << shift) - 1)
        half = tl.full(mant.shape, 1, tl.uint32) << (shift - 1)
        sub += ((rem > half) | ((rem == half) & ((sub & 1) == 1))).to(tl.uint32)
        code = tl.where(mag >= (121 << 23), normal, sub)
        code = tl.where(mag > 0x7F800000, 0x7F, tl.where(mag >= 0x43E00000, 0x7E, code).to(tl.uint32))  # NaN; ≥ 448
        return (code | sign).to(tl.uint8)

    @triton.jit
    def _offsets(rows, cols, s_r, s_c, UNIT: tl.constexpr):
        # [rows, cols] element offsets; UNIT names the dim of stride 1 (1 rows, 2 columns, 0 neither) so that
        # the compiler sees the contiguity and lays the tile's threads along it (coalesced, vectorised)
        if UNIT == 1:
            offsets = rows[:, None] + cols[None, :] * s_c
        elif UNIT == 2:
            offsets = rows[:, None] * s_r + cols[None, :]
        else:
            offsets = rows[:, None] * s_r + cols[None, :] * s_c
        return offsets

    @triton.jit
    def _cast_kernel(x_ptr, inv_ptr, src_ptr, grp_ptr, out_ptr, R, C, sx_b, sx_r, sx_c, si_b, si_r, si_c,
                     so_b, so_r, so_c, X_UNIT: tl.constexpr, OUT_UNIT: tl.constexpr, GATHER: tl.constexpr,
                     ROW_DIV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # out[b, r, c] = e4m3(x[b, r, c] · inv[b, r]) for one BLOCK_R × BLOCK_C tile of batch entry
        # program_id(2); GATHER (the wgrad layout): out row r is x row src[r] (a zero row where src[r] < 0)
        # scaled by inv[grp[r // ROW_DIV], c].
        b = tl.program_id(2).to(tl.int64)
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        in_r, in_c = rows < R, cols < C
        mask = in_r[:, None] & in_c[None, :]
        if GATHER:
            src = tl.load(src_ptr + rows, mask=in_r, other=-1).to(tl.int64)
            group = tl.load(grp_ptr + rows // ROW_DIV, mask=in_r, other=0).to(tl.int64)
            x = tl.load(x_ptr + _offsets(src, cols, sx_r, sx_c, X_UNIT), mask=mask & (src >= 0)[:, None], other=0.0)
            inv = tl.load(inv_ptr + group[:, None] * si_r + cols[None, :] * si_c, mask=mask, other=1.0)
        else:
            x = tl.load(x_ptr + b * sx_b + _offsets(rows, cols, sx_r, sx_c, X_UNIT), mask=mask, other=0.0)
            inv = tl.load(inv_ptr + b * si_b + rows * si_r, mask=in_r, other=1.0)[:, None]
        q = _e4m3_byte(x.to(tl.float32) * inv)
        tl.store(out_ptr + b * so_b + _offsets(rows, cols, so_r, so_c, OUT_UNIT), q, mask=mask)

    @triton.jit
    def _rows_kernel(x_ptr, q_ptr, scale_ptr, R, C, sx_r, INV_MAX: tl.constexpr, TINY: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # rowwise quantisation of BLOCK_R rows of a row-contiguous [R, C] in one kernel: amax over the row
        # in BLOCK_C chunks, the scale as _scale_of and 1/scale (correctly rounded divisions, as torch's),
        # then the cast, whose second read of the rows mostly hits L2
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        in_r = rows < R
        amax = tl.zeros([BLOCK_R], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            x = tl.load(x_ptr + rows[:, None] * sx_r + cols[None, :], mask=in_r[:, None] & (cols < C)[None, :],
                        other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        scale = tl.maximum(tl.where(amax > 0, amax * INV_MAX, 1.0), TINY)
        inv = tl.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), scale)
        tl.store(scale_ptr + rows, scale, mask=in_r)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            mask = in_r[:, None] & (cols < C)[None, :]
            x = tl.load(x_ptr + rows[:, None] * sx_r + cols[None, :], mask=mask, other=0.0)
            tl.store(q_ptr + rows[:, None] * C + cols[None, :], _e4m3_byte(x.to(tl.float32) * inv[:, None]),
                     mask=mask)

    @triton.jit
    def _group_amax_kernel(x_ptr, ends_ptr, amax_ptr, C, sx_r, sx_c, split, X_UNIT: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # max |x| over rows [ends[g-1], ends[g]) of BLOCK_C columns; part program_id(2) of ``split`` takes
        # every split-th BLOCK_R-row slab and folds its maximum in with an integer atomic max on the fp32 bits
        # (order-preserving for values >= 0), so the result is exact whatever the order.
        g = tl.program_id(1)
        cols = tl.program_id(0).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        in_c = cols < C
        end = tl.load(ends_ptr + g)
        start = tl.load(ends_ptr + g - 1, mask=g > 0, other=0)
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for r0 in range(start + tl.program_id(2) * BLOCK_R, end, split * BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            x = tl.load(x_ptr + _offsets(rows.to(tl.int64), cols, sx_r, sx_c, X_UNIT),
                        mask=(rows < end)[:, None] & in_c[None, :], other=0.0)
            acc = tl.maximum(acc, tl.max(tl.abs(x.to(tl.float32)), axis=0))
        tl.atomic_max(amax_ptr + g * C + cols, acc.to(tl.int32, bitcast=True), mask=in_c)


def _unit_dim(t: torch.Tensor) -> int:
    """Which of a [B, R, C] view's last two dims has stride 1 (2: C, 1: R, 0: neither)."""
    return 2 if t.stride(2) == 1 else 1 if t.stride(1) == 1 else 0


def _launch_cast(out_BRC, x_BRC, inv, si, *, src=None, grp=None, row_div: int = 1) -> None:
    """Tile shapes: 16 × 256 where operand and output both run along the row (C), 64 × 64 where one of
    them runs along R (a transposed read or write), so each load and store covers ≥ 64 contiguous bytes."""
    b, r, c = out_BRC.shape  # the output's rows: the gathered (padded) layout's where it differs from x's
    if not out_BRC.numel():
        return
    x_unit, out_unit = _unit_dim(x_BRC), _unit_dim(out_BRC)
    block_r, block_c = (16, 256) if x_unit == out_unit == 2 else (64, 64)
    grid = (triton.cdiv(r, block_r), triton.cdiv(c, block_c), b)
    gather = src is not None
    _cast_kernel[grid](x_BRC, inv, src if gather else inv, grp if gather else inv, out_BRC.view(torch.uint8),
                       r, c, *x_BRC.stride(), *si, *out_BRC.stride(), X_UNIT=x_unit, OUT_UNIT=out_unit,
                       GATHER=gather, ROW_DIV=row_div, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)


def _rows_flat(x: torch.Tensor) -> bool:
    """Whether ``x``'s rows (of its last dim) are contiguous and evenly spaced: one [rows, C] strided view."""
    return x.stride(-1) == 1 and (x.dim() == 2 or x.stride(0) == x.shape[1] * x.stride(1) or x.shape[0] == 1)


ROWS_BLOCK = (8, 512)  # the fused rowwise kernel's tile: 8 rows, 512 columns a chunk


def _quantize_rows_fused(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rowwise` of a row-contiguous ``x`` (:func:`_rows_flat`) in one kernel."""
    c = x.shape[-1]
    r = x.numel() // c if c else 0
    q = torch.empty(x.shape, dtype=E4M3, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if r and c:
        block_r, block_c = ROWS_BLOCK
        _rows_kernel[(triton.cdiv(r, block_r),)](x, q.view(torch.uint8), scale, r, c, x.stride(-2),
                                                 INV_MAX=INV_E4M3_MAX, TINY=FP32_TINY, BLOCK_R=block_r,
                                                 BLOCK_C=block_c, num_warps=4)
    elif r:
        scale.fill_(1.0)
    return q, scale


def _quantize_rowwise_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if _rows_flat(x) and _fused_rows_ok(x.device):
        return _quantize_rows_fused(x)
    return _quantize_rowwise_two_pass(x)


def _quantize_rowwise_two_pass(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's amax and scales, then the Triton cast (any strides: transposed operands)."""
    scale, inv = _rowwise_scale(x)
    q = torch.empty(x.shape, dtype=E4M3, device=x.device)
    inv3 = inv.reshape(-1, x.shape[-2]) if x.dim() == 3 else inv.unsqueeze(0)  # [B, R], contiguous
    _launch_cast(_as_brc(q), _as_brc(x), inv3, (inv3.stride(0), inv3.stride(1), 0))
    return q, scale


GROUP_AMAX_BLOCK = (32, 128)  # rows per slab, columns per program
GROUP_AMAX_PROGRAMS = 2048  # enough programs to fill an H100 (132 SMs) several times over


def _quantize_groups_colwise_triton(x_MC: torch.Tensor, groups: PaddedGroups) -> tuple[torch.Tensor, torch.Tensor]:
    m, c = x_MC.shape
    g = groups.offs_G.numel()
    amax_bits = torch.zeros(g, c, dtype=torch.int32, device=x_MC.device)
    block_r, block_c = GROUP_AMAX_BLOCK
    col_programs = triton.cdiv(c, block_c)
    split = max(1, min(triton.cdiv(m, g * block_r), GROUP_AMAX_PROGRAMS // (col_programs * g)))
    if m:
        _group_amax_kernel[(col_programs, g, split)](x_MC, groups.ends_G, amax_bits, c, *x_MC.stride(), split,
                                                     X_UNIT=_unit_dim(x_MC.unsqueeze(0)), BLOCK_R=block_r,
                                                     BLOCK_C=block_c, num_warps=4)
    scale = _scale_of(amax_bits.view(torch.float32))
    inv = 1.0 / scale
    src = torch.full((groups.rows,), -1, dtype=torch.int32, device=x_MC.device)
    src.index_copy_(0, groups.dest_M, torch.arange(m, dtype=torch.int32, device=x_MC.device))
    q = torch.empty(c, groups.rows, dtype=E4M3, device=x_MC.device)
    _launch_cast(q.t().unsqueeze(0), x_MC.unsqueeze(0), inv, (0, inv.stride(0), inv.stride(1)),
                 src=src, grp=groups.group_of_block, row_div=ALIGN)
    return q, scale


def _use_triton(device: torch.device) -> bool:
    """Triton quantisation on CUDA where it imports, FOLDTUNE_FP8_TRITON is not 0 and the first-use check
    (byte for byte against the torch path) passed."""
    return (triton is not None and device.type == "cuda" and os.environ.get("FOLDTUNE_FP8_TRITON", "1") != "0"
            and checked_once(_CHECKED, ("quantise", str(device)), _check_triton_quantise, "fp8 Triton quantisation"))


def _fused_rows_ok(device: torch.device) -> bool:
    """The one-kernel rowwise path, checked once per device against the torch path on its own (a failure
    keeps the two-pass Triton path)."""
    return device.type != "cuda" or checked_once(_CHECKED, ("rows", str(device)), _check_fused_rows,
                                                 "fp8 fused rowwise quantisation")


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): a contiguous e4m3 copy of ``x`` (2-D or 3-D, any strides) scaled per row of its last dim,
    scale = amax/448 in fp32 with shape ``x.shape[:-1]``, so that x ≈ q · scale[..., None]."""
    _as_brc(x)
    return (_quantize_rowwise_triton if _use_triton(x.device) else _quantize_rowwise_torch)(x)


def quantize_groups_colwise(x_MC: torch.Tensor, groups: PaddedGroups) -> tuple[torch.Tensor, torch.Tensor]:
    """(qT [C, rows] e4m3 contiguous, scale [G, C] fp32): the padded rows of ``x`` transposed, each column
    scaled per group — the wgrad GEMM's A (row-major) or, transposed back, its column-major B."""
    quantise = _quantize_groups_colwise_triton if _use_triton(x_MC.device) else _quantize_groups_colwise_torch
    return quantise(x_MC, groups)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values q · scale (per row of the last dim), the inverse of :func:`quantize_rowwise`."""
    return q.float() * scale.unsqueeze(-1)


# ---- weights: quantised once per update ----------------------------------------------------------------

@dataclass
class _CachedWeight:
    """The e4m3 forms made of one weight tensor (``base``) while it had ``state`` = (_version, data_ptr)."""

    base: weakref.ref
    state: tuple[int, int]
    forms: dict


_WEIGHT_CACHE: dict[int, _CachedWeight] = {}  # id(base) -> its forms; an entry dies with its tensor
_WEIGHT_COUNTS: Counter = Counter()  # weight quantisations: "quantised", "reused", "uncached"


def _cacheable(base: torch.Tensor) -> bool:
    """Whether ``base``'s version counter sees every write to its values: a leaf that owns its storage
    exactly (no other tensor with a counter of its own aliases it) and is not gathered in place."""
    if base.is_inference() or not base.is_leaf or not (base.requires_grad or isinstance(base, torch.nn.Parameter)):
        return False
    if base.storage_offset() or base.untyped_storage().nbytes() != base.numel() * base.element_size():
        return False
    # imported here: the optimizer's package imports the model, which imports this module
    from executor.optimizer import params_gathered_in_place

    return id(base) not in params_gathered_in_place()


def weight_cache_enabled() -> bool:
    return os.environ.get("FOLDTUNE_FP8_WEIGHT_CACHE", "1") != "0"


def quantized_weight(w: torch.Tensor, transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rowwise` of ``w`` (the forward's B) or, ``transposed``, of ``w`` with its last two
    dims swapped (the dgrad's B), made once per value of the weight and reused until it changes.

    Entries are keyed on the tensor whose storage ``w`` views (the parameter; ``w`` may be a view of it
    such as ``w13.flatten(1, 2)``) and the view's geometry, and are valid while that tensor's ``_version``
    and data pointer stay the same: an optimizer's in-place update, a checkpoint load (``copy_``) or a
    ``.data =`` swap makes the next call quantise afresh, so a cached form is never stale; across the
    micro-batches of a step (and the recomputed forward of activation checkpointing) the weights are
    quantised once. Not cached (quantised per call): tensors that are not leaves or not parameters, that
    alias a larger storage, or that an overlapped parameter all-gather writes behind their version counter;
    writes through ``.data`` aliases are invisible to the counter and must not be made to a parameter in
    use here. FOLDTUNE_FP8_WEIGHT_CACHE=0 turns the cache off.

    Memory: a cached weight holds its e4m3 forms until it changes or dies — 1 byte per element for each
    form (2 bytes per element once forward and dgrad have run) plus fp32 scales (4 bytes per row of
    each form); a superseded entry is freed before its replacement is made.
    """
    def make():
        return quantize_rowwise(w.transpose(-2, -1) if transposed else w)

    base = w if w._base is None else w._base
    if not weight_cache_enabled() or not _cacheable(base):
        _WEIGHT_COUNTS["uncached"] += 1
        return make()
    key, state = id(base), (base._version, base.data_ptr())
    entry = _WEIGHT_CACHE.get(key)
    if entry is None or entry.base() is not base:
        entry = _WEIGHT_CACHE[key] = _CachedWeight(weakref.ref(base), state, {})
        weakref.finalize(base, _WEIGHT_CACHE.pop, key, None)
    if entry.state != state:
        entry.forms.clear()  # stale: free it before the new forms are made
        entry.state = state
    form = (transposed, w.storage_offset(), tuple(w.shape), tuple(w.stride()))
    if form in entry.forms:
        _WEIGHT_COUNTS["reused"] += 1
    else:
        _WEIGHT_COUNTS["quantised"] += 1
        entry.forms[form] = make()
    return entry.forms[form]


def weight_counts() -> dict[str, int]:
    """Weight quantisations in this process so far: 'quantised' (made and cached), 'reused' (a cached form
    served), 'uncached' (made for one call)."""
    return dict(_WEIGHT_COUNTS)


def clear_weight_cache() -> None:
    """Drop every cached weight form (their memory returns to the allocator)."""
    _WEIGHT_CACHE.clear()


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


def scaled_mm_nt(a_MK: torch.Tensor, b_NK: torch.Tensor, kernel: bool,
                 b_quantised: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """a·bᵀ [M, N] in bf16, both operands quantised per row (along K); ``kernel``: torch._scaled_mm;
    ``b_quantised``: b's (q, scale) if made already (:func:`quantized_weight`)."""
    _COUNTS["kernel" if kernel else "emulated"] += 1
    n = b_NK.shape[0]
    if kernel:  # zero columns change neither amax nor the products
        a_MK = _pad_dim(a_MK, 1, ALIGN)
    qa, sa = quantize_rowwise(a_MK)
    qb, sb = b_quantised if b_quantised is not None else quantize_rowwise(b_NK)
    if not kernel:
        return (dequantize(qa, sa) @ dequantize(qb, sb).t()).to(OUT)
    qb, sb = _pad_quantised(qb, sb)
    out = torch._scaled_mm(qa, qb.t(), sa.unsqueeze(1), sb.unsqueeze(0), out_dtype=OUT)
    return out[:, :n] if out.shape[1] != n else out


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_NK, kernel):
        ctx.save_for_backward(x_MK, w_NK)
        ctx.kernel = kernel
        return scaled_mm_nt(x_MK, w_NK, kernel, quantized_weight(w_NK)).to(x_MK.dtype)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, w_NK = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = scaled_mm_nt(dy_MN, w_NK.t(), ctx.kernel, quantized_weight(w_NK, transposed=True)).to(x_MK.dtype)
        if ctx.needs_input_grad[1]:
            dw = scaled_mm_nt(dy_MN.t(), x_MK.t(), ctx.kernel).to(w_NK.dtype)
        return dx, dw, None


def linear(x: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) (no bias) with fp8 forward, dgrad and wgrad; x is [..., K], the result [..., N]."""
    x_MK = x.reshape(-1, x.shape[-1])
    y = _Linear.apply(x_MK, w_NK, kernels_ok(x.device))
    return y.view(*x.shape[:-1], w_NK.shape[0])


# ---- grouped: torch._scaled_grouped_mm ------------------------------------------------------------------

def _grouped_kernel_fits(*dims: int) -> bool:
    return all(d % ALIGN == 0 for d in dims)


def scaled_grouped_nt(a_MK: torch.Tensor, b_GNK: torch.Tensor, offs_G: torch.Tensor, kernel: bool,
                      b_quantised: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """[M, N] bf16: rows offs[g-1]:offs[g] of a times b[g]ᵀ, a quantised per row, b per (group, row);
    ``b_quantised``: b's (q, scale) if made already (:func:`quantized_weight`)."""
    kernel = kernel and _grouped_kernel_fits(*b_GNK.shape[1:])
    _COUNTS["kernel" if kernel else "emulated"] += 1
    qa, sa = quantize_rowwise(a_MK)
    qb, sb = b_quantised if b_quantised is not None else quantize_rowwise(b_GNK)
    if not kernel:
        return _fp32_grouped_nt(dequantize(qa, sa), dequantize(qb, sb), offs_G).to(OUT)
    return torch._scaled_grouped_mm(qa, qb.transpose(-2, -1), sa, sb, offs=offs_G, out_dtype=OUT)


@dataclass
class PaddedGroups:
    """Rows sorted by group, re-laid so every group spans a positive multiple of 16 rows (zeros after its
    own): row i goes to ``dest_M[i]``; ``offs_G`` (int32) are the padded groups' ends, the last one
    ``rows`` (it takes the slack); padded row r belongs to group ``group_of_block[r // 16]``; ``ends_G``
    are the groups' ends before padding (the cumulative offsets the layout was made from)."""

    dest_M: torch.Tensor
    offs_G: torch.Tensor
    group_of_block: torch.Tensor
    rows: int
    ends_G: torch.Tensor


def padded_groups(offs_G: torch.Tensor, m: int) -> PaddedGroups:
    """The padded layout of ``m`` rows grouped by cumulative ``offs_G``, built without a host sync (the
    size ``16·⌈m/16⌉ + 16·G`` bounds Σ max(16, ⌈count/16⌉·16) for any counts)."""
    g, device = offs_G.numel(), offs_G.device
    ends = offs_G.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = ((counts + ALIGN - 1) // ALIGN).clamp(min=1) * ALIGN
    rows = -(-m // ALIGN) * ALIGN + ALIGN * g
    padded[-1] += rows - padded.sum()
    padded_ends = torch.cumsum(padded, 0)
    groups = torch.arange(g, device=device)
    group_of_row = torch.repeat_interleave(groups, counts, output_size=m)
    shift = (padded_ends - padded) - (ends - counts)  # padded start − start, per group
    dest = torch.arange(m, device=device) + shift[group_of_row]
    group_of_block = torch.repeat_interleave(groups, padded // ALIGN, output_size=rows // ALIGN)
    return PaddedGroups(dest, padded_ends.int(), group_of_block, rows, offs_G)


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
    return os.environ.get("FOLDTUNE_FP8_WGRAD", "fp8") != "bf16"


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_GNK, offs_G, kernel):
        ctx.save_for_backward(x_MK, w_GNK, offs_G)
        ctx.kernel = kernel
        return scaled_grouped_nt(x_MK, w_GNK, offs_G, kernel, quantized_weight(w_GNK)).to(x_MK.dtype)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, w_GNK, offs_G = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = scaled_grouped_nt(dy_MN, w_GNK.transpose(-2, -1), offs_G, ctx.kernel,
                                   quantized_weight(w_GNK, transposed=True)).to(x_MK.dtype)
        if ctx.needs_input_grad[1]:
            dw = (scaled_grouped_wgrad(dy_MN, x_MK, offs_G, ctx.kernel) if fp8_wgrad()
                  else _bf16_grouped_wgrad(dy_MN, x_MK, offs_G)).to(w_GNK.dtype)
        return dx, dw, None, None


def grouped_mm(x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """KernelBackend.grouped_mm in fp8: rows offs[g-1]:offs[g] of x times w[g]ᵀ (offs int32, offs[-1] == M)."""
    return _GroupedMM.apply(x_MK, w_GNK, offs_G, kernels_ok(x_MK.device))


# ---- first-use self-check -------------------------------------------------------------------------------

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


def _bf16_ladder(device) -> torch.Tensor:
    """Every finite bf16 value of magnitude up to 448, both signs, as a [4, n] tensor whose rows all have
    amax 448: scale 1, so the cast sees each value exactly (all of e4m3's rounding cases, subnormals too)."""
    codes = torch.arange(0, 0x43E1, dtype=torch.int32).to(torch.int16)  # 0x43E0 is 448.0
    values = codes.view(torch.bfloat16).to(device)
    return torch.stack([values, -values, values.flip(0), -values.flip(0)])


def _compare_quantised(name: str, got: tuple, want: tuple) -> None:
    """Raise unless two (q, scale) pairs are equal: scales exactly, e4m3 bytes one for one."""
    (q, scale), (q_ref, scale_ref) = got, want
    if not torch.equal(scale, scale_ref):
        raise AssertionError(f"Triton quantisation scales differ from torch's ({name})")
    differ = q.view(torch.uint8) != q_ref.view(torch.uint8)
    if bool(differ.any()):
        at = differ.nonzero()[0].tolist()
        raise AssertionError(f"Triton e4m3 bytes differ from torch's ({name}): {int(differ.sum())} of "
                             f"{differ.numel()}, first at {at}: {int(q.view(torch.uint8)[tuple(at)])} "
                             f"against {int(q_ref.view(torch.uint8)[tuple(at)])}")


def _check_fused_rows(_: str, device: str) -> None:
    """Raise unless the one-kernel rowwise quantisation gives the torch path's scales and bytes: the bf16
    ladder (rows longer than a chunk), rows of mixed magnitude in 3-D with partial tiles, a 2-D slice."""
    x = _mixed_rows(device)
    cases = (("ladder", _bf16_ladder(device)), ("3-D", x), ("2-D", x[0, :37]), ("long rows", x.view(6, -1)))
    for name, t in cases:
        _compare_quantised(name, _quantize_rows_fused(t), _quantize_rowwise_torch(t))


def _mixed_rows(device) -> torch.Tensor:
    """[3, 70, 100] bf16 Gaussian rows with a large row, a tiny one and a zero one."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(3, 70, 100, device=device, generator=gen)
    x[0, 1] *= 1e4
    x[1, 2] *= 1e-30
    x[2, 3] = 0.0
    return x.to(torch.bfloat16)


def _check_triton_quantise(_: str, device: str) -> None:
    """Raise unless the two-pass Triton quantisation writes the torch path's scales and bytes: the bf16
    ladder; rows of mixed magnitude in 3-D with partial tiles, rowwise and through a transposed view; per-
    expert column scaling with an empty group, a group of 5 and one of 67 rows."""
    x = _mixed_rows(device)
    offs = torch.tensor([5, 5, 72], device=device, dtype=torch.int32)
    groups = padded_groups(offs, 72)
    cases = [("ladder", _quantize_rowwise_two_pass, _quantize_rowwise_torch, (_bf16_ladder(device),)),
             ("rowwise 3-D", _quantize_rowwise_two_pass, _quantize_rowwise_torch, (x,)),
             ("transposed", _quantize_rowwise_two_pass, _quantize_rowwise_torch, (x.transpose(1, 2),)),
             ("2-D", _quantize_rowwise_two_pass, _quantize_rowwise_torch, (x[0, :37],)),
             ("groups colwise", _quantize_groups_colwise_triton, _quantize_groups_colwise_torch,
              (x[0].t()[:72], groups))]
    for name, triton_path, torch_path, args in cases:
        _compare_quantised(name, triton_path(*args), torch_path(*args))


# ---- the backend ----------------------------------------------------------------------------------------

class TorchFp8Backend(TorchBackend):
    """The torch backend with expert GEMMs and dense linears in fp8 (attention core, norms as ``torch``)."""

    name = "torch-fp8"

    def grouped_mm(self, x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
        if x_MK.shape[0] == 0:  # no rows: the bf16 path's empty product keeps the graph connected
            return super().grouped_mm(x_MK, w_GNK, offs_G)
        return grouped_mm(x_MK, w_GNK, offs_G)

    def linear(self, x: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
        return linear(x, w_NK)
