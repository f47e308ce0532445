"""What each attention kind costs: its parameters, stored activations, collectives and step time.

One :class:`AttentionPricing` per kind of ``spec.attention_kinds``, registered under the kind's name in
:data:`PRICING`; :func:`attention_pricing` returns the model's. The cost model's modules ask it for the
kind-specific part of an attention layer and price the rest (the input norm, the output bias, the core's
log-sum-exp, the residual) themselves: :mod:`costmodel.params` (parameter counts), :mod:`costmodel.memory`
(parameter tensors, activations, gradients, the CP ring), :mod:`costmodel.collective_inventory` (the TP
gather, the CP K/V exchange) and :mod:`costmodel.step_time` (the layer's GEMMs, element-wise passes and core).
``tests/test_feature_registry.py`` checks that every spec-level kind has an entry here.

Sizes are elements per token (or per parameter tensor) unless a name says bytes; ``tp`` is the tensor-parallel
size the heads are split by.
"""

from __future__ import annotations

from typing import Any

from costmodel.attention_kinds import has_sinks, fused_causal_fraction, masked_layer_share
from costmodel.compute import sink_attention_time
from costmodel.per_model import norm_params
from spec.attention_kinds import GQA, MLA, attention_kind
from spec.errors import InvalidConfigError
from spec.model_spec import ModelSpec
from spec.norm_scopes import qk_norm_scope
from spec.registry import Registry
from spec.training_spec import TrainingSpec

# One stored tensor: (name, bytes per local token, recompute modules any of which drops it), as costmodel.memory
Tensor = tuple[str, float, frozenset[str]]
_NONE: frozenset[str] = frozenset()
_CORE = frozenset({"core_attn"})
_FP32 = 4


class AttentionPricing:
    """The cost model's part of one attention kind. ``shape`` (activations) is costmodel.memory's per-layout
    shape (``tp``, ``cp``, ``sp``); ``parts`` (time) is costmodel.step_time's layer pricer, whose ``linear``,
    ``norm``, ``elementwise``, ``biases``, ``attention_comm``, ``flash_core``, ``masked_core`` and ``cp_comm``
    add to ``block``."""

    def params(self, model: ModelSpec, tp: int) -> tuple[int, int]:
        """(TP-sharded, TP-replicated) parameters of the kind's projections and norms on one TP rank; not the
        layer's input norm nor the output projection's bias."""
        raise NotImplementedError

    def param_tensors(self, model: ModelSpec, tp: int) -> list[float]:
        """Elements of each of the executor's attention parameter tensors on one TP rank, the input norm
        included (what the weight cache and the allocator see)."""
        raise NotImplementedError

    def activations(self, model: ModelSpec, training: TrainingSpec, shape: Any) -> tuple[list[Tensor], float, float]:
        """(the tensors the kind's projections and core keep, bytes per local token; the width of the core's
        output per token on this rank's heads (all heads: divided by tp by the caller); the share of layers on
        the executor's masked path)."""
        raise NotImplementedError

    def gradient_width(self, model: ModelSpec) -> int:
        """Elements per token of the q, k and v gradients alive together in backward (all heads)."""
        raise NotImplementedError

    def norm_output_readers(self, model: ModelSpec) -> int:
        """GEMMs that read the input norm's output, each of which keeps its own fp8 copy of it under Transformer
        Engine's fp8 (``costmodel.fp8_storage``)."""
        raise NotImplementedError

    def tp_gather_width(self, model: ModelSpec) -> int:
        """Elements per token all-gathered over TP (sequence parallel) before the column-parallel projections."""
        raise NotImplementedError

    def kv_exchange(self, model: ModelSpec) -> tuple[int, int, int]:
        """(heads, key width, value width) of the K and V that context parallelism exchanges, all heads."""
        raise NotImplementedError

    def layer_time(self, parts: Any, block: Any) -> tuple[float, float]:
        """Add the kind's GEMMs, element-wise passes and collectives between the input norm and the core to
        ``block``; return the core's (forward, backward) seconds."""
        raise NotImplementedError


class GQAPricing(AttentionPricing):
    """Multi-head and grouped-query attention; sliding windows and sinks on the executor's masked path."""

    def params(self, model: ModelSpec, tp: int) -> tuple[int, int]:
        h, n, d, g = model.hidden_size, model.num_attention_heads, model.head_dim, model.num_kv_heads
        qkv_rows = (n + 2 * g) * d
        sharded, replicated = h * qkv_rows // tp + n * d * h // tp, 0
        if model.add_qkv_bias or model.add_bias_linear:
            sharded += qkv_rows // tp
        if model.qk_layernorm:  # the q and k norms, split with the heads or whole on every TP rank
            scope = qk_norm_scope(model)
            widths = scope.weight_widths(model)
            if scope.split_with_heads:
                sharded += sum(norm_params(model, w) // tp for w in widths)
            else:
                replicated += sum(norm_params(model, w) for w in widths)
        if model.softmax_type == "learnable":  # one sink logit per head, split with the heads
            sharded += n // tp
        return sharded, replicated

    def param_tensors(self, model: ModelSpec, tp: int) -> list[float]:
        h, n, d = model.hidden_size, model.num_attention_heads, model.head_dim
        heads, kv = n * d / tp, model.num_kv_heads * d / tp
        out = [heads * h, kv * h, kv * h, h * heads, h]  # wq, wk, wv, wo, the input norm
        if model.add_qkv_bias or model.add_bias_linear:
            out += [heads, kv, kv]
        if model.add_bias_linear:
            out.append(h)
        if model.qk_layernorm:  # the q and k norms' weights, split with the heads or whole
            scope = qk_norm_scope(model)
            out += [w / tp if scope.split_with_heads else w for w in scope.weight_widths(model)]
        if model.softmax_type == "learnable":
            out.append(n / tp)
        return out

    def activations(self, model: ModelSpec, training: TrainingSpec, shape: Any) -> tuple[list[Tensor], float, float]:
        b, n, t, d = training.activation_bytes, model.num_attention_heads, shape.tp, model.head_dim
        out: list[Tensor] = [("act.attn.qkv", (n + 2 * model.num_kv_heads) * d * b / t, _NONE)]
        if model.qk_layernorm:  # the q/k norms keep their inputs (q and k before the norm; per head or whole)
            out.append(("act.attn.qk_norm_input", (n + model.num_kv_heads) * d * b / t, _NONE))
        masked = 0.0
        if training.flash_attention and not training.fused_window_sink_attention:
            masked = masked_layer_share(model)
            out += [(name, masked * v, drop) for name, v, drop in _masked_path_tensors(model, training, shape)]
        return out, n * d, masked

    def gradient_width(self, model: ModelSpec) -> int:
        return (model.num_attention_heads + 2 * model.num_kv_heads) * model.head_dim

    def norm_output_readers(self, model: ModelSpec) -> int:
        # Megatron-Core's linear_qkv is TELayerNormColumnParallelLinear: the norm fused into the one QKV GEMM
        return 1

    def tp_gather_width(self, model: ModelSpec) -> int:
        return model.hidden_size

    def kv_exchange(self, model: ModelSpec) -> tuple[int, int, int]:
        return model.num_kv_heads, model.head_dim, model.head_dim

    def layer_time(self, parts: Any, block: Any) -> tuple[float, float]:
        m, tp, t, ab = parts.model, parts.tp, parts.tokens, parts.act_bytes
        h, heads, d, kv = m.hidden_size, m.num_attention_heads, m.head_dim, m.num_kv_heads
        parts.attention_comm(block)  # TP block and the whole-width q/k norms' sums
        parts.linear(block, t, (heads + 2 * kv) * d / tp, h, input_casts=parts.qkv_input_casts)
        if m.add_qkv_bias or m.add_bias_linear:
            parts.biases(block, (heads + 2 * kv) * d / tp, h if m.add_bias_linear else 0)
        if m.qk_layernorm:
            parts.elementwise(block, 2 * (heads + kv) / tp * d * t * ab, "layernorm", op="norm")
        if m.position_embedding_type == "rope":
            parts.elementwise(block, 2 * (heads + kv) / tp * d * t * ab)
        fwd, bwd = _gqa_core(parts, max(1, heads // tp), d)
        parts.cp_comm(block, parts.flash, max(1, heads // tp), d, d)
        parts.linear(block, t, h, heads * d / tp)
        return fwd, bwd


def _masked_path_tensors(model: ModelSpec, training: TrainingSpec, s: Any) -> list[Tensor]:
    """What one layer on the executor's masked path keeps beyond a plain layer (executor/attention_core.py),
    bytes per local token; all of it goes with core_attn recompute.

    With sinks: the fp32 probabilities [heads, s/cp, s + 1] and the fp32 copies of q and of k and v repeated
    to every query head (all-gathered over CP: cp times the local rows), in place of the 16-bit q, k, v. With a
    window only: SDPA's additive mask [s/cp, s] in the activation dtype and, with GQA, k and v repeated.
    """
    b, t, cp = training.activation_bytes, s.tp, s.cp
    n, g, d, keys = model.num_attention_heads, model.num_kv_heads, model.head_dim, training.seq_length
    if has_sinks(model):
        copies = (n * d + 2 * n * d * cp) * _FP32 / t - (n + 2 * g) * d * b / t
        return [("act.attn.sink_probs", n * (keys + 1) * _FP32 / t, _CORE),
                ("act.attn.sink_fp32_qkv", max(0.0, copies), _CORE)]
    out: list[Tensor] = [("act.attn.window_mask_bias", keys * b, _CORE)]
    if n > g:
        out.append(("act.attn.window_repeated_kv", 2 * n * d * b * cp / t, _CORE))
    return out


def _gqa_core(parts: Any, heads: int, d: int) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core per layer, the mean over the model's layers.

    Plain causal layers take the flash kernel. Layers with a window or sinks take, in the executor, the
    masked path over the whole [s/cp, s] score matrix: with sinks an explicit fp32 softmax, with a window
    only SDPA under a mask (every score computed, plus the mask's conversion to an additive bias); under
    ``fused_window_sink_attention`` (Megatron) the flash kernel, a window costing its keys only.
    """
    t, seq, rates = parts.tokens, parts.seq, parts.rates
    fwd, bwd = parts.flash_core(heads, d, d)
    if not parts.flash:  # the unfused path already computes the whole score matrix
        return fwd, bwd
    if parts.fused_special:
        share = fused_causal_fraction(parts.model, seq)
        return fwd * share, bwd * share
    share = masked_layer_share(parts.model)
    if not share:
        return fwd, bwd
    if has_sinks(parts.model):
        mfwd, mbwd = sink_attention_time(rates, t, seq, heads, d)
    else:
        mfwd, mbwd = parts.masked_core(heads, d, d)
    return (1 - share) * fwd + share * mfwd, (1 - share) * bwd + share * mbwd


class MLAPricing(AttentionPricing):
    """DeepSeek's multi-latent attention as the executor builds it (executor/mla.py): the down projections
    duplicated over TP on the sequence slice, the latents gathered over TP, the up projections split by head."""

    def params(self, model: ModelSpec, tp: int) -> tuple[int, int]:
        h, n = model.hidden_size, model.num_attention_heads
        qk, rope, v = model.qk_head_dim, model.qk_pos_emb_head_dim, model.v_head_dim
        q_width = n * (qk + rope)
        sharded = replicated = 0
        if model.q_lora_rank is None:
            sharded += h * q_width // tp
        else:
            replicated += h * model.q_lora_rank + norm_params(model, model.q_lora_rank)
            sharded += model.q_lora_rank * q_width // tp
        replicated += h * (model.kv_lora_rank + rope) + norm_params(model, model.kv_lora_rank)
        sharded += model.kv_lora_rank * n * (qk + v) // tp
        sharded += n * v * h // tp
        return sharded, replicated

    def param_tensors(self, model: ModelSpec, tp: int) -> list[float]:
        h, n = model.hidden_size, model.num_attention_heads
        qk, rope, v = model.qk_head_dim, model.qk_pos_emb_head_dim, model.v_head_dim
        q_width = n * (qk + rope) / tp
        if model.q_lora_rank is None:
            query = [q_width * h]
        else:
            query = [model.q_lora_rank * h, model.q_lora_rank, q_width * model.q_lora_rank]
        return query + [(model.kv_lora_rank + rope) * h, model.kv_lora_rank,
                        n * (qk + v) / tp * model.kv_lora_rank, h * n * v / tp, h]

    def activations(self, model: ModelSpec, training: TrainingSpec, shape: Any) -> tuple[list[Tensor], float, float]:
        """What the executor's multi-latent attention keeps (executor/mla.py), bytes per local token.

        On this rank's sequence slice: the query down projection's output (q_layernorm's input) and the kv
        down projection's output (kv_layernorm's input keeps the whole [kv latent | k_pe] tensor). All-gathered
        over TP: the latents [q latent (or, without q_lora_rank, the normalised input) | kv latent | k_pe],
        which the up projections keep; divided by TP under SP when the up projections keep their input sharded
        and re-gather it in backward (Megatron, ``TrainingSpec.sequence_parallel_regather``). Per head: q and
        k after RoPE, the kv up projection's output (v is a view of it, keeping the key part alive), the
        attention output before its copy into linear_proj's input.

        Under ``TrainingSpec.megatron_memory``, what Megatron-Core's MLASelfAttention keeps instead
        (megatron/core/transformer/multi_latent_attention.py, ``qkv_up_proj_and_rope_apply``): the query, the key
        and the value made contiguous for the fused attention kernel, with nothing left of the kv up projection's
        output (the fused MLA RoPE kernels read it and keep nothing), and one attention output, which the fused
        kernel keeps as ``out`` and linear_proj as its input (no copy): ``act.attn.proj_input`` alone.
        """
        b, t = training.activation_bytes, shape.tp
        dsp = t if shape.sp else 1
        latent_split = dsp if training.sequence_parallel_regather else 1
        n, h = model.num_attention_heads, model.hidden_size
        qk, rope, v = model.qk_head_dim, model.qk_pos_emb_head_dim, model.v_head_dim
        q_in = model.q_lora_rank if model.q_lora_rank is not None else h
        out: list[Tensor] = []
        if model.q_lora_rank is not None:
            out.append(("act.mla.q_down_output", model.q_lora_rank * b / dsp, _NONE))
        out += [("act.mla.kv_down_output", (model.kv_lora_rank + rope) * b / dsp, _NONE),
                ("act.mla.latents", (q_in + model.kv_lora_rank + rope) * b / latent_split, _NONE)]
        if training.megatron_memory:
            out.append(("act.attn.qkv", n * (2 * (qk + rope) + v) * b / t, frozenset({"mla_up_proj"})))
        else:
            out += [("act.attn.qkv", n * (2 * (qk + rope) + qk + v) * b / t, frozenset({"mla_up_proj"})),
                    ("act.mla.core_output", n * v * b / t, _CORE)]
        return out, n * v, 0.0

    def gradient_width(self, model: ModelSpec) -> int:
        return model.num_attention_heads * (2 * (model.qk_head_dim + model.qk_pos_emb_head_dim) + model.v_head_dim)

    def norm_output_readers(self, model: ModelSpec) -> int:
        # the query and the kv down projections (or, without q_lora_rank, the query projection), two TELinear
        # modules behind a separate input norm in Megatron-Core's MLA layer spec
        return 2

    def tp_gather_width(self, model: ModelSpec) -> int:
        return (model.q_lora_rank or model.hidden_size) + model.kv_lora_rank + model.qk_pos_emb_head_dim

    def kv_exchange(self, model: ModelSpec) -> tuple[int, int, int]:
        return model.num_attention_heads, model.qk_head_dim + model.qk_pos_emb_head_dim, model.v_head_dim

    def layer_time(self, parts: Any, block: Any) -> tuple[float, float]:
        m, tp, t, ab = parts.model, parts.tp, parts.tokens, parts.act_bytes
        h, heads = m.hidden_size, m.num_attention_heads
        qk, rope, v = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
        q_in = m.q_lora_rank or h
        if m.q_lora_rank:  # down projections are duplicated over TP and run on the SP shard
            parts.linear(block, parts.tokens_local, m.q_lora_rank, h)
            parts.norm(block, m.q_lora_rank)
        parts.linear(block, parts.tokens_local, m.kv_lora_rank + rope, h)
        parts.norm(block, m.kv_lora_rank)
        parts.attention_comm(block)  # the latents gathered over TP, the output scattered back
        parts.linear(block, t, heads * (qk + rope) / tp, q_in, "mla_up_proj")
        parts.linear(block, t, heads * (qk + v) / tp, m.kv_lora_rank, "mla_up_proj")
        parts.elementwise(block, 2 * (heads / tp + 1) * rope * t * ab)  # rope on q and the shared k
        # the executor concatenates q's and k's halves per head (k's rope part broadcast): a copy of each
        parts.elementwise(block, 2 * 2 * heads / tp * (qk + rope) * t * ab)
        if parts.cp > 1 and parts.flash and parts.cp_comm_type == "allgather":  # its flash path needs V as wide as Q
            fwd, bwd = parts.masked_core(max(1, heads // tp), qk + rope, v)
        else:
            fwd, bwd = parts.flash_core(max(1, heads // tp), qk + rope, v)
        parts.cp_comm(block, False, max(1, heads // tp), qk + rope, v)
        parts.linear(block, t, h, heads * v / tp)
        return fwd, bwd


#: attention kind name -> its pricing; a kind registers with ``PRICING.add(name, pricing)``
PRICING: Registry[AttentionPricing] = Registry("attention pricing")


def attention_pricing(model: ModelSpec) -> AttentionPricing:
    """The pricing of ``model``'s attention kind; InvalidConfigError for a kind the cost model cannot price."""
    kind = attention_kind(model)
    pricing = PRICING.get(kind.name)
    if pricing is None:
        raise InvalidConfigError(f"the cost model has no pricing of attention kind {kind.name!r}; "
                                 f"priced: {', '.join(PRICING)}")
    return pricing


PRICING.add(GQA.name, GQAPricing())
PRICING.add(MLA.name, MLAPricing())
