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

Quantisation runs as torch ops: amax per row (one read), then the product with 448/amax into an fp32
temporary and the rounding copy into e4m3 in the layout the GEMM takes. On an H100 those passes cost more
than the fp8 GEMMs save at Mixtral's expert shapes (bench/fp8_check.py; docs/executor.md): a fused
quantise-and-cast kernel is what would make this path fast. (A one-pass Triton cast was tried and dropped:
on the H100 it did not write torch's bytes in its self-check, and no run was left to find out why.)

Emulation (``kernel=False``): the same quantisation, then dequantise, matmul in fp32, round to bf16 — the
kernels' numbers up to fp32 summation order. It runs where the kernels are absent (CPU, GPUs other than
sm90, FOLDTUNE_FP8_KERNELS=0), for grouped GEMMs whose K or N is not a multiple of 16, and when the
first-use self-check (kernels against emulation on the device) fails; :func:`emulation_reason` and
:func:`gemm_counts` say which ran. The LM head, the router and attention's SDPA stay bf16.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import torch

from executor.kernels.torch_backend import TorchBackend, _grouped_mm_works
from executor.kernels.triton_permute import checked_once

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
ALIGN = 16  # the scaled GEMMs' granularity: 16 bytes of e4m3 (dims, wgrad group sizes)
OUT = torch.bfloat16  # what the scaled GEMMs write

_CHECKED: dict[tuple, bool] = {}
_KERNELS_OK: dict[str, bool] = {}
_COUNTS: Counter = Counter()  # GEMM calls in this process: "kernel" / "emulated"


# ---- quantisation -------------------------------------------------------------------------------------

def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """amax/448 in fp32; 1 where amax is 0 (an all-zero row quantises to zeros instead of 0/0); at least
    fp32's smallest normal, so that its reciprocal stays finite."""
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return scale.clamp_(min=torch.finfo(torch.float32).tiny)


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


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): a contiguous e4m3 copy of ``x`` (2-D or 3-D, any strides) scaled per row of its last dim,
    scale = amax/448 in fp32 with shape ``x.shape[:-1]``, so that x ≈ q · scale[..., None]."""
    amax = torch.linalg.vector_norm(x, float("inf"), dim=-1).float()  # max |x| per row, no |x| temporary
    scale = _scale_of(amax)
    q = torch.empty(x.shape, dtype=E4M3, device=x.device)
    x3 = _as_brc(x)
    _cast(_as_brc(q), x3, _as_brc((1.0 / scale).unsqueeze(-1)).expand(x3.shape))
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values q · scale (per row of the last dim), the inverse of :func:`quantize_rowwise`."""
    return q.float() * scale.unsqueeze(-1)


# ---- where the kernels run ----------------------------------------------------------------------------

def _kernels_absent(device: torch.device) -> str | None:
    """Why the sm90 scaled GEMMs cannot run on ``device`` (None: they can, pending the self-check)."""
    if device.type != "cuda":
        return f"no fp8 GEMM kernels on {device.type}"
    if os.environ.get("FOLDTUNE_FP8_KERNELS", "1") == "0":
        return "FOLDTUNE_FP8_KERNELS=0"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no _scaled_grouped_mm"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"rowwise fp8 grouped GEMMs need sm90, this GPU is sm{major}{minor}"
    return None


def kernels_ok(device: torch.device) -> bool:
    """Whether the scaled GEMMs run on ``device``: present, and equal to the emulation (checked once)."""
    key = str(device)
    if key not in _KERNELS_OK:
        _KERNELS_OK[key] = _kernels_absent(device) is None and checked_once(
            _CHECKED, (key,), _check_against_emulation, "fp8 scaled GEMMs")
    return _KERNELS_OK[key]


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
    if _grouped_mm_works(a_NT.device, a_NT.dtype):
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


def scaled_mm_nt(a_MK: torch.Tensor, b_NK: torch.Tensor, kernel: bool) -> torch.Tensor:
    """a·bᵀ [M, N] in bf16, both operands quantised per row (along K); ``kernel``: torch._scaled_mm."""
    _COUNTS["kernel" if kernel else "emulated"] += 1
    n = b_NK.shape[0]
    if kernel:  # zero rows/columns change neither amax nor the products
        a_MK, b_NK = _pad_dim(a_MK, 1, ALIGN), _pad_dim(_pad_dim(b_NK, 1, ALIGN), 0, ALIGN)
    qa, sa = quantize_rowwise(a_MK)
    qb, sb = quantize_rowwise(b_NK)
    if not kernel:
        return (dequantize(qa, sa) @ dequantize(qb, sb).t()).to(OUT)
    out = torch._scaled_mm(qa, qb.t(), sa.unsqueeze(1), sb.unsqueeze(0), out_dtype=OUT)
    return out[:, :n] if out.shape[1] != n else out


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_NK, kernel):
        ctx.save_for_backward(x_MK, w_NK)
        ctx.kernel = kernel
        return scaled_mm_nt(x_MK, w_NK, kernel).to(x_MK.dtype)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, w_NK = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = scaled_mm_nt(dy_MN, w_NK.t(), ctx.kernel).to(x_MK.dtype)
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


def scaled_grouped_nt(a_MK: torch.Tensor, b_GNK: torch.Tensor, offs_G: torch.Tensor, kernel: bool) -> torch.Tensor:
    """[M, N] bf16: rows offs[g-1]:offs[g] of a times b[g]ᵀ, a quantised per row, b per (group, row)."""
    kernel = kernel and _grouped_kernel_fits(*b_GNK.shape[1:])
    _COUNTS["kernel" if kernel else "emulated"] += 1
    qa, sa = quantize_rowwise(a_MK)
    qb, sb = quantize_rowwise(b_GNK)
    if not kernel:
        return _fp32_grouped_nt(dequantize(qa, sa), dequantize(qb, sb), offs_G).to(OUT)
    return torch._scaled_grouped_mm(qa, qb.transpose(-2, -1), sa, sb, offs=offs_G, out_dtype=OUT)


@dataclass
class PaddedGroups:
    """Rows sorted by group, re-laid so every group spans a positive multiple of 16 rows (zeros after its
    own): row i goes to ``dest_M[i]``; ``offs_G`` (int32) are the padded groups' ends, the last one
    ``rows`` (it takes the slack); padded row r belongs to group ``group_of_block[r // 16]``."""

    dest_M: torch.Tensor
    offs_G: torch.Tensor
    group_of_block: torch.Tensor
    rows: int


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
    return PaddedGroups(dest, padded_ends.int(), group_of_block, rows)


def quantize_groups_colwise(x_MC: torch.Tensor, groups: PaddedGroups) -> tuple[torch.Tensor, torch.Tensor]:
    """(qT [C, rows] e4m3 contiguous, scale [G, C] fp32): the padded rows of ``x`` transposed, each column
    scaled per group — the wgrad GEMM's A (row-major) or, transposed back, its column-major B."""
    c, g = x_MC.shape[1], groups.offs_G.numel()
    padded = x_MC.new_zeros(groups.rows, c).index_copy_(0, groups.dest_M, x_MC)
    blocks = padded.view(groups.rows // ALIGN, ALIGN, c)  # every 16-row block lies in one group
    block_amax = torch.linalg.vector_norm(blocks, float("inf"), dim=1).float()
    index = groups.group_of_block.unsqueeze(1).expand(-1, c)
    amax = block_amax.new_zeros(g, c).scatter_reduce_(0, index, block_amax, "amax")
    scale = _scale_of(amax)
    q = torch.empty(c, groups.rows, dtype=E4M3, device=x_MC.device)
    _cast(q.t().unsqueeze(0), padded.unsqueeze(0), (1.0 / scale)[groups.group_of_block].unsqueeze(0), ALIGN)
    return q, scale


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
    if _grouped_mm_works(dy_MN.device, dy_MN.dtype):
        return torch._grouped_mm(dy_MN.t(), x_MK, offs=offs_G)
    return _fp32_grouped_2d2d(dy_MN.t().float(), x_MK.t().float(), offs_G).to(dy_MN.dtype)


def fp8_wgrad() -> bool:
    return os.environ.get("FOLDTUNE_FP8_WGRAD", "fp8") != "bf16"


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_GNK, offs_G, kernel):
        ctx.save_for_backward(x_MK, w_GNK, offs_G)
        ctx.kernel = kernel
        return scaled_grouped_nt(x_MK, w_GNK, offs_G, kernel).to(x_MK.dtype)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, w_GNK, offs_G = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = scaled_grouped_nt(dy_MN, w_GNK.transpose(-2, -1), offs_G, ctx.kernel).to(x_MK.dtype)
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
