"""foldtune's grouped fp8 GEMM: the experts' forward, dgrad and wgrad as persistent Triton kernels over all
experts at once, e4m3 operands, fp32 accumulation, bf16 output, rowwise or DeepSeek-V3 blockwise scaling
(:mod:`executor.kernels.fp8.grouped_quant` has the operands' layouts and scales).

Two kernels, each one launch of as many programs as the GPU has SMs, each program walking a share of the
output tiles (tile t, t + programs, ...):

- **m-grouped** (forward y = x·wᵀ and dgrad dx = dy·w): out rows offs[g-1]:offs[g] = A rows · B[g]ᵀ. The
  tiles are numbered expert by expert (expert g's ⌈m_g/BM⌉ × ⌈N/BN⌉ tiles after those of the experts before
  it; an expert without rows has none), and within an expert in groups of GROUP_M row tiles, so that the
  programs in flight share the expert's weight tiles in L2. A program finds a tile's expert from the
  experts' tile counts, which it derives once from the offsets in registers (no host sync, no tile map
  built by other launches). Rows of a tile past its expert's end are computed from the next expert's rows
  and not stored.
- **k-grouped** (wgrad dw[g] = dyᵀ_g · x_g): the contraction is over the expert's tokens, read from the
  token form (each expert's tokens in whole 128-slot blocks, zero-padded), so its steps need no masks; every
  expert has its ⌈P/BM⌉ × ⌈Q/BN⌉ output tiles, and an expert without tokens gets zeros.

Scaling: rowwise scales are constant along the contraction and applied in the epilogue; the main loop
accumulates the e4m3 products in the tensor cores and, unless ``fast_accum``, promotes the partial sum into
the fp32 accumulator every BK (Triton's ``max_num_imprecise_acc``), as Transformer Engine does for dgrad
and wgrad. Blockwise: each 128-wide step of the contraction is one dot whose result is scaled by the
step's activation scales (per row) times weight scales (per column) and added to the fp32 accumulator.

Operands are read through pointers (masked only where K is not a multiple of BK) or Hopper's TMA
(host-built tensor descriptors, out-of-bounds zero fill), a tuning choice, as is (m-grouped) fusing a
program's tile loop with its contraction loop so that the next tile's loads overlap this one's epilogue
(``Config.flatten``): the first call at a shape on a GPU times every candidate :class:`Config` (a compile
and five runs each) and keeps the fastest of those equal to the first candidate's result (:func:`tuned`).
FOLDTUNE_FP8_GG_TUNE=0 keeps the first candidate. With ``torch_candidate`` (ExecutorOptions.fp8_expert_gemm
'auto') torch's rowwise grouped GEMM on the same operands is one more m-grouped candidate, so forward and
dgrad run on whichever is faster at each shape.

On CPU (``kernel=False``) the same quantisation runs in torch ops and the GEMMs on the dequantised
operands in fp32 (the emulation: the kernels' numbers up to fp32 summation order). On a GPU the kernels
are checked once against it (:func:`kernels_ok`); if they fail, the experts fall back to
:func:`executor.kernels.fp8.gemm.grouped_mm` (torch's rowwise grouped GEMM) with a warning.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass

import torch

from executor.kernels.first_use import checked_once
from executor.kernels.fp8 import gemm as torch_fp8
from executor.kernels.fp8.gemm import fast_accum_ok
from executor.kernels.fp8.grouped_quant import (QBLOCK, SCALINGS, dequantize_rows, dequantize_tokens, g_pad,
                                                quantize_activation, quantize_weight, token_slots_used)
from executor.kernels.fp8.weight_cache import quantized_weight

try:
    import triton
    import triton.language as tl

    from executor.kernels.fp8.grouped_quant import group_table, pick, unit_owner
except ImportError:  # CPU-only installs
    triton = None

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host-side tensor descriptors: pointer loads only
    TensorDescriptor = None

OUT = torch.bfloat16
_CHECKED: dict[tuple, bool] = {}  # first-use verdicts, keyed ("grouped", device)
_TUNED: dict[tuple, Config] = {}  # the tuned config per (kernel, scaling, shape, device)
_COUNTS: dict[str, int] = {}  # calls by path: "kernel", "emulated", "fallback"
_LAST: dict[str, Config] = {}  # the config of the last launch, by kernel ('m', 'k')


@dataclass(frozen=True)
class Config:
    """One launch shape: output tile BM × BN, contraction step BK, row tiles grouped by GROUP_M (L2 reuse),
    warps, pipeline stages, whether the operands come through TMA descriptors, and persistent programs per
    SM (2: while one program fills its pipeline for its next tile, the other's main loop runs, where
    registers and shared memory let two share an SM; the same compiled kernel, another grid).

    ``flatten``: the loop over a program's tiles and the contraction loop inside it run as one pipelined
    loop, so the loads of a program's next tile are issued while it finishes the current one's last steps
    and epilogue: the other way to hide the pipeline fill, which matters where the contraction is a few
    steps (m-grouped: K of 768 to 2048 against a BK of 128; k-grouped: an expert's tokens, 256 a
    Qwen3-30B-A3B expert at 4096 tokens). m-grouped, whose steps are K's for every tile, has Triton fuse
    the loops (``tl.range(..., flatten=True)``); k-grouped, whose steps are each expert's, walks its (tile,
    step) pairs itself (``_k_grouped_flat_kernel``). ``engine`` 'torch' (:data:`TORCH_KERNEL`, rowwise m-grouped only, with ``torch_candidate``): not a
    Triton launch but ``torch._scaled_grouped_mm`` on the same operands, so the tuner can keep torch's kernel
    at the shapes where it is the faster."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    warps: int
    stages: int
    tma: bool
    per_sm: int = 1
    flatten: bool = False
    engine: str = "triton"

    def label(self) -> str:
        if self.engine != "triton":
            return f"{self.engine} kernel"
        return (f"{self.block_m}x{self.block_n}x{self.block_k} g{self.group_m} w{self.warps} s{self.stages}"
                f"{' tma' if self.tma else ''}{' flat' if self.flatten else ''}"
                f"{f' x{self.per_sm}' if self.per_sm > 1 else ''}")


def _candidates(*shapes: tuple[int, ...], flattened: tuple[tuple[int, ...], ...] = ()) -> tuple[Config, ...]:
    """Each (BM, BN, BK, GROUP_M, warps, stages) with pointer loads and with TMA, one program an SM, then the
    same with two; then each of ``flattened`` with TMA and the tile loop fused into the contraction loop, one
    program an SM and two (where registers and shared memory let two share it). The first (pointers) is the
    reference the tuner compares the others with."""
    return (tuple(Config(*s, tma=tma, per_sm=per_sm) for per_sm in (1, 2) for tma in (False, True) for s in shapes)
            + tuple(Config(*s, tma=True, flatten=True, per_sm=per_sm) for per_sm in (1, 2) for s in flattened))


# Hopper fp8: rowwise promotion and blockwise scaling each keep a second fp32 tile (the step's dot before it
# is added), so tiles are 128 × 128 (eight warps) or 64 × 128 (four; rowwise k-grouped 128 × 128 too, its BK
# of 64 leaving room): 128 × 256 tiles and blockwise 128 × 128 tiles of four warps spilled registers in
# bench/fp8_grouped_compile.py and were never the fastest on an H200 (docs/benchmarks.md). BK 128: one
# scale step a dot.
CONFIGS: dict[tuple[str, str], tuple[Config, ...]] = {
    ("m", "rowwise"): _candidates((128, 128, 128, 8, 8, 4), (64, 128, 128, 8, 4, 4),
                                  flattened=((64, 128, 128, 8, 4, 4), (128, 128, 128, 8, 8, 3))),
    ("m", "blockwise"): _candidates((128, 128, 128, 8, 8, 3), (64, 128, 128, 8, 4, 4),
                                    flattened=((64, 128, 128, 8, 4, 4), (128, 128, 128, 8, 8, 3))),
    ("k", "rowwise"): _candidates((128, 128, 128, 8, 8, 4), (128, 128, 64, 8, 4, 4),
                                  flattened=((128, 128, 64, 8, 4, 4), (128, 128, 128, 8, 8, 3))),
    ("k", "blockwise"): _candidates((128, 128, 128, 8, 8, 3), (128, 128, 64, 8, 8, 4),
                                    flattened=((128, 128, 128, 8, 8, 3), (128, 128, 64, 8, 8, 4))),
}
# torch's rowwise grouped GEMM as one more m-grouped candidate (ExecutorOptions.fp8_expert_gemm 'auto')
TORCH_KERNEL = Config(0, 0, 0, 0, 0, 0, False, engine="torch")


# ---- the kernels ------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _swizzle(t, m_tiles, n_tiles, GROUP_M: tl.constexpr):
        # tile t of an m_tiles × n_tiles grid, GROUP_M row tiles at a time down each column of tiles
        per = GROUP_M * n_tiles
        first = (t // per) * GROUP_M
        size = tl.minimum(m_tiles - first, GROUP_M)
        return first + (t % per) % size, (t % per) // size

    @triton.jit
    def _m_grouped_kernel(a, b, c_ptr, sa_ptr, sb_ptr, offs_ptr, M, N, K, G, programs, s_am, s_bg, s_bn, s_cm,
                          s_sbg, s_sbn, s_sbk, G_PAD: tl.constexpr, BLOCKWISE: tl.constexpr,
                          FAST_ACCUM: tl.constexpr, TMA: tl.constexpr, EVEN_K: tl.constexpr, QB: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                          FLATTEN: tl.constexpr):
        n_tiles = tl.cdiv(N, BN)
        idx, _, _, _, m_tiles = group_table(offs_ptr, G, G_PAD, BM)
        tiles = m_tiles * n_tiles
        tile_ends = tl.cumsum(tiles, 0)
        rk = tl.arange(0, BK)
        # the contraction's trip count is the same for every tile and defined before the tile loop: what
        # Triton needs to fuse the two loops
        k_steps = tl.cdiv(K, BK)
        for t in tl.range(tl.program_id(0), tl.sum(tiles), programs, flatten=FLATTEN):
            g = unit_owner(tile_ends, t)
            row0 = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
            row_end = tl.load(offs_ptr + g)
            mt, nt = _swizzle(t - pick(tile_ends - tiles, idx, g), tl.cdiv(row_end - row0, BM), n_tiles, GROUP_M)
            rm = row0 + mt * BM + tl.arange(0, BM)
            rn = nt * BN + tl.arange(0, BN)
            rm_c = tl.minimum(rm, M - 1)  # rows and columns past the ends: clamped reads, never stored
            rn_c = tl.minimum(rn, N - 1)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for ki in range(k_steps):
                k0 = ki * BK
                if TMA:
                    a_t = a.load([row0 + mt * BM, k0])
                    b_t = b.load([g * N + nt * BN, k0])
                else:
                    a_at = a + rm_c.to(tl.int64)[:, None] * s_am + (k0 + rk)[None, :]
                    b_at = b + g.to(tl.int64) * s_bg + rn_c.to(tl.int64)[:, None] * s_bn + (k0 + rk)[None, :]
                    if EVEN_K:
                        a_t = tl.load(a_at)
                        b_t = tl.load(b_at)
                    else:
                        in_k = (k0 + rk < K)[None, :]
                        a_t = tl.load(a_at, mask=in_k, other=0.0)
                        b_t = tl.load(b_at, mask=in_k, other=0.0)
                if BLOCKWISE:
                    kq = k0 // QB
                    sa = tl.load(sa_ptr + kq.to(tl.int64) * M + rm_c)
                    sb = tl.load(sb_ptr + g * s_sbg + (rn_c // QB) * s_sbn + kq * s_sbk)
                    acc += tl.dot(a_t, tl.trans(b_t)) * (sa[:, None] * sb[None, :])
                elif FAST_ACCUM:
                    acc = tl.dot(a_t, tl.trans(b_t), acc)
                else:
                    acc = tl.dot(a_t, tl.trans(b_t), acc, max_num_imprecise_acc=BK)
            if not BLOCKWISE:
                sa = tl.load(sa_ptr + rm_c)
                sb = tl.load(sb_ptr + g * s_sbg + rn_c * s_sbn)
                acc = acc * sa[:, None] * sb[None, :]
            mask = (rm < row_end)[:, None] & (rn < N)[None, :]
            tl.store(c_ptr + rm.to(tl.int64)[:, None] * s_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _k_grouped_kernel(a, b, c_ptr, sa_ptr, sb_ptr, offs_ptr, P, Q, G, programs, s_a, s_b,
                          G_PAD: tl.constexpr, BLOCKWISE: tl.constexpr, TMA: tl.constexpr, QB: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
        # c[g] [P, Q] = a[:, expert g's slots] · b[:, same]ᵀ; a [P, slots], b [Q, slots] in the token form
        p_tiles = tl.cdiv(P, BM)
        q_tiles = tl.cdiv(Q, BN)
        per = p_tiles * q_tiles
        idx, _, _, blk_ends, blks = group_table(offs_ptr, G, G_PAD, QB)
        rk = tl.arange(0, BK)
        for t in range(tl.program_id(0), G * per, programs):
            g = t // per
            pt, qt = _swizzle(t - g * per, p_tiles, q_tiles, GROUP_M)
            first = pick(blk_ends - blks, idx, g) * QB
            steps = pick(blks, idx, g) * (QB // BK)
            rp = pt * BM + tl.arange(0, BM)
            rq = qt * BN + tl.arange(0, BN)
            rp_c = tl.minimum(rp, P - 1)
            rq_c = tl.minimum(rq, Q - 1)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for i in range(steps):
                k0 = first + i * BK
                if TMA:
                    a_t = a.load([pt * BM, k0])
                    b_t = b.load([qt * BN, k0])
                else:
                    a_t = tl.load(a + rp_c.to(tl.int64)[:, None] * s_a + (k0 + rk)[None, :])
                    b_t = tl.load(b + rq_c.to(tl.int64)[:, None] * s_b + (k0 + rk)[None, :])
                if BLOCKWISE:
                    kq = (k0 // QB).to(tl.int64)
                    sa = tl.load(sa_ptr + kq * P + rp_c)
                    sb = tl.load(sb_ptr + kq * Q + rq_c)
                    acc += tl.dot(a_t, tl.trans(b_t)) * (sa[:, None] * sb[None, :])
                else:
                    acc = tl.dot(a_t, tl.trans(b_t), acc, max_num_imprecise_acc=BK)
            if not BLOCKWISE:
                sa = tl.load(sa_ptr + g * P + rp_c)
                sb = tl.load(sb_ptr + g * Q + rq_c)
                acc = acc * sa[:, None] * sb[None, :]
            mask = (rp < P)[:, None] & (rq < Q)[None, :]
            # the tile's corner as one 64-bit pointer, the offsets within the expert's [P, Q] in 32 bits (fewer
            # registers in the epilogue than a 64-bit offset an element)
            tile_at = c_ptr + g.to(tl.int64) * P * Q
            tl.store(tile_at + (rp[:, None] * Q + rq[None, :]), acc.to(c_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _k_grouped_flat_kernel(a, b, c_ptr, sa_ptr, sb_ptr, offs_ptr, P, Q, G, programs, s_a, s_b,
                               G_PAD: tl.constexpr, BLOCKWISE: tl.constexpr, TMA: tl.constexpr, QB: tl.constexpr,
                               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
        # _k_grouped_kernel's tiles and products, walked as ONE loop over this program's (tile, step) pairs,
        # so that the pipeline runs on from one tile into the next: the loads of a tile's first steps are in
        # flight while the previous tile finishes. Triton cannot fuse the two loops itself, the contraction's
        # length being the expert's. An expert without tokens takes one step (its product discarded) so
        # that its tiles still get their zeros.
        p_tiles = tl.cdiv(P, BM)
        q_tiles = tl.cdiv(Q, BN)
        per = p_tiles * q_tiles
        idx, _, _, blk_ends, blks = group_table(offs_ptr, G, G_PAD, QB)
        pid = tl.program_id(0)
        steps_of = tl.maximum(blks, 1) * (QB // BK)
        # this program's tiles are pid, pid + programs, ...: those of expert g number n((g+1)·per) - n(g·per),
        # n(x) = how many of them lie below tile x
        below_end = (idx + 1) * per - pid
        below_start = idx * per - pid
        mine = (tl.where(below_end > 0, (below_end + programs - 1) // programs, 0)
                - tl.where(below_start > 0, (below_start + programs - 1) // programs, 0))
        total = tl.sum(tl.where(idx < G, mine * steps_of, 0))
        rk = tl.arange(0, BK)
        t = pid
        i = 0
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for _ in range(total):
            g = t // per
            pt, qt = _swizzle(t - g * per, p_tiles, q_tiles, GROUP_M)
            k0 = pick(blk_ends - blks, idx, g) * QB + i * BK
            rp = pt * BM + tl.arange(0, BM)
            rq = qt * BN + tl.arange(0, BN)
            rp_c = tl.minimum(rp, P - 1)
            rq_c = tl.minimum(rq, Q - 1)
            if TMA:
                a_t = a.load([pt * BM, k0])
                b_t = b.load([qt * BN, k0])
            else:
                a_t = tl.load(a + rp_c.to(tl.int64)[:, None] * s_a + (k0 + rk)[None, :])
                b_t = tl.load(b + rq_c.to(tl.int64)[:, None] * s_b + (k0 + rk)[None, :])
            if BLOCKWISE:
                kq = (k0 // QB).to(tl.int64)
                sa = tl.load(sa_ptr + kq * P + rp_c)
                sb = tl.load(sb_ptr + kq * Q + rq_c)
                acc += tl.dot(a_t, tl.trans(b_t)) * (sa[:, None] * sb[None, :])
            else:
                acc = tl.dot(a_t, tl.trans(b_t), acc, max_num_imprecise_acc=BK)
            # the next (tile, step) by selects, outside the epilogue's branch: the loads' addresses then depend
            # on nothing the epilogue does, and the pipeliner can issue them stages ahead
            last = i == pick(steps_of, idx, g) - 1
            if last:
                if not BLOCKWISE:
                    sa = tl.load(sa_ptr + g * P + rp_c)
                    sb = tl.load(sb_ptr + g * Q + rq_c)
                    acc = acc * sa[:, None] * sb[None, :]
                # an expert without tokens read a block that is not its own (or not written): where, not a
                # product, so that no NaN of those bytes survives
                acc = tl.where(pick(blks, idx, g) > 0, acc, 0.0)
                mask = (rp < P)[:, None] & (rq < Q)[None, :]
                tile_at = c_ptr + g.to(tl.int64) * P * Q  # 32-bit offsets within the expert, as above
                tl.store(tile_at + (rp[:, None] * Q + rq[None, :]), acc.to(c_ptr.dtype.element_ty), mask=mask)
                acc = tl.zeros((BM, BN), dtype=tl.float32)
            i = tl.where(last, 0, i + 1)
            t = tl.where(last, t + programs, t)


# ---- launches -------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _sm_count(device: str) -> int:
    return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count


def _programs(device: torch.device, tiles_bound: int, per_sm: int) -> int:
    """Persistent programs: ``per_sm`` per SM (3 a "SM" in the interpreter, so that each walks several
    tiles), at most one a tile."""
    return max(1, min(tiles_bound, per_sm * (_sm_count(str(device)) if device.type == "cuda" else 3)))


def _tma_ok(*operands: torch.Tensor) -> bool:
    """Whether TMA descriptors can address these 2-D e4m3 views (16-byte aligned base and row stride)."""
    return TensorDescriptor is not None and all(
        t.stride(-1) == 1 and t.stride(-2) % 16 == 0 and t.data_ptr() % 16 == 0 for t in operands)


def _operands(cfg: Config, qa: torch.Tensor, qb: torch.Tensor, qb_2d: torch.Tensor) -> tuple[bool, object, object]:
    """(whether the kernel loads through TMA, its A argument, its B argument): TMA descriptors of ``qa`` and of
    ``qb_2d`` (B's rows as one 2-D view) with the config's tiles where the config asks for TMA and
    :func:`_tma_ok` allows it, else the tensors themselves (``qa``, ``qb``)."""
    if cfg.tma and _tma_ok(qa, qb_2d):
        return (True, TensorDescriptor.from_tensor(qa, [cfg.block_m, cfg.block_k]),
                TensorDescriptor.from_tensor(qb_2d, [cfg.block_n, cfg.block_k]))
    return False, qa, qb


def _torch_kernel_fits(a, b, scaling: str) -> bool:
    """Whether torch's rowwise grouped GEMM can take these m-grouped operands: rowwise, on a GPU where
    :mod:`executor.kernels.fp8.gemm` runs it (present, sm90, passed its own first-use check), N and K
    multiples of 16."""
    qa, qb = a[0], b[0]
    return (scaling == "rowwise" and qa.device.type == "cuda" and qb.shape[1] % 16 == 0 and qb.shape[2] % 16 == 0
            and torch_fp8.kernels_ok(qa.device))


def _launch_m(cfg: Config, a, b, offs, scaling: str, fast_accum: bool) -> torch.Tensor:
    (qa, sa), (qb, sb) = a, b
    m, k = qa.shape
    g, n, _ = qb.shape
    if cfg.engine == "torch":  # the same operands and scales as torch's path quantises (rowwise, fp32)
        return torch._scaled_grouped_mm(qa, qb.transpose(-2, -1), sa, sb, offs=offs, out_dtype=OUT,
                                        use_fast_accum=fast_accum)
    out = torch.empty(m, n, dtype=OUT, device=qa.device)
    bound = (triton.cdiv(m, cfg.block_m) + g) * triton.cdiv(n, cfg.block_n)
    programs = _programs(qa.device, bound, cfg.per_sm)
    blockwise = scaling == "blockwise"
    tma, a_arg, b_arg = _operands(cfg, qa, qb, qb.view(g * n, k))
    s_sb = sb.stride() if blockwise else (*sb.stride(), 0)
    _m_grouped_kernel[(programs,)](
        a_arg, b_arg, out, sa, sb, offs, m, n, k, g, programs, qa.stride(0), qb.stride(0), qb.stride(1),
        out.stride(0), *s_sb, G_PAD=g_pad(g), BLOCKWISE=blockwise, FAST_ACCUM=fast_accum, TMA=tma,
        EVEN_K=k % cfg.block_k == 0, QB=QBLOCK, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
        GROUP_M=cfg.group_m, FLATTEN=cfg.flatten, num_warps=cfg.warps, num_stages=cfg.stages)
    return out


def _launch_k(cfg: Config, a, b, offs, scaling: str) -> torch.Tensor:
    (qa, sa), (qb, sb) = a, b
    p, q, g = qa.shape[0], qb.shape[0], offs.numel()
    if p * q >= 2**31:  # the kernels address within an expert's [P, Q] gradient in 32 bits
        raise ValueError(f"an expert's weight gradient of {p} x {q} elements is past 32-bit offsets")
    out = torch.empty(g, p, q, dtype=OUT, device=qa.device)
    programs = _programs(qa.device, g * triton.cdiv(p, cfg.block_m) * triton.cdiv(q, cfg.block_n), cfg.per_sm)
    tma, a_arg, b_arg = _operands(cfg, qa, qb, qb)
    kernel = _k_grouped_flat_kernel if cfg.flatten else _k_grouped_kernel
    kernel[(programs,)](
        a_arg, b_arg, out, sa, sb, offs, p, q, g, programs, qa.stride(0), qb.stride(0), G_PAD=g_pad(g),
        BLOCKWISE=scaling == "blockwise", TMA=tma, QB=QBLOCK, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
        GROUP_M=cfg.group_m, num_warps=cfg.warps, num_stages=cfg.stages)
    return out


def _bucket(m: int) -> int:
    """Row counts tuned together: the next power of two."""
    return 1 << max(0, m - 1).bit_length()


def tuned(kind: str, scaling: str, key: tuple, launch, device: torch.device, timer=None,
          extra: tuple[Config, ...] = ()) -> Config:
    """The config for ``kind`` ('m' or 'k') at ``key``: the first candidate off the GPU or with
    FOLDTUNE_FP8_GG_TUNE=0; else, on the first call at this key, each candidate of ``CONFIGS`` and then
    ``extra`` run (``launch(cfg)`` returns its output) and timed (``timer(call)``, default
    :func:`time_launch`), the fastest kept among those that compile and whose output equals the first
    working candidate's within bf16 rounding. ``extra`` is part of the key: a call with torch's kernel
    among the candidates does not reuse a choice made without it."""
    timer = timer or time_launch
    full_key = (kind, scaling, str(device), *key, tuple(c.label() for c in extra))
    if full_key in _TUNED:
        return _TUNED[full_key]
    candidates = CONFIGS[(kind, scaling)] + tuple(extra)
    if device.type != "cuda" or os.environ.get("FOLDTUNE_FP8_GG_TUNE", "1") == "0":
        _TUNED[full_key] = candidates[0]
        return candidates[0]
    reference: list[torch.Tensor] = []

    def seconds(cfg: Config) -> float:
        out = launch(cfg)
        if not reference:
            reference.append(out.clone())
        else:
            torch.testing.assert_close(out.float(), reference[0].float(), rtol=2**-7,
                                       atol=1e-3 * float(reference[0].float().abs().max()))
        return timer(lambda: launch(cfg))

    # a config that fails to compile or differs is skipped
    best = fastest(candidates, seconds, lambda cfg: f"grouped fp8 GEMM config {cfg.label()} skipped at {full_key}")
    if best is None:
        raise RuntimeError(f"no grouped fp8 GEMM config runs at {full_key}")
    _TUNED[full_key] = best
    return best


def fastest(candidates, seconds, skipped) -> object | None:
    """The candidate of fewest ``seconds(candidate)``, in order (the first of equal times); one whose
    ``seconds`` raises is skipped with a warning ``skipped(candidate)``: its reason; None if every one raises.
    The loop of :func:`tuned` and of the experts' fp8/bf16 choice (:mod:`executor.kernels.fp8.expert_pick`)."""
    best, best_s = None, float("inf")
    for candidate in candidates:
        try:
            took = seconds(candidate)
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"{skipped(candidate)}: {type(exc).__name__}: {str(exc)[:200]}", stacklevel=3)
            continue
        if took < best_s:
            best, best_s = candidate, took
    return best


def time_launch(call, repeats: int = 3) -> float:
    """Median device seconds of ``call()`` over ``repeats`` (CUDA events, after one untimed call)."""
    call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def m_grouped(a: tuple, b: tuple, offs: torch.Tensor, scaling: str, kernel: bool, fast_accum: bool = False,
              config: Config | None = None, torch_candidate: bool = False) -> torch.Tensor:
    """[M, N] bf16: rows offs[g-1]:offs[g] of A times B[g]ᵀ, A = ``a`` a row form [M, K] and B = ``b`` a
    weight form [G, N, K] (:mod:`executor.kernels.fp8.grouped_quant`); ``kernel`` the Triton kernel, else the
    emulation; ``config`` a launch shape (None: :func:`tuned`); ``torch_candidate``: torch's rowwise grouped
    GEMM (:data:`TORCH_KERNEL`) is one more candidate of the tuner where it fits the operands."""
    qa, qb = a[0], b[0]
    m, g, n = qa.shape[0], qb.shape[0], qb.shape[1]
    if not (kernel and m):
        _COUNTS["emulated"] = _COUNTS.get("emulated", 0) + 1
        return _emulate_m(dequantize_rows(*a, scaling), dequantize_rows(*b, scaling), offs).to(OUT)
    _COUNTS["kernel"] = _COUNTS.get("kernel", 0) + 1
    launch = functools.partial(_launch_m, a=a, b=b, offs=offs, scaling=scaling, fast_accum=fast_accum)
    if config is None:
        key = (g, n, qa.shape[1], _bucket(m), fast_accum)
        extra = (TORCH_KERNEL,) if torch_candidate and _torch_kernel_fits(a, b, scaling) else ()
        config = tuned("m", scaling, key, launch, qa.device, extra=extra)
    _LAST["m"] = config
    return launch(config)


def k_grouped(a: tuple, b: tuple, offs: torch.Tensor, scaling: str, kernel: bool,
              config: Config | None = None) -> torch.Tensor:
    """[G, P, Q] bf16: per expert g, A's columns of its tokens times B's ᵀ, A = ``a`` and B = ``b`` token
    forms [P, slots] and [Q, slots] of the same experts (``offs``); zeros for an expert without tokens."""
    qa, qb = a[0], b[0]
    g, p, q = offs.numel(), qa.shape[0], qb.shape[0]
    if not (kernel and qa.shape[1]):
        _COUNTS["emulated"] = _COUNTS.get("emulated", 0) + 1
        return _emulate_k(dequantize_tokens(*a, offs, scaling), dequantize_tokens(*b, offs, scaling), offs).to(OUT)
    _COUNTS["kernel"] = _COUNTS.get("kernel", 0) + 1
    launch = functools.partial(_launch_k, a=a, b=b, offs=offs, scaling=scaling)
    if config is None:
        config = tuned("k", scaling, (g, p, q, _bucket(qa.shape[1])), launch, qa.device)
    _LAST["k"] = config
    return launch(config)


def last_config(kind: str) -> Config | None:
    """The config of the last launch of kernel ``kind`` ('m' or 'k') in this process (None: none yet)."""
    return _LAST.get(kind)


def _emulate_m(a_MK: torch.Tensor, b_GNK: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out = a_MK.new_zeros(a_MK.shape[0], b_GNK.shape[1])
    bounds = [0, *offs.tolist()]
    for g, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        out[lo:hi] = a_MK[lo:hi] @ b_GNK[g].t()
    return out


def _emulate_k(a_PS: torch.Tensor, b_QS: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
    ends = torch.cumsum((counts + QBLOCK - 1) // QBLOCK * QBLOCK, 0).tolist()
    return torch.stack([a_PS[:, lo:hi] @ b_QS[:, lo:hi].t() for lo, hi in zip([0, *ends], ends)])


# ---- where the kernels run ------------------------------------------------------------------------------

def _kernels_absent(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device`` (None: they can, pending the self-check)."""
    if triton is None:
        return "Triton is not installed"
    if device.type != "cuda":
        return f"no fp8 Triton GEMM on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"e4m3 tensor cores need sm89 or later, this GPU is sm{major}{minor}"
    return None


def kernels_ok(device: torch.device) -> bool:
    """Whether the Triton kernels run on ``device``: present and, checked once per device, equal to the
    emulation (:func:`_check_against_emulation`)."""
    return _kernels_absent(device) is None and checked_once(_CHECKED, ("grouped", str(device)),
                                                            _check_against_emulation, "foldtune grouped fp8 GEMM")


def counts() -> dict[str, int]:
    """Grouped fp8 GEMM calls of this process by path: 'kernel', 'emulated', 'fallback' (torch's rowwise)."""
    return dict(_COUNTS)


# ---- the experts' linear layer -------------------------------------------------------------------------

def _weight_forms(w: torch.Tensor, scaling: str, kernel: bool, dgrad: bool):
    """(forward form, dgrad form or None) of ``w``, cached per value of the weight (the weight cache)."""
    if scaling == "rowwise":
        fwd = quantized_weight(w, both=dgrad)
        return fwd, quantized_weight(w, transposed=True) if dgrad else None
    fwd, bwd = quantized_weight(w, blocks=lambda t: quantize_weight(t, "blockwise", kernel))
    return fwd, bwd


class _GroupedMM(torch.autograd.Function):
    """x·w[g]ᵀ per expert in fp8. The forward quantises x once into both forms (the token form, 1 byte an
    element, is what is saved for the wgrad instead of bf16 x); the backward quantises dy once into both.
    ``torch_candidate``: forward and dgrad may run on torch's kernel where the tuner found it faster."""

    @staticmethod
    def forward(ctx, x_MK, w_GNK, offs_G, scaling, kernel, grad, torch_candidate):
        wgrad = grad and ctx.needs_input_grad[1]
        dgrad = grad and ctx.needs_input_grad[0]
        rows, tokens = quantize_activation(x_MK, offs_G, scaling, rows=True, tokens=wgrad, kernel=kernel)
        fwd, _ = _weight_forms(w_GNK, scaling, kernel, dgrad)
        fast = kernel and fast_accum_ok(x_MK.device)
        y = m_grouped(rows, fwd, offs_G, scaling, kernel, fast_accum=fast, torch_candidate=torch_candidate)
        ctx.scaling, ctx.kernel, ctx.weight, ctx.x_dtype = scaling, kernel, w_GNK, x_MK.dtype
        ctx.torch_candidate = torch_candidate
        ctx.save_for_backward(offs_G, *(tokens if wgrad else ()))
        return y.to(x_MK.dtype)

    @staticmethod
    def backward(ctx, dy_MN):
        offs_G, *x_tokens = ctx.saved_tensors
        w_GNK = ctx.weight
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        rows, tokens = quantize_activation(dy_MN, offs_G, ctx.scaling, rows=need_dx, tokens=need_dw,
                                           kernel=ctx.kernel)
        dx = dw = None
        if need_dx:
            _, bwd = _weight_forms(w_GNK, ctx.scaling, ctx.kernel, True)
            dx = m_grouped(rows, bwd, offs_G, ctx.scaling, ctx.kernel,
                           torch_candidate=ctx.torch_candidate).to(ctx.x_dtype)
        if need_dw:
            dw = k_grouped(tokens, tuple(x_tokens), offs_G, ctx.scaling, ctx.kernel).to(w_GNK.dtype)
        return dx, dw, None, None, None, None, None


def grouped_mm(x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor, scaling: str,
               torch_candidate: bool = False) -> torch.Tensor:
    """KernelBackend.grouped_mm in fp8 through foldtune's kernels: rows offs[g-1]:offs[g] of x times w[g]ᵀ
    (offs int32 cumulative, offs[-1] == M), ``scaling`` 'rowwise' or 'blockwise'; ``torch_candidate``
    (rowwise): forward and dgrad on whichever of foldtune's configs and torch's rowwise grouped GEMM the
    tuner finds faster at each shape (the wgrad stays foldtune's). On a GPU whose kernels failed their
    check: torch's rowwise grouped GEMM (:func:`executor.kernels.fp8.gemm.grouped_mm`)."""
    if scaling not in SCALINGS:
        raise ValueError(f"fp8 scaling must be one of {SCALINGS}, got {scaling!r}")
    if x_MK.shape[0] == 0:
        return x_MK @ w_GNK[0].transpose(0, 1)  # the bf16 path's empty product: keeps the graph connected
    kernel = kernels_ok(x_MK.device)
    if not kernel and x_MK.device.type == "cuda":
        _COUNTS["fallback"] = _COUNTS.get("fallback", 0) + 1
        return torch_fp8.grouped_mm(x_MK, w_GNK, offs_G)
    return _GroupedMM.apply(x_MK, w_GNK, offs_G, scaling, kernel, torch.is_grad_enabled(), torch_candidate)


# ---- first-use self-check --------------------------------------------------------------------------------

def compare_on(device, kernel: bool = True) -> None:
    """Raise unless, for both scalings, the quantisation's Triton path writes the torch path's scales and
    bytes and the kernels' forward, dgrad and wgrad equal the emulation within bf16 rounding (2^-7
    relative): experts of 0, 1, 67 and 0 rows (an expert without rows first and last), K and N multiples
    of 16 but not of 128. ``kernel`` False compares the emulation with itself (the CPU test of the check)."""
    gen = torch.Generator(device=device).manual_seed(0)
    offs = torch.tensor([0, 1, 68, 68], device=device, dtype=torch.int32)
    x = torch.randn(68, 80, device=device, generator=gen).to(torch.bfloat16)
    dy = torch.randn(68, 48, device=device, generator=gen).to(torch.bfloat16)
    w = torch.randn(4, 48, 80, device=device, generator=gen).to(torch.bfloat16)
    used = int(token_slots_used(offs))
    for scaling in SCALINGS:
        for t in (x, dy):
            got = quantize_activation(t, offs, scaling, rows=True, tokens=True, kernel=kernel)
            want = quantize_activation(t, offs, scaling, rows=True, tokens=True, kernel=False)
            _same_bytes(got[0], want[0])
            _same_bytes((got[1][0][:, :used], got[1][1][:used // QBLOCK] if scaling == "blockwise" else got[1][1]),
                        (want[1][0][:, :used], want[1][1][:used // QBLOCK] if scaling == "blockwise" else want[1][1]))
        fwd, bwd = quantize_weight(w, scaling, kernel)
        _same_bytes(fwd, quantize_weight(w, scaling, False)[0])
        xr, xt = quantize_activation(x, offs, scaling, tokens=True, kernel=False)
        dr, dt = quantize_activation(dy, offs, scaling, tokens=True, kernel=False)
        for got, want in ((m_grouped(xr, fwd, offs, scaling, kernel), m_grouped(xr, fwd, offs, scaling, False)),
                          (m_grouped(dr, bwd, offs, scaling, kernel), m_grouped(dr, bwd, offs, scaling, False)),
                          (k_grouped(dt, xt, offs, scaling, kernel), k_grouped(dt, xt, offs, scaling, False))):
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3 * float(want.abs().max()))


def _same_bytes(got: tuple, want: tuple) -> None:
    (q, s), (q_ref, s_ref) = got, want
    if not (torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))):
        raise AssertionError("grouped fp8 quantisation: Triton scales or bytes differ from torch's")


def _check_against_emulation(_: str, device: str) -> None:
    before = dict(_COUNTS)
    try:
        compare_on(device)
    finally:  # the check's own calls are not the run's
        _COUNTS.clear()
        _COUNTS.update(before)
