"""Model FLOPs per step with Megatron-LM's ``num_floating_point_operations`` conventions.

Counted per token: every GEMM three times (forward, dgrad, wgrad), two FLOPs per multiply-add, the
causal attention core at half of the full score matrix, routed experts at top-k, shared experts and
dense-first layers separately, head blocks (MTP: ``spec.head_features``) as extra decoder layers of the last
layer's kind plus their own work (MTP: norms and projection), and the logit GEMM once per output head (1 + MTP
depth) over the vocabulary padded as Megatron pads it.
Recomputation is not counted (these are *model* FLOPs, which MFU is defined against). As in Megatron, every
layer's attention core counts ``seq/2`` keys per query (``seq²/2`` query-key pairs per sequence) whether or not
it has a sliding window, gated MLPs (SwiGLU or GPT-OSS's quick-GeGLU) count three GEMMs, and biases, norms,
sinks and activations count nothing.

Packed sequences (``TrainingSpec.document_lengths``) attend within documents: ``Σ_docs len²/2`` pairs per
sequence instead of ``seq²/2``, the share :func:`spec.documents.attention_share` of the work, which
``attention_share`` scales the core by: the same share the cost model prices the attention kernels at
(``costmodel.step_time``).
"""

from __future__ import annotations

from spec.attention_kinds import attention_kind
from spec.head_features import head_blocks, head_features, output_heads
from spec.model_spec import ModelSpec

# 3 GEMM passes (fwd, dgrad, wgrad) x 2 FLOPs per multiply-add x 2 GEMMs per block (up and down)
_EXPANSION = 3 * 2 * 2


def flops_per_token(model: ModelSpec, seq_length: int, attention_share: float = 1.0) -> float:
    """Model FLOPs (forward + backward) per trained token at ``seq_length``; ``attention_share``: the causal
    attention core's work as a share of ``seq²/2`` pairs per sequence (packed documents, module docstring)."""
    h = model.hidden_size
    pattern = model.moe_layer_pattern()
    num_moe = sum(pattern)
    num_dense = model.num_layers - num_moe
    blocks = head_blocks(model)  # each holds a decoder layer of the last layer's kind
    if blocks:
        last_is_moe = pattern[-1]
        num_moe += last_is_moe * blocks
        num_dense += (1 - last_is_moe) * blocks
    num_layers = model.num_layers + blocks
    gated = 3 / 2 if model.gated_linear_unit else 1
    routed = model.moe_router_topk if model.is_moe else 0
    mlp = (
        _EXPANSION * num_layers * h
        * (model.ffn_hidden_size * gated * (num_dense / num_layers)
           + model.expert_ffn_hidden_size * routed * gated * (num_moe / num_layers)
           + model.shared_expert_ffn_hidden_size * gated * (num_moe / num_layers))
    )
    own = sum(feature.own_flops(model) * depth for feature, depth in head_features(model))
    logits = 3 * 2 * h * model.padded_vocab_size() * output_heads(model)
    # every attention kind's count is its projections plus a core linear in the keys per query (seq/2): the
    # core of Σ len²/2 pairs per sequence is the one of seq · share keys
    attention = attention_kind(model).flops(model, seq_length * attention_share, num_layers)
    return mlp + attention + own + logits


def flops_per_step(model: ModelSpec, seq_length: int, global_batch_size: int, attention_share: float = 1.0) -> float:
    """Model FLOPs of one optimizer step: ``global_batch_size`` sequences of ``seq_length`` tokens, their causal
    attention at ``attention_share`` of ``seq²/2`` pairs each (``TrainingSpec.document_attention_share``)."""
    return global_batch_size * seq_length * flops_per_token(model, seq_length, attention_share)


def tflops_per_gpu(flops: float, seconds: float, num_gpus: int) -> float:
    """Achieved model TFLOP/s per GPU for ``flops`` done by ``num_gpus`` GPUs in ``seconds``."""
    return flops / seconds / num_gpus / 1e12


def mfu(flops: float, seconds: float, num_gpus: int, peak_flops_per_gpu: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s per GPU over the GPU's dense peak (0..1)."""
    return flops / seconds / num_gpus / peak_flops_per_gpu


# Flash attention's backward recomputes the score matrix: 5 matmuls against the forward's 2.
ATTENTION_BWD_FLOP_RATIO = 2.5


def attention_fwd_flops(batch_queries: float, seq_kv: float, heads: float, qk_dim: int, v_dim: int,
                        causal: bool = True) -> float:
    """Forward FLOPs of the attention core: ``2·q·kv·heads·(qk + v)``, halved by a causal mask (the
    convention of :func:`costmodel.compute.attention_time` and of the attention microbenchmark that calibrates it)."""
    return 2.0 * batch_queries * seq_kv * heads * (qk_dim + v_dim) * (0.5 if causal else 1.0)
