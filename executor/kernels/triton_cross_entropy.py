"""The element-wise work of the fused output layer + loss, one vocabulary block at a time, in one Triton pass
each way on CUDA; the torch ops it replaces are here too, as the fallback and the reference.

:mod:`executor.parallel.linear_cross_entropy` computes each block's logits [N, R] (N tokens, R vocabulary
rows of this block) with ``torch.mm`` in the compute dtype, then:

- forward (:func:`block_stats_`): folds the block into the per-token running maximum, running sum of
  exponentials (rescaled when the maximum grows) and target logit ([N] fp32 each, updated in place);
- backward (:func:`block_grad`): from the recomputed block, the per-token log-sum-exp and the incoming
  gradient, the logit gradient ``(softmax - onehot(label)) · grad`` in the compute dtype.

The torch path (:func:`torch_block_stats_`, :func:`torch_block_grad`) takes an fp32 copy of the block and
runs gather, amax, sub, exp and sum forward, sub, exp, scatter_add, mul and the cast back backward: about 30
bytes of HBM traffic per 16-bit logit forward and 36 backward (``costmodel.loss``). The kernels read each
16-bit logit once forward (2 bytes) and read it and write its gradient in place backward (2 + 2), with the
same fp32 math in registers; results differ from torch's by summation order only. Set
FOLDTUNE_FUSED_CROSS_ENTROPY=0 to use the torch path on CUDA too.
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

#: Logits of one row a forward program reads per step (a program walks one token's row of the block).
FWD_BLOCK = 2048
#: Logits one backward program writes (one token, BLOCK consecutive vocabulary rows).
BWD_BLOCK = 1024


def available(t: torch.Tensor) -> bool:
    """Whether the kernels may run on ``t`` (CUDA, Triton importable, not switched off by the environment)."""
    return triton is not None and t.is_cuda and os.environ.get("FOLDTUNE_FUSED_CROSS_ENTROPY", "1") != "0"


def target_in_block(labels_N: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens whose label is a vocabulary id in [lo, hi), that label's column within the block; 0 elsewhere)."""
    mine = (labels_N >= lo) & (labels_N < hi)
    return mine, torch.where(mine, labels_N - lo, 0)


def torch_block_stats_(block_NR: torch.Tensor, labels_N: torch.Tensor, offset: int, top_N: torch.Tensor,
                       sum_exp_N: torch.Tensor, target_N: torch.Tensor) -> None:
    """The torch path of :func:`block_stats_` (same arguments and effect); ``block_NR`` is consumed."""
    block = block_NR.float()
    mine, column = target_in_block(labels_N, offset, offset + block.shape[1])
    target_N += block.gather(1, column.unsqueeze(1)).squeeze(1) * mine
    new_top = torch.maximum(top_N, block.amax(dim=1))
    # the running sum was taken relative to the old maximum; exp(-inf) = 0 before the first block
    sum_exp_N.mul_(torch.exp(top_N - new_top)).add_(block.sub_(new_top.unsqueeze(1)).exp_().sum(dim=1))
    top_N.copy_(new_top)


def torch_block_grad(block_NR: torch.Tensor, lse_N: torch.Tensor, labels_N: torch.Tensor, offset: int,
                     grad_N: torch.Tensor) -> torch.Tensor:
    """The torch path of :func:`block_grad` (same arguments and result)."""
    probs = block_NR.float().sub_(lse_N.unsqueeze(1)).exp_()
    mine, column = target_in_block(labels_N, offset, offset + probs.shape[1])
    probs.scatter_add_(1, column.unsqueeze(1), -mine.float().unsqueeze(1))
    return probs.mul_(grad_N.unsqueeze(1)).to(block_NR.dtype)


if triton is not None:

    @triton.jit
    def _stats_kernel(x_ptr, labels_ptr, top_ptr, sum_ptr, target_ptr, cols, stride, offset,
                      BLOCK: tl.constexpr):
        # One token's row: an online max / rescaled sum of exp over the row in BLOCK-wide steps, fp32.
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        top = tl.load(top_ptr + row)
        total = tl.load(sum_ptr + row)
        for start in range(0, cols, BLOCK):
            at = start + tl.arange(0, BLOCK)
            x = tl.load(base + at, mask=at < cols, other=float("-inf")).to(tl.float32)
            # every step holds at least one real column, so new_top is finite and exp(top - new_top) is
            # 0 while top is still the -inf it starts at
            new_top = tl.maximum(top, tl.max(x, axis=0))
            total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), axis=0)
            top = new_top
        col = tl.load(labels_ptr + row) - offset
        mine = (col >= 0) & (col < cols)
        picked = tl.load(base + tl.where(mine, col, 0), mask=mine, other=0.0).to(tl.float32)
        tl.store(target_ptr + row, tl.load(target_ptr + row) + picked)
        tl.store(top_ptr + row, top)
        tl.store(sum_ptr + row, total)

    @triton.jit
    def _grad_kernel(x_ptr, lse_ptr, labels_ptr, grad_ptr, cols, stride, offset, BLOCK: tl.constexpr):
        # (exp(x - lse) - [column == label]) · grad, written over x (each element read, then written, by
        # this program only). Rows on grid axis 0 (up to 2^31 - 1), column tiles on axis 1.
        row = tl.program_id(0).to(tl.int64)
        at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = at < cols
        x = tl.load(x_ptr + row * stride + at, mask=mask, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + row)
        g = tl.load(grad_ptr + row)
        col = tl.load(labels_ptr + row) - offset
        p = tl.exp(x - lse) - tl.where(at == col, 1.0, 0.0)
        tl.store(x_ptr + row * stride + at, (p * g).to(x_ptr.dtype.element_ty), mask=mask)


def _rows_ready(block_NR: torch.Tensor) -> torch.Tensor:
    """``block_NR`` with unit column stride (a ``torch.mm`` output already is)."""
    return block_NR if block_NR.stride(1) == 1 else block_NR.contiguous()


def block_stats_(block_NR: torch.Tensor, labels_N: torch.Tensor, offset: int, top_N: torch.Tensor,
                 sum_exp_N: torch.Tensor, target_N: torch.Tensor) -> None:
    """Fold one block of logits ``block_NR`` (columns = vocabulary ids ``offset ... offset + R - 1``) into the
    per-token running maximum ``top_N``, sum of exp(logit - top) ``sum_exp_N`` and target logit ``target_N``
    (contiguous fp32 [N], in place; the target grows by the label's logit where the label lies in this block)."""
    block = _rows_ready(block_NR)
    n, cols = block.shape
    if n and cols:
        _stats_kernel[(n,)](block, labels_N.contiguous(), top_N, sum_exp_N, target_N, cols, block.stride(0), offset,
                            BLOCK=FWD_BLOCK, num_warps=8)


def block_grad(block_NR: torch.Tensor, lse_N: torch.Tensor, labels_N: torch.Tensor, offset: int,
               grad_N: torch.Tensor) -> torch.Tensor:
    """The logit gradient ``(exp(logit - lse) - onehot(label)) · grad`` of one block, in the block's dtype,
    written over ``block_NR`` (which it returns); ``lse_N``, ``grad_N``: fp32 [N]."""
    block = _rows_ready(block_NR)
    n, cols = block.shape
    if n and cols:
        grid = (n, triton.cdiv(cols, BWD_BLOCK))
        _grad_kernel[grid](block, lse_N.contiguous(), labels_N.contiguous(), grad_N.contiguous(), cols, block.stride(0), offset, BLOCK=BWD_BLOCK,
                           num_warps=4)
    return block


_CHECKED: dict[tuple, bool] = {}


def _check_against_torch(dtype: torch.dtype, device: str) -> None:
    """Raise if the kernels differ from the torch path (beyond summation order, or one rounding of ``dtype``
    for the gradient) on random data: 37 tokens, three blocks of 3000, 1 and 2500 vocabulary rows (several
    forward steps with a partial last one, a one-column block, partial backward tiles); labels in every
    block and beyond them."""
    gen = torch.Generator(device=device).manual_seed(0)
    widths = (3000, 1, 2500)
    labels = torch.randint(0, sum(widths) + 50, (37,), device=device, generator=gen)
    labels[:3] = torch.tensor([0, 3000, 5500], device=device)  # the first column of each block
    states = [[torch.full((37,), float("-inf"), device=device), torch.zeros(37, device=device),
               torch.zeros(37, device=device)] for _ in range(2)]
    offset, blocks = 0, []
    for width in widths:
        block = (3 * torch.randn(37, width, device=device, generator=gen)).to(dtype)
        block_stats_(block.clone(), labels, offset, *states[0])
        torch_block_stats_(block.clone(), labels, offset, *states[1])
        blocks.append((block, offset))
        offset += width
    tol = {"rtol": 1e-5, "atol": 1e-5}
    for got, want in zip(*states):
        torch.testing.assert_close(got, want, **tol)
    lse = states[1][0] + torch.log(states[1][1])
    grad = torch.rand(37, device=device, generator=gen) + 0.5
    tol = tol if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for block, offset in blocks:
        got = block_grad(block.clone(), lse, labels, offset, grad)
        want = torch_block_grad(block.clone(), lse, labels, offset, grad)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), **tol)


def checked(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernels compile and match the torch path for this dtype (checked once)."""
    return checked_once(_CHECKED, (dtype, str(device)), _check_against_torch, "fused cross-entropy")


def use_kernels(t: torch.Tensor) -> bool:
    """Whether the loss runs its blocks through the kernels for tensors like ``t`` (else the torch path)."""
    return available(t) and checked(t.dtype, t.device)
