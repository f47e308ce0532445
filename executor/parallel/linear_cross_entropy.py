"""Output layer and cross-entropy fused: no [tokens × vocab] fp32 copy, the 16-bit logits kept or blocked.

:func:`linear_cross_entropy` takes the TP-gathered hidden states [N, h] and this rank's rows of the output
weight [V/tp, h] and returns the per-token loss [N] (fp32, identical on every TP rank). Where this rank's
16-bit logits [N, real rows] take at most ``keep_bytes``, it computes them in one GEMM, folds them into the
per-token statistics below in one pass and keeps them for the backward, which writes their gradient over
them and runs one input-gradient and one weight-gradient GEMM over all of them. Otherwise it never holds the
logits of all of this rank's vocabulary at once: it walks the rank's vocabulary rows in blocks of
``block_rows`` (chosen so ``N · block_rows`` <= ``chunk_logits``) and keeps, per token, a running maximum,
a running sum of exponentials (rescaled when the maximum grows) and the target logit; that blocked path is
what the rest of this docstring describes.

- Forward, per block: logits in the compute dtype (one GEMM, as the unfused output layer), folded into the
  running maximum, sum of exponentials and target logit by
  :func:`executor.kernels.triton_cross_entropy.block_stats_` (one Triton pass over the 16-bit logits on
  CUDA; elsewhere, or where its first-use check fails, the torch ops on an fp32 copy of the block). At the
  end, over TP: one MAX all-reduce and one SUM all-reduce of [sum of exponentials, target logit] (two [N]
  vectors). Saved for backward: the hidden states, the weight (both already alive), the labels and the
  per-token log-sum-exp [N] — no [N, V] tensor.
- Backward, per block: the block's logits again (the recomputation costs one more output-layer GEMM), then
  ``(softmax from the saved log-sum-exp - onehot(label)) · incoming gradient`` in the compute dtype
  (:func:`executor.kernels.triton_cross_entropy.block_grad`: written over the recomputed logits by the
  kernel; the torch path goes through fp32 and casts, as autograd casts the unfused path's fp32 logit
  gradient); then the weight gradient of those rows in one GEMM over all N tokens, written in place (the
  same GEMM and rounding as the unfused path, no accumulation across blocks), and the block's share of the
  input gradient added into an fp32 accumulator [N, h] (cast to the compute dtype at the end). No collective: the input gradient is this
  rank's part, which the sequence-parallel all-gather's backward (a reduce-scatter) sums over TP.

Padded vocabulary rows (beyond ``vocab_size``) are never multiplied: they take no part in the softmax and
get a zero weight gradient, as in the unfused path.

Peak memory beyond inputs, outputs and gradients: one block's logits in the compute dtype plus, on the
torch path, its fp32 copy (``chunk_logits`` · (2 + 4) bytes in bf16; the kernels keep only the 2), the
fp32 input-gradient accumulator (N · h · 4 bytes) and a handful of [N] vectors. The output layer GEMM stays in the compute dtype under every kernel backend:
Megatron keeps its output layer (a plain ColumnParallelLinear, outside Transformer Engine's fp8 autocast)
in bf16 under fp8.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from executor.kernels import triton_cross_entropy as ce_kernels
from executor.parallel.collectives import all_reduce_
from executor.parallel.groups import ParallelState


def block_rows(tokens: int, vocab_rows: int, chunk_logits: int) -> int:
    """Vocabulary rows per block so a block holds at most ``chunk_logits`` logits (at least one row)."""
    return max(1, min(vocab_rows, chunk_logits // max(1, tokens)))


def _local_rows(vocab_size: int, padded_vocab: int, state: ParallelState) -> tuple[int, int]:
    """(first vocabulary id of this TP rank, its real rows: padded rows excluded, possibly 0)."""
    per_rank = padded_vocab // state.tp.size
    start = state.tp.rank * per_rank
    return start, max(0, min(per_rank, vocab_size - start))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, labels_N, vocab_size, padded_vocab, state, chunk_logits, keep_bytes):
        n = hidden_NH.shape[0]
        start, rows = _local_rows(vocab_size, padded_vocab, state)
        step = block_rows(n, rows, chunk_logits)
        top = torch.full((n,), float("-inf"), device=hidden_NH.device)
        sum_exp = torch.zeros(n, device=hidden_NH.device)
        target = torch.zeros(n, device=hidden_NH.device)
        fused = ce_kernels.use_kernels(hidden_NH)
        block_stats_ = ce_kernels.block_stats_ if fused else ce_kernels.torch_block_stats_
        kept = None
        if keeps_logits(n, rows, hidden_NH.element_size(), keep_bytes):
            kept = torch.mm(hidden_NH, weight_VH[:rows].t())  # [N, rows]: one GEMM, kept for the backward
            if fused:
                block_stats_(kept, labels_N, start, top, sum_exp, target)
            else:  # the torch path consumes its block (in place when fp32): one block's copy at a time
                for lo in range(0, rows, step):
                    block_stats_(kept[:, lo:min(rows, lo + step)].clone(), labels_N, start + lo, top, sum_exp, target)
        else:
            for lo in range(0, rows, step):
                hi = min(rows, lo + step)
                block_stats_(torch.mm(hidden_NH, weight_VH[lo:hi].t()), labels_N, start + lo, top, sum_exp, target)
        # over TP: the global maximum, then every rank's sum rescaled to it and the target logit (one rank's)
        global_top = all_reduce_(top.clone(), state.tp, op=dist.ReduceOp.MAX)
        sums = torch.stack([sum_exp * torch.exp(top - global_top), target])
        sum_exp, target = all_reduce_(sums, state.tp).unbind(0)
        loss = torch.log(sum_exp) - (target - global_top)
        lse = global_top + torch.log(sum_exp)
        if kept is None:
            ctx.save_for_backward(hidden_NH, weight_VH, labels_N, lse)
        else:
            ctx.save_for_backward(hidden_NH, weight_VH, labels_N, lse, kept)
        ctx.args = (start, rows, step, fused)
        return loss

    @staticmethod
    def backward(ctx, grad_N):
        hidden_NH, weight_VH, labels_N, lse, *kept = ctx.saved_tensors
        start, rows, step, fused = ctx.args
        block_grad = ce_kernels.block_grad if fused else ce_kernels.torch_block_grad
        want_input, want_weight = ctx.needs_input_grad[:2]
        grad_N = grad_N.float().contiguous()
        grad_weight = torch.zeros_like(weight_VH) if want_weight else None  # padded rows stay zero
        if kept:
            # the logits kept from the forward become their gradient in place; then two whole GEMMs
            grad_logits = kept[0]
            if fused:
                block_grad(grad_logits, lse, labels_N, start, grad_N)
            else:
                for lo in range(0, rows, step):
                    block = grad_logits[:, lo:min(rows, lo + step)]
                    block.copy_(block_grad(block, lse, labels_N, start + lo, grad_N))
            if want_weight:
                torch.mm(grad_logits.t(), hidden_NH, out=grad_weight[:rows])
            grad_input = torch.mm(grad_logits, weight_VH[:rows]) if want_input else None
            return grad_input, grad_weight, None, None, None, None, None, None
        # fp32 accumulation of the input gradient over blocks (in place when the compute dtype is fp32)
        grad_input = torch.zeros(hidden_NH.shape, device=hidden_NH.device) if want_input else None
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            weight = weight_VH[lo:hi]
            grad_logits = block_grad(torch.mm(hidden_NH, weight.t()), lse, labels_N, start + lo, grad_N)
            if want_weight:
                torch.mm(grad_logits.t(), hidden_NH, out=grad_weight[lo:hi])
            if want_input:
                if grad_logits.dtype == torch.float32:
                    grad_input.addmm_(grad_logits, weight)
                else:
                    grad_input += torch.mm(grad_logits, weight)
            del grad_logits
        if grad_input is not None:
            grad_input = grad_input.to(hidden_NH.dtype)
        return grad_input, grad_weight, None, None, None, None, None, None


def keeps_logits(tokens: int, rows: int, element_bytes: int, keep_bytes: int) -> bool:
    """Whether the loss keeps its whole logits [tokens, rows] from forward to backward (``tokens · rows ·
    element_bytes <= keep_bytes``) instead of computing each block's again in backward."""
    return keep_bytes > 0 and tokens * rows * element_bytes <= keep_bytes


def linear_cross_entropy(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, labels_N: torch.Tensor,
                         vocab_size: int, padded_vocab: int, state: ParallelState,
                         chunk_logits: int, keep_bytes: int = 0) -> torch.Tensor:
    """Per-token cross-entropy [N] (fp32, nats) of the vocabulary-parallel output layer ``hidden @ weight.T``.

    ``hidden_NH``: [N, h] tokens (all of this TP group's tokens, i.e. after the sequence-parallel gather);
    ``weight_VH``: this rank's [padded_vocab/tp, h] rows; ``labels_N``: [N] vocabulary ids < ``vocab_size``;
    ``chunk_logits``: the most logits (tokens × vocabulary rows) held at once (> 0; the executor passes
    ``ExecutorOptions.cross_entropy_chunk_logits``); ``keep_bytes``: where the whole logits take at most this many
    bytes they are computed in one GEMM and kept for the backward (``ExecutorOptions.cross_entropy_keep_logits``;
    0: never, every block is computed again in backward). Gradients flow to
    ``hidden_NH`` (this rank's part) and ``weight_VH`` (its rows; padded rows zero).
    """
    if chunk_logits <= 0:
        raise ValueError(f"chunk_logits must be > 0, got {chunk_logits}")
    if keep_bytes < 0:
        raise ValueError(f"keep_bytes must be >= 0, got {keep_bytes}")
    return _LinearCrossEntropy.apply(hidden_NH, weight_VH, labels_N, vocab_size, padded_vocab, state,
                                     chunk_logits, keep_bytes)
