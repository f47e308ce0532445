"""The output layer + cross-entropy of one micro-batch: the executor's fused, vocabulary-blocked loss and
Megatron's whole-logits loss (``TrainingSpec.megatron_cross_entropy``), in bytes held and bytes moved.

The executor (``executor/parallel/linear_cross_entropy.py``) walks this rank's vocabulary rows in blocks of
at most :data:`CROSS_ENTROPY_CHUNK_LOGITS` logits: forward, per block, the output GEMM in the compute dtype,
the running maximum and sum of exponentials (one Triton pass on GPUs; the torch path on CPU, through an fp32
copy); it saves only a per-token log-sum-exp. Backward, per block, the block's logits again (one more
output-layer GEMM), its softmax gradient in the compute dtype (one Triton pass, or fp32 torch ops and a cast),
then the weight-gradient GEMM of those rows and the block's share of the input gradient added into an fp32
accumulator. Where a micro-batch's whole logits take at most :data:`CROSS_ENTROPY_KEEP_LOGITS` bytes, it
computes them in one GEMM instead and keeps them for the backward, which turns them into their gradient in
place and runs the weight- and input-gradient GEMMs once over them: no second output GEMM, no fp32
accumulator, the logits held from forward to backward. Megatron keeps the whole logits' fp32 softmax of every output head from forward to
backward. Memory and time models both read this module, so the two behaviours stay described in one place.
"""

from __future__ import annotations

from typing import NamedTuple

from spec.head_features import output_heads
from spec.model_spec import ModelSpec
from spec.training_spec import TrainingSpec

#: Logits the executor's fused output layer + loss holds at once: the default of
#: ``ExecutorOptions.cross_entropy_chunk_logits`` (tests/costmodel/test_loss_terms.py keeps them equal).
CROSS_ENTROPY_CHUNK_LOGITS = 2**26
#: Bytes of logits the executor's loss keeps whole from forward to backward: the default of
#: ``ExecutorOptions.cross_entropy_keep_logits`` (tests/costmodel/test_loss_terms.py keeps them equal).
CROSS_ENTROPY_KEEP_LOGITS = 2**34
#: fp32 tensors per logit Megatron's loss keeps from forward to backward, per output head: the softmax
#: (``vocab_parallel_cross_entropy`` and its fused kernel both turn their fp32 copy into it in place).
MEGATRON_LOSS_FP32_COPIES = 1
_FP32 = 4

# HBM bytes per logit of the executor's blocked loss, its element-wise work only (the GEMMs are priced as
# GEMMs), on a GPU: the Triton kernels of executor/kernels/triton_cross_entropy.py. Forward reads each logit
# once (running max, rescaled sum of exp and target logit in registers); backward reads the recomputed logit
# and writes its gradient over it. In logit-sized passes: 1 forward, 2 backward (times the logit's bytes).
KERNEL_LOSS_LOGIT_PASSES_FWD = 1
KERNEL_LOSS_LOGIT_PASSES_BWD = 2
# The torch path (where the kernels do not run: CPU, no Triton, FOLDTUNE_FUSED_CROSS_ENTROPY=0, or a failed
# first-use check), 16-bit logits. Forward: cast to fp32 (read 2, write 4), row max (read 4), subtract and
# exp in place (2 x read 4 + write 4), row sum (read 4).
TORCH_LOSS_BYTES_PER_LOGIT_FWD = 6 + 4 + 16 + 4
# Backward: the recomputed block's cast (6), subtract the log-sum-exp and exp in place (16), times the incoming
# gradient in place (8), cast of the logit gradient to 16 bits (read 4, write 2).
TORCH_LOSS_BYTES_PER_LOGIT_BWD = 6 + 16 + 8 + 6
# Per token and hidden element, per block: the block's input gradient (16-bit, write 2) added into the fp32
# accumulator (read 2 + 4, write 4).
BLOCKED_LOSS_ACCUM_BYTES = 2 + 2 + 4 + 4


def blocked_loss_bytes_per_logit(activation_bytes: int, kernels: bool) -> tuple[float, float]:
    """(forward, backward) HBM bytes per logit of the blocked loss's element-wise work, logits of
    ``activation_bytes`` bytes: the Triton kernels' (``kernels``; 2 and 4 in bf16, 4 and 8 in fp32) or the torch
    path's (30 and 36, its casts and fp32 passes; fp32 logits are priced the same, an fp32 copy replacing the
    cast)."""
    if kernels:
        return (float(KERNEL_LOSS_LOGIT_PASSES_FWD * activation_bytes),
                float(KERNEL_LOSS_LOGIT_PASSES_BWD * activation_bytes))
    return float(TORCH_LOSS_BYTES_PER_LOGIT_FWD), float(TORCH_LOSS_BYTES_PER_LOGIT_BWD)


def loss_kernels_run(gpu_name: str) -> bool:
    """Whether the executor's loss runs on its Triton kernels on ``gpu_name`` (CUDA GPUs: yes; 'cpu': no)."""
    return gpu_name.lower() != "cpu"


def vocab_rows(model: ModelSpec, tp: int) -> int:
    """Vocabulary rows the executor's loss multiplies on TP rank 0 (padded rows are never multiplied)."""
    return min(model.padded_vocab_size(tp) // tp, model.vocab_size)


def keeps_logits(tokens: float, rows: int, activation_bytes: int, keep_bytes: int | None = None) -> bool:
    """Whether the executor's loss keeps the whole logits of ``tokens`` tokens and ``rows`` vocabulary rows
    (``executor.parallel.linear_cross_entropy.keeps_logits``: ``tokens · rows · activation_bytes <= keep_bytes``,
    by default :data:`CROSS_ENTROPY_KEEP_LOGITS`)."""
    keep = CROSS_ENTROPY_KEEP_LOGITS if keep_bytes is None else keep_bytes
    return keep > 0 and tokens * rows * activation_bytes <= keep


def block_logits(tokens: int, rows: int, chunk_logits: int = CROSS_ENTROPY_CHUNK_LOGITS) -> int:
    """Logits of one block of the fused loss over ``tokens`` tokens and ``rows`` vocabulary rows: ``tokens`` ×
    ``max(1, min(rows, chunk_logits // tokens))`` rows (``executor.parallel.linear_cross_entropy.block_rows``)."""
    return tokens * max(1, min(rows, chunk_logits // max(1, tokens)))


def num_blocks(tokens: int, rows: int, chunk_logits: int = CROSS_ENTROPY_CHUNK_LOGITS) -> int:
    """Blocks the fused loss walks over ``rows`` vocabulary rows (ceil of rows / rows per block)."""
    per_block = block_logits(tokens, rows, chunk_logits) // max(1, tokens)
    return -(-rows // per_block)


class FusedLoss(NamedTuple):
    """What the executor's fused loss holds beside its per-token bytes, as a function of the micro-batch's
    tokens (:func:`loss_fixed_bytes`): whether it keeps the whole logits depends on their size."""

    per_block_logit: float  # bytes per logit of one block at the backward's peak (16-bit + its fp32 copy)
    rows: int  # vocabulary rows multiplied (padded rows never are)
    weight_grad: float  # the output weight's 16-bit gradient
    accumulator_per_token: float  # the blocked backward's fp32 input-gradient accumulator (4·h)
    heads: int  # output heads (main + MTP), each keeping its own logits
    activation_bytes: int  # bytes of one logit (the compute dtype)


class LossBytes(NamedTuple):
    """The executor's fused loss over one micro-batch's tokens beyond its per-token part, bytes."""

    block: float  # one block's logits (and, on the torch path, their fp32 copy)
    held: float  # every head's kept logits (``kept``), else the blocked backward's fp32 accumulator
    weight_grad: float
    kept: bool


def loss_memory_terms(model: ModelSpec, training: TrainingSpec, tp: int) -> tuple[float, FusedLoss | None]:
    """Bytes the output layer + loss of one micro-batch holds on the last stage at its peak:
    (bytes per token, the executor's loss's token-dependent part or None).

    Megatron (``training.megatron_cross_entropy``): the whole logits ``V/tp`` per token in the compute dtype
    ``b`` and one fp32 softmax per output head (main + MTP heads, each kept until its backward):
    ``V/tp · (4·(1 + MTP) + b)`` per token; no other part. With Transformer Engine's fused loss
    (``training.cross_entropy_fusion_impl == "te"``: ``parallel_cross_entropy``, whose Triton kernel works in
    registers, saves its 16-bit input and writes the logits' gradient over it in backward) each head keeps its
    16-bit logits and no fp32 copy: ``V/tp · b · (1 + MTP)``.

    The executor's loss: per token each head's saved fp32 log-sum-exp (``4·(1 + MTP)``); then, by the logits'
    size (:func:`loss_fixed_bytes`), either the blocked backward's fp32 input-gradient accumulator (``4·h`` a
    token) or every head's kept logits (``b`` a logit each, held from forward to backward; the 1F1B last stage
    runs a micro-batch's backward before the next forward, so one micro-batch's); beside them, at the
    backward's peak, one block of logits in the compute dtype with its fp32 softmax (``b + 4`` bytes per block
    logit; ``4`` in fp32, where the copy is the GEMM's output itself) and the output weight's 16-bit gradient
    (``V/tp · h · w`` bytes) before it is added into the main gradient. That is the torch path's block; on a
    GPU the Triton kernels keep no fp32 copy, so there it is an upper bound by 4 bytes per block logit (the
    kernels' own peak is not measured). The heads run one after another: one block is live at a time.
    """
    b, h, heads = training.activation_bytes, model.hidden_size, output_heads(model)
    padded = model.padded_vocab_size(tp) // tp
    if training.megatron_cross_entropy:
        if training.cross_entropy_fusion_impl == "te":
            return float(padded * b * heads), None
        return float(padded * (_FP32 * MEGATRON_LOSS_FP32_COPIES * heads + b)), None
    per_logit = float(_FP32 if b == _FP32 else b + _FP32)
    weight_grad = float(padded * h * training.param_bytes)
    return float(_FP32 * heads), FusedLoss(per_logit, vocab_rows(model, tp), weight_grad, float(_FP32 * h), heads, b)


def loss_fixed_bytes(fixed: FusedLoss | None, tokens: float) -> LossBytes:
    """The executor's fused loss over ``tokens`` tokens beyond its per-token part (:class:`LossBytes`); zeros
    for None (Megatron's loss, all per token)."""
    if fixed is None:
        return LossBytes(0.0, 0.0, 0.0, False)
    block = fixed.per_block_logit * block_logits(int(tokens), fixed.rows)
    if keeps_logits(tokens, fixed.rows, fixed.activation_bytes):
        return LossBytes(block, fixed.heads * fixed.activation_bytes * tokens * fixed.rows, fixed.weight_grad, True)
    return LossBytes(block, fixed.accumulator_per_token * tokens, fixed.weight_grad, False)
