"""e4m3 quantisation of the fp8 GEMMs' operands (:mod:`executor.kernels.fp8`): each row along the contraction
dim gets its own fp32 scale amax/448 (448: e4m3's largest finite value) and its values become e4m3 bytes,
x ≈ q · scale[..., None] — 1 byte an element plus 4 bytes (the fp32 scale) a row. The expert wgrad's
operands are scaled per (expert, column) instead, in a layout whose every expert spans a positive multiple
of 16 rows (:class:`PaddedGroups`, :func:`padded_groups`).

Quantisation on CUDA is Triton: a row-contiguous operand (activations, a weight's forward form) in one
kernel (amax, scale, cast; rows of up to 32768 columns held whole in registers, so read once); both forms
of a contiguous operand, rowwise and transposed (:func:`quantize_both`), in two kernels (the row and
column amaxes in one read, both casts in another); the transposed view of a contiguous tensor as a Triton
column amax (tiles folded by atomic max), then the cast pass below; any other layout as torch's max-|x|
reduction, then one Triton pass that multiplies by 1/scale, rounds to e4m3 exactly as torch's cast does
and writes the layout the GEMM takes (transposed operands and the wgrad's per-expert padded layout
included, with no bf16 or fp32 copy in between); the wgrad's per-(expert, column) amax is a Triton
segmented reduction. The rounding is the GPU's own e4m3 conversion where its first-use check passed, else
integer operations (:func:`_e4m3`). The torch ops (an fp32 product and a rounding copy) are the reference,
run on CPU, without Triton, with FOLDTUNE_FP8_TRITON=0, or if the first-use check (Triton against torch,
byte for byte) fails.

The first-use checks run once per device and process through
:func:`executor.kernels.first_use.checked_once` (on a thread of their own; a check that raises turns its
path off, with a warning): the two-pass and the one-kernel rowwise paths against the torch ops, scales
exactly and e4m3 bytes one for one; a third checks :func:`quantize_both` the same way; a fourth runs all of
them, and a cast of 2^21 fp32 values, with the GPU's conversion (FOLDTUNE_FP8_HW_CAST=0 skips it). A failed
check costs speed, never the run: the quantisation stays on the torch ops (on two Triton passes where only
the one-kernel path failed; on the integer rounding where only the conversion's failed). ``_CHECKED``
holds the verdicts.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

from executor.kernels.first_use import checked_once

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

# first-use verdicts of the Triton paths, keyed ("quantise", device), ("rows", device), ("both", device) and
# ("hw_cast", device): True where the check passed
_CHECKED: dict[tuple, bool] = {}
_CAST_MODE = threading.local()  # .hw True/False: the e4m3 rounding forced on this thread (_check_hw_cast)


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


def _check_dims(t: torch.Tensor) -> None:
    if t.dim() not in (2, 3):
        raise ValueError(f"fp8 quantisation takes 2-D or 3-D tensors, got {tuple(t.shape)}")


def _as_brc(t: torch.Tensor) -> torch.Tensor:
    _check_dims(t)
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
    def _e4m3(v, HW: tl.constexpr):
        """The e4m3fn byte of fp32 ``v``: HW, the GPU's conversion (sm89+: cvt.rn.satfinite, two values an
        instruction), else _e4m3_byte's ~35 integer operations, which bound the quantisation kernels by the
        ALUs at a third of HBM bandwidth (on an H100). The two agree on every value amax scaling
        produces (|v| <= 448·(1 + 2^-22)); HW is used only where the first-use check found them equal."""
        if HW:
            return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        return _e4m3_byte(v)

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
                     ROW_DIV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HW: tl.constexpr):
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
        q = _e4m3(x.to(tl.float32) * inv, HW)
        tl.store(out_ptr + b * so_b + _offsets(rows, cols, so_r, so_c, OUT_UNIT), q, mask=mask)

    @triton.jit
    def _rows_kernel(x_ptr, q_ptr, scale_ptr, R, C, sx_r, INV_MAX: tl.constexpr, TINY: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HW: tl.constexpr):
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
            tl.store(q_ptr + rows[:, None] * C + cols[None, :], _e4m3(x.to(tl.float32) * inv[:, None], HW),
                     mask=mask)

    @triton.jit
    def _rows_whole_kernel(x_ptr, q_ptr, scale_ptr, R, C, sx_r, INV_MAX: tl.constexpr, TINY: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HW: tl.constexpr):
        # rowwise quantisation of BLOCK_R whole rows (BLOCK_C >= C) held in registers: one read of x, where
        # _rows_kernel reads each row twice (the second read is in L2 only while the programs in flight hold
        # less than it; 8 rows of 28672 columns are 459 KB a program)
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_C)
        mask = (rows < R)[:, None] & (cols < C)[None, :]
        x = tl.load(x_ptr + rows[:, None] * sx_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.maximum(tl.where(amax > 0, amax * INV_MAX, 1.0), TINY)
        inv = tl.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), scale)
        tl.store(scale_ptr + rows, scale, mask=rows < R)
        tl.store(q_ptr + rows[:, None] * C + cols[None, :], _e4m3(x * inv[:, None], HW), mask=mask)

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


    @triton.jit
    def _scales_of(amax, INV_MAX: tl.constexpr, TINY: tl.constexpr):
        # (scale, 1/scale) as _scale_of and torch's division compute them (correctly rounded)
        scale = tl.maximum(tl.where(amax > 0, amax * INV_MAX, 1.0), TINY)
        return scale, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)

    @triton.jit
    def _both_amax_kernel(x_ptr, bits_ptr, R, C, sx_b, sx_r, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                          ROWS: tl.constexpr = True):
        # one read of a BLOCK_R × BLOCK_C tile of row-contiguous x[b]: its rows' and its columns' max |x|,
        # folded by integer atomic max on the fp32 bits (order-preserving for values >= 0: exact in any order)
        # into one zeroed int32 buffer, the [B, R] row amaxes first and the [B, C] column amaxes after them
        # (one buffer: one fill launch a call, not two); ROWS False: the column amaxes alone, from the buffer's
        # start (a transposed operand's rows)
        b = tl.program_id(2).to(tl.int64)
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        in_r, in_c = rows < R, cols < C
        x = tl.load(x_ptr + b * sx_b + rows[:, None] * sx_r + cols[None, :], mask=in_r[:, None] & in_c[None, :],
                    other=0.0)
        a = tl.abs(x.to(tl.float32))
        col_base = bits_ptr
        if ROWS:
            tl.atomic_max(bits_ptr + b * R + rows, tl.max(a, axis=1).to(tl.int32, bitcast=True), mask=in_r)
            col_base = bits_ptr + tl.num_programs(2).to(tl.int64) * R
        tl.atomic_max(col_base + b * C + cols, tl.max(a, axis=0).to(tl.int32, bitcast=True), mask=in_c)

    @triton.jit
    def _both_cast_kernel(x_ptr, bits_ptr, q_ptr, qt_ptr, row_scale_ptr, col_scale_ptr, R, C, sx_b, sx_r,
                          INV_MAX: tl.constexpr, TINY: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                          HW: tl.constexpr):
        # one read of the tile again: q[b, r, c] = e4m3(x · 448/rowamax[r]) row-major and qt[b, c, r] =
        # e4m3(x · 448/colamax[c]) (the transposed form, written along r), the amaxes read as fp32 from the
        # int32 bits _both_amax_kernel left; the first column of programs writes the row scales, the first
        # row of programs the column scales (every scale is written: the caller allocates them unfilled)
        b = tl.program_id(2).to(tl.int64)
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        in_r, in_c = rows < R, cols < C
        mask = in_r[:, None] & in_c[None, :]
        x = tl.load(x_ptr + b * sx_b + rows[:, None] * sx_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        col_base = bits_ptr + tl.num_programs(2).to(tl.int64) * R
        row_amax = tl.load(bits_ptr + b * R + rows, mask=in_r, other=0).to(tl.float32, bitcast=True)
        col_amax = tl.load(col_base + b * C + cols, mask=in_c, other=0).to(tl.float32, bitcast=True)
        row_scale, row_inv = _scales_of(row_amax, INV_MAX, TINY)
        col_scale, col_inv = _scales_of(col_amax, INV_MAX, TINY)
        tl.store(q_ptr + b * R * C + rows[:, None] * C + cols[None, :], _e4m3(x * row_inv[:, None], HW), mask=mask)
        qt = tl.trans(_e4m3(x * col_inv[None, :], HW))  # [BLOCK_C, BLOCK_R]
        tl.store(qt_ptr + b * R * C + cols[:, None] * R + rows[None, :], qt, mask=tl.trans(mask))
        if tl.program_id(1) == 0:
            tl.store(row_scale_ptr + b * R + rows, row_scale, mask=in_r)
        if tl.program_id(0) == 0:
            tl.store(col_scale_ptr + b * C + cols, col_scale, mask=in_c)


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
    block_r, block_c, warps = TILES["cast_along" if x_unit == out_unit == 2 else "cast_across"]
    grid = (triton.cdiv(r, block_r), triton.cdiv(c, block_c), b)
    gather = src is not None
    _cast_kernel[grid](x_BRC, inv, src if gather else inv, grp if gather else inv, out_BRC.view(torch.uint8),
                       r, c, *x_BRC.stride(), *si, *out_BRC.stride(), X_UNIT=x_unit, OUT_UNIT=out_unit,
                       GATHER=gather, ROW_DIV=row_div, BLOCK_R=block_r, BLOCK_C=block_c, HW=_hw_cast(x_BRC.device),
                       num_warps=warps)


def _rows_flat(x: torch.Tensor) -> bool:
    """Whether ``x``'s rows (of its last dim) are contiguous and evenly spaced: one [rows, C] strided view."""
    return x.stride(-1) == 1 and (x.dim() == 2 or x.stride(0) == x.shape[1] * x.stride(1) or x.shape[0] == 1)


# Launch shapes, by kernel: (BLOCK_R, BLOCK_C, num_warps) unless said otherwise. One table so that
# bench/fp8_quant_speed.py can sweep them on a GPU (docs/benchmarks.md has its sweep).
TILES: dict[str, tuple[int, ...]] = {
    "rows": (8, 512, 4),  # _rows_kernel: 8 rows, the row in 512-column chunks (rows too long to hold)
    "rows_whole": (8192, 16),  # _rows_whole_kernel: elements a program holds at least (whole rows), per thread
    "cast_along": (16, 256, 4),  # _cast_kernel where operand and output both run along the row
    "cast_across": (64, 64, 4),  # _cast_kernel where one of them runs along R (a transposed read or write)
    "both_amax": (256, 64, 8),  # _both_amax_kernel (also the column amax of a transposed view)
    "both_cast": (64, 64, 4),  # _both_cast_kernel: the transposed write needs a square-ish tile
    # _group_amax_kernel: rows per slab, columns, warps; at most this many programs (an H100 has 132 SMs)
    "group_amax": (128, 128, 8, 8192),
}
ROWS_WHOLE_MAX = 32768  # the longest row (padded to a power of two) _rows_whole_kernel holds in registers


def _quantize_rows_fused(x: torch.Tensor, whole: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rowwise` of a row-contiguous ``x`` (:func:`_rows_flat`) in one kernel: whole rows in
    registers where they fit (``whole`` None), else in chunks; ``whole`` True/False forces one (the checks)."""
    c = x.shape[-1]
    r = x.numel() // c if c else 0
    q = torch.empty(x.shape, dtype=E4M3, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if r and c:
        width = triton.next_power_of_2(c)
        if whole if whole is not None else width <= ROWS_WHOLE_MAX:
            elements, per_thread = TILES["rows_whole"]
            block_r = max(1, elements // width)
            warps = min(32, max(1, block_r * width // (32 * per_thread)))
            _rows_whole_kernel[(triton.cdiv(r, block_r),)](x, q.view(torch.uint8), scale, r, c, x.stride(-2),
                                                           INV_MAX=INV_E4M3_MAX, TINY=FP32_TINY, BLOCK_R=block_r,
                                                           BLOCK_C=width, HW=_hw_cast(x.device), num_warps=warps)
        else:
            block_r, block_c, warps = TILES["rows"]
            _rows_kernel[(triton.cdiv(r, block_r),)](x, q.view(torch.uint8), scale, r, c, x.stride(-2),
                                                     INV_MAX=INV_E4M3_MAX, TINY=FP32_TINY, BLOCK_R=block_r,
                                                     BLOCK_C=block_c, HW=_hw_cast(x.device), num_warps=warps)
    elif r:
        scale.fill_(1.0)
    return q, scale


def _quantize_rowwise_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if _rows_flat(x) and _fused_rows_ok(x.device):
        return _quantize_rows_fused(x)
    return _quantize_rowwise_two_pass(x)


def _column_amax(base: torch.Tensor) -> torch.Tensor:
    """max |base| over dim -2 of a contiguous [.., R, C] (fp32, shape [.., C]): tiles of one read, folded by
    integer atomic max on the fp32 bits — the rows' amax of the transposed view, without torch's reduction
    across the grain."""
    b3 = _as_brc(base)
    b, r, c = b3.shape
    bits = torch.zeros(b, c, dtype=torch.int32, device=base.device)
    block_r, block_c, warps = TILES["both_amax"]
    if base.numel():
        _both_amax_kernel[(triton.cdiv(r, block_r), triton.cdiv(c, block_c), b)](
            b3, bits, r, c, b3.stride(0), b3.stride(1), BLOCK_R=block_r, BLOCK_C=block_c, ROWS=False,
            num_warps=warps)
    return bits.view(torch.float32).view(*base.shape[:-2], c)


def _quantize_rowwise_two_pass(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The amax and scales (a Triton column amax for the transposed view of a contiguous tensor, else
    torch's reduction), then the Triton cast (any strides: transposed operands)."""
    if x.dim() >= 2 and x.transpose(-2, -1).is_contiguous() and not x.is_contiguous():
        scale = _scale_of(_column_amax(x.transpose(-2, -1)))
        inv = 1.0 / scale
    else:
        scale, inv = _rowwise_scale(x)
    q = torch.empty(x.shape, dtype=E4M3, device=x.device)
    inv3 = inv.reshape(-1, x.shape[-2]) if x.dim() == 3 else inv.unsqueeze(0)  # [B, R], contiguous
    _launch_cast(_as_brc(q), _as_brc(x), inv3, (inv3.stride(0), inv3.stride(1), 0))
    return q, scale




def _quantize_groups_colwise_triton(x_MC: torch.Tensor, groups: PaddedGroups) -> tuple[torch.Tensor, torch.Tensor]:
    m, c = x_MC.shape
    g = groups.offs_G.numel()
    amax_bits = torch.zeros(g, c, dtype=torch.int32, device=x_MC.device)
    block_r, block_c, warps, programs = TILES["group_amax"]
    col_programs = triton.cdiv(c, block_c)
    split = max(1, min(triton.cdiv(m, g * block_r), programs // (col_programs * g)))
    if m:
        _group_amax_kernel[(col_programs, g, split)](x_MC, groups.ends_G, amax_bits, c, *x_MC.stride(), split,
                                                     X_UNIT=_unit_dim(x_MC.unsqueeze(0)), BLOCK_R=block_r,
                                                     BLOCK_C=block_c, num_warps=warps)
    scale = _scale_of(amax_bits.view(torch.float32))
    inv = 1.0 / scale
    src = torch.full((groups.rows,), -1, dtype=torch.int32, device=x_MC.device)
    src.index_copy_(0, groups.dest_M, torch.arange(m, dtype=torch.int32, device=x_MC.device))
    q = torch.empty(c, groups.rows, dtype=E4M3, device=x_MC.device)
    _launch_cast(q.t().unsqueeze(0), x_MC.unsqueeze(0), inv, (0, inv.stride(0), inv.stride(1)),
                 src=src, grp=groups.group_of_block, row_div=ALIGN)
    return q, scale



def _quantize_both_torch(x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    return _quantize_rowwise_torch(x), _quantize_rowwise_torch(x.transpose(-2, -1))


def _quantize_both_triton(x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Both forms of a contiguous ``x`` [.., R, C] in two Triton kernels: one read for the row and column
    amaxes together, one read that writes the row-major and the transposed e4m3 copies and both scales.

    Host cost, per call: four allocations, one zero fill (the amaxes' buffer) and the two launches. The
    scales are allocated unfilled, since the cast kernel writes every one of them (each fill is a kernel
    launch, about 7 us of host time on an H200's host, docs/benchmarks.md "fp8 linear host cost")."""
    _check_dims(x)  # (shape and strides read off x itself: a 2-D x's [1, R, C] view would be one more op)
    b, r, c = (1, *x.shape) if x.dim() == 2 else x.shape
    sx_b, sx_r = (r * c, x.stride(0)) if x.dim() == 2 else x.stride()[:2]
    device = x.device
    q = torch.empty(x.shape, dtype=E4M3, device=device)
    qt = torch.empty((*x.shape[:-2], c, r), dtype=E4M3, device=device)
    if not x.numel():  # no kernel runs: an empty row's or column's scale is 1, as the torch path's
        return ((q, torch.ones(x.shape[:-1], dtype=torch.float32, device=device)),
                (qt, torch.ones((*x.shape[:-2], c), dtype=torch.float32, device=device)))
    row_scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=device)
    col_scale = torch.empty((*x.shape[:-2], c), dtype=torch.float32, device=device)
    bits = torch.zeros(b * (r + c), dtype=torch.int32, device=device)  # row amaxes, then column amaxes
    block_r, block_c, warps = TILES["both_amax"]
    _both_amax_kernel[(triton.cdiv(r, block_r), triton.cdiv(c, block_c), b)](
        x, bits, r, c, sx_b, sx_r, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    block_r, block_c, warps = TILES["both_cast"]
    grid = (triton.cdiv(r, block_r), triton.cdiv(c, block_c), b)
    _both_cast_kernel[grid](x, bits, q.view(torch.uint8), qt.view(torch.uint8), row_scale, col_scale, r, c,
                            sx_b, sx_r, INV_MAX=INV_E4M3_MAX, TINY=FP32_TINY, BLOCK_R=block_r,
                            BLOCK_C=block_c, HW=_hw_cast(device), num_warps=warps)
    return (q, row_scale), (qt, col_scale)


def _both_ok(device: torch.device) -> bool:
    """The both-forms kernels, checked once per device against the torch path (a failure keeps two
    separate quantisations)."""
    return device.type != "cuda" or checked_once(_CHECKED, ("both", str(device)), _check_both,
                                                 "fp8 both-forms quantisation")


def quantize_both(x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``(quantize_rowwise(x), quantize_rowwise(x.transpose(-2, -1)))`` — a GEMM operand's form for the GEMM
    that contracts its last dim and the (contiguous, transposed) form for the one that contracts the dim
    before — equal to those byte for byte. On CUDA with a contiguous ``x`` both are made from two reads of
    ``x`` (amaxes of rows and columns in one, both casts in the other) instead of the four reads and the
    scale arithmetic's small launches of two separate quantisations."""
    _check_dims(x)
    if _use_triton(x.device) and x.is_contiguous() and _both_ok(x.device):
        return _quantize_both_triton(x)
    return quantize_rowwise(x), quantize_rowwise(x.transpose(-2, -1))


def _hw_cast(device: torch.device) -> bool:
    """Whether the kernels round with the GPU's e4m3 conversion on ``device`` (:func:`_e4m3`): CUDA,
    FOLDTUNE_FP8_HW_CAST not 0, and its first-use check passed; a check's own thread may force it either way."""
    forced = getattr(_CAST_MODE, "hw", None)
    if forced is not None:
        return forced
    return (device.type == "cuda" and os.environ.get("FOLDTUNE_FP8_HW_CAST", "1") != "0"
            and checked_once(_CHECKED, ("hw_cast", str(device)), _check_hw_cast, "fp8 hardware e4m3 conversion"))


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
    _check_dims(x)
    return (_quantize_rowwise_triton if _use_triton(x.device) else _quantize_rowwise_torch)(x)


def quantize_groups_colwise(x_MC: torch.Tensor, groups: PaddedGroups) -> tuple[torch.Tensor, torch.Tensor]:
    """(qT [C, rows] e4m3 contiguous, scale [G, C] fp32): the padded rows of ``x`` transposed, each column
    scaled per group — the wgrad GEMM's A (row-major) or, transposed back, its column-major B."""
    quantise = _quantize_groups_colwise_triton if _use_triton(x_MC.device) else _quantize_groups_colwise_torch
    return quantise(x_MC, groups)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values q · scale (per row of the last dim), the inverse of :func:`quantize_rowwise`."""
    return q.float() * scale.unsqueeze(-1)


# ---- the expert wgrad's layout: every group padded to a positive multiple of 16 rows ---------------------

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


# ---- first-use self-checks: the Triton paths against the torch ops, byte for byte -------------------------

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
        want = _quantize_rowwise_torch(t)
        _compare_quantised(name + " whole rows", _quantize_rows_fused(t, whole=True), want)
        _compare_quantised(name + " in chunks", _quantize_rows_fused(t, whole=False), want)


def _check_both(_: str, device: str) -> None:
    """Raise unless the both-forms kernels give the torch path's scales and bytes for both forms: the bf16
    ladder, rows of mixed magnitude in 3-D with partial tiles (a zero row and column among them), a 2-D slice."""
    x = _mixed_rows(device)
    x[1, :, 7] = 0.0
    cases = (("ladder", _bf16_ladder(device)), ("3-D", x), ("2-D", x[0, :37].contiguous()))
    for name, t in cases:
        (q, s), (qt, st) = _quantize_both_triton(t)
        (q_ref, s_ref), (qt_ref, st_ref) = _quantize_both_torch(t)
        _compare_quantised(name + " rows", (q, s), (q_ref, s_ref))
        _compare_quantised(name + " transposed", (qt, st), (qt_ref, st_ref))


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


def _scaled_fp32_cases(device, count: int = 1 << 20) -> torch.Tensor:
    """fp32 values as amax scaling hands them to the rounding: random bit patterns of magnitude up to
    448·(1 + 2^-22) (every exponent down to the subnormals), both signs, and the rounding boundaries."""
    gen = torch.Generator().manual_seed(1)
    bits = torch.randint(0, 0x43E00001, (count,), generator=gen, dtype=torch.int64).to(torch.int32)
    edges = torch.tensor([448.0, 448.0 * (1 + 2.0**-22), 2.0**-6, 2.0**-6 * 0.999, 2.0**-9, 2.0**-10,
                          3 * 2.0**-10, 5 * 2.0**-11, 2.0**-7, 1e-45, 0.0, 240.0, 232.0, 248.0])
    v = torch.cat([bits.view(torch.float32), edges])
    return torch.cat([v, -v]).to(device)


def _check_hw_cast(_: str, device: str) -> None:
    """Raise unless every kernel rounding with the GPU's conversion writes the torch path's bytes."""
    _check_rounding(True, device)


def _check_rounding(hw: bool, device: str, values: int = 1 << 20) -> None:
    """Raise unless the kernels, rounding by the GPU's conversion (``hw``) or by integer operations, write
    the torch path's bytes: the cast of :func:`_scaled_fp32_cases` value by value, then the rowwise,
    both-forms and per-expert checks, with the rounding forced on this thread (``values``: random cases)."""
    _CAST_MODE.hw = hw
    try:
        v = _scaled_fp32_cases(device, values)
        q = torch.empty(1, 1, v.numel(), dtype=E4M3, device=device)
        _launch_cast(q, v.view(1, 1, -1), torch.ones(1, 1, device=device), (1, 1, 0))
        _compare_quantised("fp32 values", (q, v[:1]), (v.to(E4M3).view(1, 1, -1), v[:1]))
        _check_triton_quantise("quantise", device)
        _check_fused_rows("rows", device)
        _check_both("both", device)
    finally:
        _CAST_MODE.hw = None
