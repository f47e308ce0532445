"""The fp32 main-gradient accumulation, ``main += grad`` (fp32 buffer, bf16/fp16 gradient), in one vectorised
Triton kernel on CUDA, where Triton imports.

Every micro-batch's backward adds each 16-bit weight gradient into its fp32 ``main_grad``
(:func:`executor.parallel.grad_reduce._accumulate`). torch's ``main.add_(grad)`` with mixed dtypes runs its
non-vectorised 'unrolled' elementwise kernel: on one H200 it took 49 ms, 20 % of a Mixtral 2-layer proxy
step (docs/benchmarks.md: 200 calls, 4 micro-batches of 3.16e9 parameters,
127 GB at 10 bytes each, i.e. about 2.6 TB/s of the H200's 4.8). This kernel moves the same 10 bytes per element
(read 2 + 4, write 4) with large blocks and several elements per thread, so the loads and stores are wide.

Numerics are torch's exactly: the 16-bit value is widened to fp32 (exact) and added in fp32 with one
round-to-nearest, which is what ``add_`` does (alpha = 1 multiplies exactly); the first-use check asserts the
two agree bit for bit. Offsets are 64-bit, so buffers of more than 2^31 elements are fine. The body runs
unmasked (whole blocks) and only the last partial block masked, so odd sizes keep the wide accesses.
Its copy mode writes a step's first gradient (``main = grad`` widened, 6 bytes an element) instead of
adding it to a zero-filled buffer (:func:`copy_main_grad_`). Set FOLDTUNE_FUSED_GRAD_ACCUM=0 to use torch's
``add_`` / ``copy_`` on CUDA too.
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

#: Elements per program: 4096 over 8 warps is 16 per thread.
BLOCK = 4096
NUM_WARPS = 8
#: Elements per thread per access: the block is laid out as [BLOCK / VEC, VEC] rows of VEC contiguous
#: elements, thread t holding whole rows. With VEC = 4 the fp32 accesses are 16-byte vectors and the 16-bit
#: loads 8-byte ones, all in one register layout. The flat 1-D block (VEC = 0) loads the 16-bit gradient 8
#: per thread (16 bytes) but stores fp32 only 4 per thread (Triton caps a store at 128 bits), so Triton
#: inserts a layout conversion through shared memory with barriers between the loads and the store (seen in
#: the sm90 PTX); bench/grad_accumulate_gpu.py --sweep times both.
VEC = 4

#: Smallest tensor (elements) the kernel takes: below it torch's add_ is faster, its launch costing less
#: host time than the Triton launch's. Measured on one H200 (bench/grad_accumulate_gpu.py): at 1.0 M
#: elements torch 9.2 us against the kernel's 41.5 us; at 16.8 M the kernel 43.4 us against 64.5 us. Sizes in
#: between were not measured: 4 M is a guess at the crossing.
MIN_KERNEL_ELEMENTS = 1 << 22

#: Gradient dtypes the kernel takes (the main gradient is always fp32).
GRAD_DTYPES = (torch.bfloat16, torch.float16)


def available(main: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether the kernel may run on this pair: Triton imports, both on one CUDA device, fp32 main and a
    16-bit gradient of the same shape, both contiguous, and not switched off (FOLDTUNE_FUSED_GRAD_ACCUM=0)."""
    return (triton is not None and main.is_cuda and grad.device == main.device
            and main.dtype == torch.float32 and grad.dtype in GRAD_DTYPES and grad.shape == main.shape
            and main.is_contiguous() and grad.is_contiguous()
            and os.environ.get("FOLDTUNE_FUSED_GRAD_ACCUM", "1") != "0")


if triton is not None:

    @triton.jit
    def _accumulate_kernel(main_ptr, grad_ptr, start, n, BLOCK: tl.constexpr, VEC: tl.constexpr,
                           MASKED: tl.constexpr, COPY: tl.constexpr = False):
        # Program i covers elements [start + i·BLOCK, start + (i+1)·BLOCK); 64-bit, as n may pass 2^31.
        # COPY: main = grad widened (a step's first gradient: 6 bytes an element, main not read)
        if VEC == 0:
            local = tl.arange(0, BLOCK)
        else:
            local = tl.arange(0, BLOCK // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
        offs = start + tl.program_id(0).to(tl.int64) * BLOCK + local
        if MASKED:
            mask = offs < n
            g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if not COPY:
                g += tl.load(main_ptr + offs, mask=mask, other=0.0)
            tl.store(main_ptr + offs, g, mask=mask)
        else:
            # Every element is read once: evict_first keeps the streams from flushing the L2.
            g = tl.load(grad_ptr + offs, eviction_policy="evict_first").to(tl.float32)
            if not COPY:
                g += tl.load(main_ptr + offs, eviction_policy="evict_first")
            tl.store(main_ptr + offs, g, eviction_policy="evict_first")


def accumulate_(main: torch.Tensor, grad: torch.Tensor, block: int = BLOCK, vec: int = VEC,
                num_warps: int = NUM_WARPS, copy: bool = False) -> torch.Tensor:
    """``main += grad`` in place through the Triton kernel (``copy``: ``main = grad`` widened): ``main``
    contiguous fp32, ``grad`` contiguous bf16/fp16 of the same shape (callers check :func:`available`).
    Returns ``main``. ``block``, ``vec`` (0: a flat block) and ``num_warps`` are for the benchmark's sweep;
    ``block`` a power of two ≥ ``vec``."""
    n = main.numel()
    full = n // block
    if full:  # whole blocks, unmasked
        _accumulate_kernel[(full,)](main, grad, 0, n, BLOCK=block, VEC=vec, MASKED=False, COPY=copy,
                                    num_warps=num_warps)
    if n > full * block:  # the last partial block
        _accumulate_kernel[(1,)](main, grad, full * block, n, BLOCK=block, VEC=vec, MASKED=True, COPY=copy,
                                 num_warps=num_warps)
    return main


_CHECKED: dict[tuple, bool] = {}


def _check_against_torch(dtype: torch.dtype, device: str) -> None:
    """Raise unless the kernel's result equals torch's ``main.add_(grad)`` bit for bit: random values over a
    wide range (roundings of every kind) plus the special pairs below;
    2·BLOCK + 1003 elements run both the unmasked body and the masked tail."""
    gen = torch.Generator(device=device).manual_seed(0)
    n = 2 * BLOCK + 1003
    main = torch.randn(n, device=device, generator=gen) * torch.exp2(
        torch.randint(-30, 30, (n,), device=device, generator=gen).float())
    grad = (torch.randn(n, device=device, generator=gen) * torch.exp2(
        torch.randint(-20, 20, (n,), device=device, generator=gen).float())).to(dtype)
    tiny = torch.finfo(torch.float32).tiny
    big = torch.finfo(torch.float32).max
    # pairwise: signed zeros, infinities, a sum that turns subnormal (bf16 holds -tiny; fp16 flushes it to
    # -0), a subnormal main gradient (flush-to-zero would lose it), overflow (bf16's max), ties below 1 ulp
    special_main = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1.5 * tiny, tiny / 4, big, 1.0, -1.0,
                                 3.0], device=device)
    special_grad = torch.tensor([-0.0, -0.0, 1.0, 2.0, -tiny, 0.0, float(torch.finfo(dtype).max), 2.0 ** -24,
                                 -2.0 ** -23, 2.0 ** -23], device=device).to(dtype)
    main[: special_main.numel()] = special_main
    grad[: special_grad.numel()] = special_grad
    for copy, want in ((False, main.clone().add_(grad)), (True, main.clone().copy_(grad))):
        got = accumulate_(main.clone(), grad, copy=copy)
        if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
            bad = (got.view(torch.int32) != want.view(torch.int32)).nonzero()[:4].flatten().tolist()
            raise AssertionError(f"fused grad {'copy' if copy else 'accumulation'} differs from torch's "
                                 f"{'copy_' if copy else 'add_'} at {bad}: {got[bad].tolist()} vs {want[bad].tolist()}")


def checked(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel compiles and matches torch bit for bit for this gradient dtype (checked once)."""
    return checked_once(_CHECKED, (dtype, str(device)), _check_against_torch, "fused grad accumulation")


def usable(main: torch.Tensor, grad: torch.Tensor) -> bool:
    """:func:`available` and the first-use check passed for the gradient's dtype on this device."""
    return available(main, grad) and checked(grad.dtype, main.device)


def accumulate_main_grad_(main: torch.Tensor, grad: torch.Tensor) -> None:
    """``main += grad``: the Triton kernel where :func:`usable` on tensors of at least MIN_KERNEL_ELEMENTS,
    else torch's ``add_`` (CPU always)."""
    if main.numel() >= MIN_KERNEL_ELEMENTS and usable(main, grad):
        accumulate_(main, grad)
    else:
        main.add_(grad)


def copy_main_grad_(main: torch.Tensor, grad: torch.Tensor) -> None:
    """``main = grad`` widened to fp32 (a step's first gradient): the Triton kernel in copy mode where
    :func:`usable`, else torch's ``copy_``, whose mixed-dtype path is the non-vectorised kernel (1.8 TB/s on
    an H100, docs/benchmarks.md)."""
    if main.numel() >= MIN_KERNEL_ELEMENTS and usable(main, grad):
        accumulate_(main, grad, copy=True)
    else:
        main.copy_(grad)
