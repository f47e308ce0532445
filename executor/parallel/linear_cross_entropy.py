"""Output layer and cross-entropy fused and blocked over the vocabulary: no [tokens × vocab] fp32 copy.

:func:`linear_cross_entropy` takes the TP-gathered hidden states [N, h] and this rank's rows of the output
weight [V/tp, h] and returns the per-token loss [N] (fp32, identical on every TP rank). It never holds the
logits of all of this rank's vocabulary at once: it walks the rank's vocabulary rows in blocks of
``block_rows`` (chosen so ``N · block_rows`` <= ``chunk_logits``) and keeps, per token, a running maximum,
a running sum of exponentials (rescaled when the maximum grows) and the target logit.

- Forward, per block: logits in the compute dtype (one GEMM, as the unfused output layer), an fp32 copy of
  that block only, its row maximum and sum of exponentials folded into the running ones. At the end, over
  TP: one MAX all-reduce and one SUM all-reduce of [sum of exponentials, target logit] (two [N] vectors).
  Saved for backward: the hidden states, the weight (both already alive), the labels and the per-token
  log-sum-exp [N] — no [N, V] tensor.
- Backward, per block: the block's logits again (the recomputation costs one more output-layer GEMM), its
  softmax from the saved log-sum-exp, minus one at the target, times the incoming gradient, cast to the
  compute dtype (as autograd casts the unfused path's fp32 logit gradient); then the weight gradient of
  those rows in one GEMM over all N tokens, written in place (the same GEMM and rounding as the unfused
  path, no accumulation across blocks), and the block's share of the input gradient added into an fp32
  accumulator [N, h] (cast to the compute dtype at the end). No collective: the input gradient is this
  rank's part, which the sequence-parallel all-gather's backward (a reduce-scatter) sums over TP.

Padded vocabulary rows (beyond ``vocab_size``) are never multiplied: they take no part in the softmax and
get a zero weight gradient, as in the unfused path.

Peak memory beyond inputs, outputs and gradients: one block's logits in the compute dtype plus its fp32
copy (``chunk_logits`` · (2 + 4) bytes in bf16), the fp32 input-gradient accumulator (N · h · 4 bytes) and
a handful of [N] vectors. The output layer GEMM stays in the compute dtype under every kernel backend:
Megatron keeps its output layer (a plain ColumnParallelLinear, outside Transformer Engine's fp8 autocast)
in bf16 under fp8.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

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


def _target_in_block(labels_N: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens whose label is a row in [lo, hi), that label's column within the block; 0 elsewhere)."""
    mine = (labels_N >= lo) & (labels_N < hi)
    return mine, torch.where(mine, labels_N - lo, 0)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, labels_N, vocab_size, padded_vocab, state, chunk_logits):
        n = hidden_NH.shape[0]
        start, rows = _local_rows(vocab_size, padded_vocab, state)
        step = block_rows(n, rows, chunk_logits)
        top = torch.full((n,), float("-inf"), device=hidden_NH.device)
        sum_exp = torch.zeros(n, device=hidden_NH.device)
        target = torch.zeros(n, device=hidden_NH.device)
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            block = torch.mm(hidden_NH, weight_VH[lo:hi].t()).float()
            mine, column = _target_in_block(labels_N, start + lo, start + hi)
            target += block.gather(1, column.unsqueeze(1)).squeeze(1) * mine
            new_top = torch.maximum(top, block.amax(dim=1))
            # the running sum was taken relative to the old maximum; exp(-inf) = 0 before the first block
            sum_exp.mul_(torch.exp(top - new_top)).add_(block.sub_(new_top.unsqueeze(1)).exp_().sum(dim=1))
            top = new_top
            del block
        # over TP: the global maximum, then every rank's sum rescaled to it and the target logit (one rank's)
        global_top = all_reduce_(top.clone(), state.tp, op=dist.ReduceOp.MAX)
        sums = torch.stack([sum_exp * torch.exp(top - global_top), target])
        sum_exp, target = all_reduce_(sums, state.tp).unbind(0)
        loss = torch.log(sum_exp) - (target - global_top)
        ctx.save_for_backward(hidden_NH, weight_VH, labels_N, global_top + torch.log(sum_exp))
        ctx.args = (start, rows, step)
        return loss

    @staticmethod
    def backward(ctx, grad_N):
        hidden_NH, weight_VH, labels_N, lse = ctx.saved_tensors
        start, rows, step = ctx.args
        want_input, want_weight = ctx.needs_input_grad[:2]
        grad_N = grad_N.float().unsqueeze(1)
        lse = lse.unsqueeze(1)
        grad_weight = torch.zeros_like(weight_VH) if want_weight else None  # padded rows stay zero
        # fp32 accumulation of the input gradient over blocks (in place when the compute dtype is fp32)
        grad_input = torch.zeros(hidden_NH.shape, device=hidden_NH.device) if want_input else None
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            weight = weight_VH[lo:hi]
            probs = torch.mm(hidden_NH, weight.t()).float().sub_(lse).exp_()
            mine, column = _target_in_block(labels_N, start + lo, start + hi)
            probs.scatter_add_(1, column.unsqueeze(1), -mine.float().unsqueeze(1))
            grad_logits = probs.mul_(grad_N).to(hidden_NH.dtype)
            del probs
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
        return grad_input, grad_weight, None, None, None, None, None


def linear_cross_entropy(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, labels_N: torch.Tensor,
                         vocab_size: int, padded_vocab: int, state: ParallelState,
                         chunk_logits: int) -> torch.Tensor:
    """Per-token cross-entropy [N] (fp32, nats) of the vocabulary-parallel output layer ``hidden @ weight.T``.

    ``hidden_NH``: [N, h] tokens (all of this TP group's tokens, i.e. after the sequence-parallel gather);
    ``weight_VH``: this rank's [padded_vocab/tp, h] rows; ``labels_N``: [N] vocabulary ids < ``vocab_size``;
    ``chunk_logits``: the most logits (tokens × vocabulary rows) held at once (> 0; the executor passes
    ``ExecutorOptions.cross_entropy_chunk_logits``). Gradients flow to
    ``hidden_NH`` (this rank's part) and ``weight_VH`` (its rows; padded rows zero).
    """
    if chunk_logits <= 0:
        raise ValueError(f"chunk_logits must be > 0, got {chunk_logits}")
    return _LinearCrossEntropy.apply(hidden_NH, weight_VH, labels_N, vocab_size, padded_vocab, state,
                                     chunk_logits)
