"""Vocabulary-parallel embedding, LM head and cross-entropy (each TP rank owns vocab/tp rows).

Padded vocabulary rows (Megatron pads to a multiple of make_vocab_size_divisible_by·tp) are excluded
from the softmax, so the loss does not depend on tp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from executor.parallel.collectives import all_reduce, all_reduce_, reduce_scatter
from executor.parallel.groups import ParallelState
from executor.parallel.linear_cross_entropy import linear_cross_entropy


def vocab_range(padded_vocab: int, state: ParallelState) -> tuple[int, int]:
    per_rank = padded_vocab // state.tp.size
    return state.tp.rank * per_rank, (state.tp.rank + 1) * per_rank


def embed(ids_SB: torch.Tensor, weight_VH: torch.Tensor, padded_vocab: int, state: ParallelState) -> torch.Tensor:
    """Embeddings of the full-sequence ids, returned as this rank's sequence slice [s/tp, b, h]."""
    start, end = vocab_range(padded_vocab, state)
    if state.tp.size == 1:
        return F.embedding(ids_SB, weight_VH)
    mine = (ids_SB >= start) & (ids_SB < end)
    out = F.embedding(torch.where(mine, ids_SB - start, 0), weight_VH) * mine.unsqueeze(-1).to(weight_VH.dtype)
    return reduce_scatter(out, state.tp)


def cross_entropy(logits_SBV: torch.Tensor, labels_SB: torch.Tensor, vocab_size: int, padded_vocab: int,
                  state: ParallelState) -> torch.Tensor:
    """Per-token cross-entropy [s, b] over vocabulary-sharded logits (fp32, identical on every TP rank)."""
    start, end = vocab_range(padded_vocab, state)
    logits = logits_SBV.float()
    if end > vocab_size:
        pad = torch.arange(start, end, device=logits.device) >= vocab_size
        logits = logits.masked_fill(pad, float("-inf"))
    with torch.no_grad():
        top = all_reduce_(logits.max(dim=-1).values, state.tp, op=torch.distributed.ReduceOp.MAX)
    shifted = logits - top.unsqueeze(-1)
    sum_exp = all_reduce(shifted.exp().sum(-1), state.tp)
    mine = (labels_SB >= start) & (labels_SB < end)
    local = torch.where(mine, labels_SB - start, 0)
    # where, not a product with the mask: a rank holding only padded rows gathers -inf, and -inf·0 is nan
    target = torch.where(mine, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
    target = all_reduce(target, state.tp)
    return torch.log(sum_exp) - target


def output_cross_entropy(hidden_SBH: torch.Tensor, weight_VH: torch.Tensor, labels_SB: torch.Tensor, vocab_size: int,
                         padded_vocab: int, state: ParallelState, chunk_logits: int,
                         keep_bytes: int = 0) -> torch.Tensor:
    """Per-token cross-entropy [s, b] (fp32) of the output layer ``hidden @ weight.T`` over gathered tokens.

    ``chunk_logits`` > 0: :func:`executor.parallel.linear_cross_entropy.linear_cross_entropy`, at most that many
    logits at once, or the whole logits kept for the backward where they take at most ``keep_bytes``; 0: the
    unfused path (full [s, b, V/tp] logits, then :func:`cross_entropy`'s fp32 copies),
    kept so benchmarks and the cost model can compare both.
    """
    if chunk_logits == 0:
        return cross_entropy(F.linear(hidden_SBH, weight_VH), labels_SB, vocab_size, padded_vocab, state)
    s, b, h = hidden_SBH.shape
    loss = linear_cross_entropy(hidden_SBH.reshape(s * b, h), weight_VH, labels_SB.reshape(s * b), vocab_size,
                                padded_vocab, state, chunk_logits, keep_bytes)
    return loss.view(s, b)
