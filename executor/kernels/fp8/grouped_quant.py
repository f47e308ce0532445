"""e4m3 quantisation of the operands of foldtune's grouped fp8 GEMM (:mod:`executor.kernels.fp8.grouped_gemm`),
in two scalings, each in Triton (CUDA, or Triton's CPU interpreter) and in torch ops (the reference, and the
CPU path):

- ``rowwise``: an activation row (a token) gets one fp32 scale amax/448 over its whole row, a weight row
  (an output channel) one over its row; the wgrad's operands, transposed so that the tokens are the
  contraction dim, one scale per (expert, channel) over the expert's tokens. Every scale is constant along
  the contraction, so the GEMM applies them in its epilogue.
- ``blockwise`` (DeepSeek-V3's): activations per 1 × 128 run of the contraction dim (a token's 128
  channels; in the wgrad's transposed form a channel's 128 tokens), weights per 128 × 128 block. The GEMM
  applies them per 128-wide step of its contraction, inside the main loop. A weight's transpose (the dgrad's
  operand) is the same blocks with the same scales, so one quantisation gives both forms.

Layouts (M tokens sorted by expert, ``offs_G`` the experts' cumulative int32 row ends, C channels):

- row form ``(q [M, C] e4m3, scale)``: rowwise scale [M]; blockwise [⌈C/128⌉, M] (block-major, so a GEMM
  tile's scales for one contraction step are one contiguous load).
- token form ``(q [C, slots] e4m3, scale)``, the wgrad's: the tokens transposed, expert g's tokens from slot
  ``128 · (blocks of the experts before g)``, each expert padded with zero slots to a multiple of 128, so
  every 128-slot block holds one expert's tokens (a blockwise scale never spans two experts) and the GEMM's
  contraction steps need no masks. ``slots`` = :func:`token_slots` is a bound computed without a host
  sync; blocks past the experts' last are left unwritten and never read. Rowwise scale [G, C] (1 for an
  expert without tokens); blockwise [slots / 128, C].
- weights ``w [G, N, K]``: forward form ``(q [G, N, K], scale)`` and dgrad form ``(q [G, K, N], scale)``
  (the transpose, contiguous: the GEMM reads both operands along the contraction). Rowwise scales [G, N] and
  [G, K] (:func:`executor.kernels.fp8.quantize.quantize_both`); blockwise [G, ⌈N/128⌉, ⌈K/128⌉] and its
  transposed view.

One pass over a bf16 activation in blockwise scaling: a program reads a 128-token × 128-channel tile once and
writes both forms and both scales (the row form's 1 × 128 runs and the token form's 128 × 1 runs are the
tile's rows and columns). Rowwise needs two: a row's scale depends on the whole row and an expert's channel
scale on all its tokens, so a first pass folds the amaxes (integer atomic max on the fp32 bits, exact in any
order) and a second casts into both forms. The scale arithmetic and the e4m3 rounding are those of
:mod:`executor.kernels.fp8.quantize` (``_scales_of``, ``_e4m3``), so Triton and torch agree byte for byte.
"""

from __future__ import annotations

import torch

from executor.kernels.fp8.quantize import (E4M3, FP32_TINY, INV_E4M3_MAX, _hw_cast, _scale_of, quantize_both)

try:
    import triton
    import triton.language as tl

    from executor.kernels.fp8.quantize import _e4m3, _scales_of
except ImportError:  # CPU-only installs
    triton = None

QBLOCK = 128  # DeepSeek-V3's quantisation block, and the token form's per-expert padding
SCALINGS = ("rowwise", "blockwise")
AMAX_TILE = (64, 128, 4)  # rowwise amax pass: rows, channels, warps a program
CAST_WARPS = 8  # the cast pass's 128 × 128 tile


def token_slots(m: int, groups: int) -> int:
    """Slots of the token form for ``m`` tokens in ``groups`` experts: Σ_g 128·⌈m_g/128⌉ < 128·(⌈m/128⌉ + G)
    for any split of the tokens, so this bound needs no host sync."""
    return QBLOCK * (-(-m // QBLOCK) + groups)


def g_pad(groups: int) -> int:
    """The power-of-two vector length a kernel holds the experts' offsets in: at least 128, so that models
    of up to 128 local experts share one compiled kernel (a vector of 128 costs a program no more than one
    of 16: a lane or less a thread either way)."""
    return max(128, 1 << (groups - 1).bit_length())


# ---- Triton ---------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def group_table(offs_ptr, G, G_PAD: tl.constexpr, UNIT: tl.constexpr):
        """The experts as [G_PAD] vectors (entries from G on empty): (index, first row, row end, end of its
        UNIT-row units counted over the experts before it and itself, its units), an expert of m rows
        taking ⌈m/UNIT⌉ units (the m-tiles of a forward GEMM, the 128-slot blocks of the token form)."""
        idx = tl.arange(0, G_PAD)
        ends = tl.load(offs_ptr + idx, mask=idx < G, other=0)
        starts = tl.load(offs_ptr + idx - 1, mask=(idx > 0) & (idx < G), other=0)
        units = tl.where(idx < G, (ends - starts + UNIT - 1) // UNIT, 0)
        return idx, starts, ends, tl.cumsum(units, 0), units

    @triton.jit
    def pick(vec, idx, g):
        """vec[g] of a [G_PAD] vector, as a scalar."""
        return tl.sum(tl.where(idx == g, vec, 0))

    @triton.jit
    def unit_owner(unit_ends, u):
        """The expert whose units hold unit ``u`` (< the total): the count of experts ending at or before it."""
        return tl.sum((unit_ends <= u).to(tl.int32))

    @triton.jit
    def _act_amax_kernel(x_ptr, row_bits_ptr, grp_bits_ptr, offs_ptr, M, C, G, sx_m, G_PAD: tl.constexpr,
                         ROWS: tl.constexpr, TOKENS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # rowwise pass 1: one read of a BLOCK_R × BLOCK_C tile; its rows' max |x| into row_bits [M] and, per
        # expert whose rows the tile holds, its columns' max |x| into grp_bits [G, C] (atomic max on the bits)
        r0 = tl.program_id(0) * BLOCK_R
        rows = r0 + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        in_r, in_c = rows < M, cols < C
        a = tl.abs(tl.load(x_ptr + rows.to(tl.int64)[:, None] * sx_m + cols[None, :],
                           mask=in_r[:, None] & in_c[None, :], other=0.0).to(tl.float32))
        if ROWS:
            tl.atomic_max(row_bits_ptr + rows, tl.max(a, axis=1).to(tl.int32, bitcast=True), mask=in_r)
        if TOKENS:
            idx, starts, ends, _, _ = group_table(offs_ptr, G, G_PAD, 1)
            real = idx < G
            first = tl.sum(((ends <= r0) & real).to(tl.int32))
            last = tl.sum(((ends <= tl.minimum(r0 + BLOCK_R, M) - 1) & real).to(tl.int32))
            for g in range(first, last + 1):
                mine = (rows >= pick(starts, idx, g)) & (rows < pick(ends, idx, g))
                col = tl.max(tl.where(mine[:, None], a, 0.0), axis=0)
                tl.atomic_max(grp_bits_ptr + g * C + cols, col.to(tl.int32, bitcast=True), mask=in_c)

    @triton.jit
    def _act_cast_kernel(x_ptr, row_bits_ptr, grp_bits_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, offs_ptr, M, C, G, slots,
                         sx_m, G_PAD: tl.constexpr, BLOCKWISE: tl.constexpr, ROWS: tl.constexpr,
                         TOKENS: tl.constexpr, QB: tl.constexpr, INV_MAX: tl.constexpr, TINY: tl.constexpr,
                         HW: tl.constexpr):
        # one QB-slot block of the token form (program_id 0) × QB channels (program_id 1): the block's tokens
        # (one expert's) read once, cast into the row form and, transposed, into the token form, with the
        # scales each needs (blockwise: the tile's own row and column amaxes; rowwise: pass 1's)
        pb = tl.program_id(0)
        cb = tl.program_id(1)
        idx, starts, ends, blk_ends, blks = group_table(offs_ptr, G, G_PAD, QB)
        if pb < tl.sum(blks):
            g = unit_owner(blk_ends, pb)
            first_blk = pick(blk_ends - blks, idx, g)
            rows = pick(starts, idx, g) + (pb - first_blk) * QB + tl.arange(0, QB)
            valid = rows < pick(ends, idx, g)
            cols = cb * QB + tl.arange(0, QB)
            in_c = cols < C
            x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * sx_m + cols[None, :],
                        mask=valid[:, None] & in_c[None, :], other=0.0).to(tl.float32)
            if ROWS:
                if BLOCKWISE:
                    amax_r = tl.max(tl.abs(x), axis=1)
                else:
                    amax_r = tl.load(row_bits_ptr + rows, mask=valid, other=0).to(tl.float32, bitcast=True)
                scale_r, inv_r = _scales_of(amax_r, INV_MAX, TINY)
                tl.store(q_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], _e4m3(x * inv_r[:, None], HW),
                         mask=valid[:, None] & in_c[None, :])
                if BLOCKWISE:
                    tl.store(s_ptr + cb.to(tl.int64) * M + rows, scale_r, mask=valid)
                elif cb == 0:
                    tl.store(s_ptr + rows, scale_r, mask=valid)
            if TOKENS:
                if BLOCKWISE:
                    amax_c = tl.max(tl.abs(x), axis=0)
                else:
                    amax_c = tl.load(grp_bits_ptr + g * C + cols, mask=in_c, other=0).to(tl.float32, bitcast=True)
                scale_c, inv_c = _scales_of(amax_c, INV_MAX, TINY)
                slot = pb.to(tl.int64) * QB + tl.arange(0, QB)
                qt = tl.trans(_e4m3(x * inv_c[None, :], HW))  # [channels, slots]; padding slots are zeros
                tl.store(qt_ptr + cols.to(tl.int64)[:, None] * slots + slot[None, :], qt, mask=in_c[:, None])
                if BLOCKWISE:
                    tl.store(st_ptr + pb.to(tl.int64) * C + cols, scale_c, mask=in_c)
                elif pb == first_blk:
                    tl.store(st_ptr + g * C + cols, scale_c, mask=in_c)

    @triton.jit
    def _weight_blocks_kernel(w_ptr, q_ptr, qt_ptr, s_ptr, N, K, sw_g, sw_n, QB: tl.constexpr,
                              INV_MAX: tl.constexpr, TINY: tl.constexpr, HW: tl.constexpr):
        # one 128 × 128 block of w[g] read once: its amax, the scale, the block cast into q [G, N, K] and,
        # transposed, into qt [G, K, N]
        nb, kb, g = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        n = nb * QB + tl.arange(0, QB)
        k = kb * QB + tl.arange(0, QB)
        mask = (n < N)[:, None] & (k < K)[None, :]
        w = tl.load(w_ptr + g * sw_g + n.to(tl.int64)[:, None] * sw_n + k[None, :], mask=mask, other=0.0)
        w = w.to(tl.float32)
        scale, inv = _scales_of(tl.max(tl.max(tl.abs(w), axis=1), axis=0), INV_MAX, TINY)
        q = _e4m3(w * inv, HW)
        tl.store(q_ptr + g * N * K + n.to(tl.int64)[:, None] * K + k[None, :], q, mask=mask)
        tl.store(qt_ptr + g * N * K + k.to(tl.int64)[:, None] * N + n[None, :], tl.trans(q), mask=tl.trans(mask))
        tl.store(s_ptr + (g * tl.num_programs(0) + nb) * tl.num_programs(1) + kb, scale)


def _check_scaling(scaling: str) -> None:
    if scaling not in SCALINGS:
        raise ValueError(f"fp8 scaling must be one of {SCALINGS}, got {scaling!r}")


def _act_triton(x: torch.Tensor, offs: torch.Tensor, scaling: str, rows: bool, tokens: bool):
    m, c = x.shape
    g, dev = offs.numel(), x.device
    blockwise = scaling == "blockwise"
    cb = triton.cdiv(c, QBLOCK)
    slots = token_slots(m, g)
    q = torch.empty(m, c, dtype=E4M3, device=dev) if rows else None
    s = (torch.empty(cb, m, dtype=torch.float32, device=dev) if blockwise else
         torch.empty(m, dtype=torch.float32, device=dev)) if rows else None
    qt = torch.empty(c, slots, dtype=E4M3, device=dev) if tokens else None
    st = (torch.empty(slots // QBLOCK, c, dtype=torch.float32, device=dev) if blockwise else
          torch.ones(g, c, dtype=torch.float32, device=dev)) if tokens else None
    row_bits = grp_bits = None
    if not blockwise:
        bits = torch.zeros((m if rows else 0) + (g * c if tokens else 0), dtype=torch.int32, device=dev)
        row_bits, grp_bits = bits[:m] if rows else bits, bits[m if rows else 0:] if tokens else bits
        block_r, block_c, warps = AMAX_TILE
        _act_amax_kernel[(triton.cdiv(m, block_r), triton.cdiv(c, block_c))](
            x, row_bits, grp_bits, offs, m, c, g, x.stride(0), G_PAD=g_pad(g), ROWS=rows, TOKENS=tokens,
            BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    dummy = torch.empty(1, dtype=torch.int32, device=dev)  # an unused pointer argument
    u8 = (lambda t: t.view(torch.uint8) if t is not None else dummy)
    _act_cast_kernel[(slots // QBLOCK, cb)](
        x, row_bits if row_bits is not None else dummy, grp_bits if grp_bits is not None else dummy, u8(q),
        s if s is not None else dummy, u8(qt), st if st is not None else dummy, offs, m, c, g, slots, x.stride(0),
        G_PAD=g_pad(g), BLOCKWISE=blockwise, ROWS=rows, TOKENS=tokens, QB=QBLOCK, INV_MAX=INV_E4M3_MAX,
        TINY=FP32_TINY, HW=_hw_cast(dev), num_warps=CAST_WARPS)
    return (q, s) if rows else None, (qt, st) if tokens else None


# ---- torch ops (the reference) --------------------------------------------------------------------------

def _group_of_rows(offs: torch.Tensor, m: int) -> torch.Tensor:
    counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
    return torch.repeat_interleave(torch.arange(offs.numel(), device=offs.device), counts, output_size=m)


def token_slot_of_rows(offs: torch.Tensor, m: int) -> torch.Tensor:
    """The token-form slot of each of the ``m`` rows (int64 [m])."""
    ends = offs.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + QBLOCK - 1) // QBLOCK * QBLOCK
    shift = (torch.cumsum(padded, 0) - padded) - (ends - counts)  # padded start − start, per expert
    return torch.arange(m, device=offs.device) + shift[_group_of_rows(offs, m)]


def token_slots_used(offs: torch.Tensor) -> torch.Tensor:
    """The token form's used slots, Σ_g 128·⌈m_g/128⌉ (a 0-d tensor)."""
    counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
    return ((counts + QBLOCK - 1) // QBLOCK * QBLOCK).sum()


def _blocks_along_last(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` zero-padded along its last dim to whole 128-blocks, viewed [..., blocks, 128]."""
    c = x.shape[-1]
    xp = torch.nn.functional.pad(x.float(), (0, -c % QBLOCK))
    return xp.view(*x.shape[:-1], -1, QBLOCK)


def _act_torch(x: torch.Tensor, offs: torch.Tensor, scaling: str, rows: bool, tokens: bool):
    m, c = x.shape
    g = offs.numel()
    row_form = token_form = None
    if rows:
        if scaling == "blockwise":
            blocks = _blocks_along_last(x)  # [m, cb, 128]
            scale = _scale_of(torch.linalg.vector_norm(blocks, float("inf"), dim=-1))  # [m, cb]
            q = (blocks * (1.0 / scale).unsqueeze(-1)).to(E4M3).view(m, -1)[:, :c].contiguous()
            row_form = (q, scale.t().contiguous())
        else:
            scale = _scale_of(torch.linalg.vector_norm(x, float("inf"), dim=-1).float())
            row_form = ((x.float() * (1.0 / scale).unsqueeze(-1)).to(E4M3), scale)
    if tokens:
        slots = token_slots(m, g)
        slot = token_slot_of_rows(offs, m)
        if scaling == "blockwise":
            padded = x.new_zeros(slots, c, dtype=torch.float32).index_copy_(0, slot, x.float())
            blocks = padded.view(slots // QBLOCK, QBLOCK, c)
            scale = _scale_of(torch.linalg.vector_norm(blocks, float("inf"), dim=1))  # [slots/128, c]
            q = (blocks * (1.0 / scale).unsqueeze(1)).to(E4M3).view(slots, c)
        else:
            group = _group_of_rows(offs, m)
            amax = x.new_zeros(g, c, dtype=torch.float32).scatter_reduce_(
                0, group.unsqueeze(1).expand(-1, c), x.float().abs(), "amax")
            scale = _scale_of(amax)  # an expert without tokens: amax 0, scale 1
            scaled = x.float() * (1.0 / scale)[group]
            q = x.new_zeros(slots, c, dtype=torch.float32).index_copy_(0, slot, scaled).to(E4M3)
        token_form = (q.t().contiguous(), scale)
    return row_form, token_form


def quantize_activation(x: torch.Tensor, offs: torch.Tensor, scaling: str, rows: bool = True,
                        tokens: bool = False, kernel: bool = False):
    """(row form or None, token form or None) of ``x`` [M, C] (bf16 rows sorted by expert, ``offs`` int32
    cumulative row ends, offs[-1] == M): ``rows`` the forward/dgrad operand, ``tokens`` the wgrad's (module
    docstring); ``kernel``: the Triton kernels (CUDA, or the interpreter), else torch ops. Both give the same
    scales and bytes over the slots the GEMM reads."""
    _check_scaling(scaling)
    if x.dim() != 2 or not (rows or tokens):
        raise ValueError(f"quantize_activation takes a 2-D operand and at least one form, got {tuple(x.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    if kernel and x.shape[0] and x.shape[1]:
        return _act_triton(x, offs, scaling, rows, tokens)
    return _act_torch(x, offs, scaling, rows, tokens)


def _weight_blocks_torch(w: torch.Tensor):
    g, n, k = w.shape
    wp = _blocks_along_last(w)  # [g, n, kb, 128]
    wp = torch.nn.functional.pad(wp, (0, 0, 0, 0, 0, -n % QBLOCK))  # n to whole blocks
    blocks = wp.view(g, -1, QBLOCK, wp.shape[2], QBLOCK)  # [g, nb, 128, kb, 128]
    scale = _scale_of(blocks.abs().amax(dim=(2, 4)))  # [g, nb, kb]
    q = (blocks * (1.0 / scale)[:, :, None, :, None]).to(E4M3).view(g, blocks.shape[1] * QBLOCK, -1)[:, :n, :k]
    return (q.contiguous(), scale), (q.transpose(1, 2).contiguous(), scale.transpose(1, 2))


def quantize_weight(w: torch.Tensor, scaling: str, kernel: bool = False):
    """(forward form, dgrad form) of expert weights ``w`` [G, N, K] (module docstring), each (q, scale).
    Rowwise: :func:`quantize_both` (Triton on CUDA); blockwise: one Triton pass (``kernel``) or torch ops."""
    _check_scaling(scaling)
    if scaling == "rowwise":
        return quantize_both(w if w.is_contiguous() else w.contiguous())
    if not (kernel and w.numel()):
        return _weight_blocks_torch(w)
    g, n, k = w.shape
    w = w if w.stride(-1) == 1 else w.contiguous()
    nb, kb = triton.cdiv(n, QBLOCK), triton.cdiv(k, QBLOCK)
    q = torch.empty(g, n, k, dtype=E4M3, device=w.device)
    qt = torch.empty(g, k, n, dtype=E4M3, device=w.device)
    s = torch.empty(g, nb, kb, dtype=torch.float32, device=w.device)
    _weight_blocks_kernel[(nb, kb, g)](w, q.view(torch.uint8), qt.view(torch.uint8), s, n, k, w.stride(0),
                                       w.stride(1), QB=QBLOCK, INV_MAX=INV_E4M3_MAX, TINY=FP32_TINY,
                                       HW=_hw_cast(w.device), num_warps=CAST_WARPS)
    return (q, s), (qt, s.transpose(1, 2))


# ---- dequantisation (the GEMMs' reference) --------------------------------------------------------------

def _expand_blocks(scale: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """A per-128-block ``scale`` repeated 128 times along ``dim`` and cut to ``size``."""
    return scale.repeat_interleave(QBLOCK, dim).narrow(dim, 0, size)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, scaling: str) -> torch.Tensor:
    """fp32 [.., R, C] values of a row form or weight form ``(q, scale)``."""
    r, c = q.shape[-2:]
    if scaling == "rowwise":
        return q.float() * scale.unsqueeze(-1)
    if scale.dim() == 2:  # activation rows: [cb, R]
        return q.float() * _expand_blocks(scale.t(), c, 1)
    return q.float() * _expand_blocks(_expand_blocks(scale, r, -2), c, -1)  # weights: [G, rb, cb]


def dequantize_tokens(q: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor, scaling: str) -> torch.Tensor:
    """fp32 [C, slots] values of a token form ``(q, scale)``; slots past the used ones are zero."""
    c, slots = q.shape
    used = int(token_slots_used(offs))
    values = torch.zeros(c, slots, device=q.device)
    if scaling == "blockwise":
        per_slot = _expand_blocks(scale[:used // QBLOCK].t(), used, 1)
    else:
        counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
        blocks = (counts + QBLOCK - 1) // QBLOCK
        group = torch.repeat_interleave(torch.arange(offs.numel(), device=q.device), blocks * QBLOCK)
        per_slot = scale.t()[:, group]
    values[:, :used] = q[:, :used].float() * per_slot
    return values
