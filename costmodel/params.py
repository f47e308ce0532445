"""Parameter counts: what one GPU of one pipeline stage holds, and the whole model's total/active counts.

Counted as a Megatron-Core GPT model holds them (element counts, not bytes):

- attention: QKV (GQA: ``n·d + 2·g·d`` output rows) or MLA (q/kv down projections, their norms, q/kv up
  projections), the output projection, optional QKV / linear biases, optional per-head q/k norms, learned
  attention sinks (one per head);
- MLP: dense layers ``fc1`` (``2·ffn`` rows with SwiGLU) and ``fc2``; MoE layers a router ``E×h`` (and an
  ``E`` bias with add_bias_linear), the routed experts (each an MLP of ``moe_ffn_hidden_size``) and the
  shared experts;
- two norms per layer (LayerNorm has a weight and a bias, RMSNorm a weight);
- the first stage: the word embedding (vocabulary padded as Megatron pads it, split over TP) and a
  learned absolute position table (not split over TP); the last stage: the final norm and the output
  layer. With tied embeddings and PP > 1 the last stage holds its own copy of the embedding matrix (as
  Megatron does, kept in sync by the embedding group); with a head feature (``spec.head_features``) the
  last stage also holds its blocks, each one transformer layer of the last layer's kind and the feature's own
  parameters (``costmodel.head_pricing``), and an embedding when they read it: MTP's ``mtp_num_layers``
  blocks (two norms, the ``2h → h`` projection, the layer and a final norm) embed the shifted tokens.

Sharding per GPU: column/row-parallel weights and column-parallel biases are split by TP; norms, the
router, row-parallel biases, position embeddings and the MLA down projections (Megatron builds them
duplicated) are replicated over TP; routed experts are split by EP (whole experts) and ETP (each expert's
FFN dimension; the fc2 bias stays whole). Layers go to pipeline stages by :func:`layer_chunks` (with the
layout's Megatron placement options, ``ParallelConfig.pipeline_split``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from costmodel.attention_pricing import attention_pricing
from costmodel.head_pricing import head_pricing
from costmodel.per_model import norm_params as _norm, per_model_cache
from spec.errors import InvalidConfigError
from spec.head_features import HeadFeature, head_features, last_stage_embeds
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.pipeline_layout import DEFAULT_SPLIT, PipelineSplit, layer_chunks


@dataclass(frozen=True)
class ParamCounts:
    """Parameters held by one GPU of one pipeline stage (elements, not bytes)."""

    dense_tp_sharded: int  # attention / dense-MLP / shared-expert / embedding / output weights split by TP
    dense_replicated: int  # norms, router, row-parallel biases, position table, MLA down projections
    expert: int  # routed-expert weights on this GPU (÷ EP·ETP)

    @property
    def total(self) -> int:
        return self.dense_tp_sharded + self.dense_replicated + self.expert

    @property
    def dense(self) -> int:
        """Parameters whose gradients reduce over DP·CP (everything but routed experts)."""
        return self.dense_tp_sharded + self.dense_replicated

    def __add__(self, other: ParamCounts) -> ParamCounts:
        return ParamCounts(self.dense_tp_sharded + other.dense_tp_sharded,
                           self.dense_replicated + other.dense_replicated, self.expert + other.expert)

    def __mul__(self, n: int) -> ParamCounts:
        return ParamCounts(self.dense_tp_sharded * n, self.dense_replicated * n, self.expert * n)


ZERO = ParamCounts(0, 0, 0)



@per_model_cache
def moe_pattern(model: ModelSpec) -> tuple[int, ...]:
    """``model.moe_layer_pattern()``, computed once per model (it is read for every stage of every layout)."""
    return model.moe_layer_pattern()


# ---- layer placement ------------------------------------------------------------------------------
def stage_layers(model: ModelSpec, config: ParallelConfig, stage: int) -> tuple[int, ...]:
    """Decoder-layer indices held by pipeline rank ``stage`` (all its virtual chunks, in model order)."""
    chunks = layer_chunks(model.num_layers, config.pp, config.vpp, config.pipeline_split)
    return tuple(i for chunk in chunks[stage] for i in chunk)


# ---- per-module counts ----------------------------------------------------------------------------
@per_model_cache
def attention_params(model: ModelSpec, tp: int) -> ParamCounts:
    """Attention block of one layer on one TP rank, including the layer's input norm."""
    h = model.hidden_size
    sharded, replicated = attention_pricing(model).params(model, tp)
    replicated += _norm(model, h)  # input layernorm
    if model.add_bias_linear:
        replicated += h  # output-projection bias (row parallel: whole on every TP rank)
    return ParamCounts(sharded, replicated, 0)


def _mlp(model: ModelSpec, ffn: int, split: int) -> tuple[int, int]:
    """(split weights + column bias, whole fc2 bias) of one MLP whose FFN dim is split ``split`` ways."""
    h = model.hidden_size
    up = (2 if model.gated_linear_unit else 1) * ffn
    weights = h * up // split + ffn * h // split
    if model.add_bias_linear:
        return weights + up // split, h
    return weights, 0


@per_model_cache
def mlp_params(model: ModelSpec, tp: int) -> ParamCounts:
    """Dense MLP block of one layer on one TP rank, including the pre-MLP norm."""
    split, whole = _mlp(model, model.ffn_hidden_size, tp)
    return ParamCounts(split, whole + _norm(model, model.hidden_size), 0)


@per_model_cache
def moe_params(model: ModelSpec, tp: int, ep: int, etp: int) -> ParamCounts:
    """MoE block of one layer on one GPU: pre-MLP norm, router, shared experts (TP) and E/EP routed experts."""
    h = model.hidden_size
    # the router's weight, and its bias with add_bias_linear (GPT-OSS's router has one)
    replicated = _norm(model, h) + (model.num_experts or 0) * (h + (1 if model.add_bias_linear else 0))
    sharded = 0
    if model.shared_expert_ffn_hidden_size:
        split, whole = _mlp(model, model.shared_expert_ffn_hidden_size, tp)
        sharded += split
        replicated += whole + (h if model.moe_shared_expert_gate else 0)  # the gate's [1, h] weight
    split, whole = _mlp(model, model.expert_ffn_hidden_size, etp)
    expert = ((model.num_experts or 0) // ep) * (split + whole)
    return ParamCounts(sharded, replicated, expert)


def layer_params(model: ModelSpec, tp: int, ep: int, etp: int, is_moe: bool) -> ParamCounts:
    """One decoder layer (attention + dense MLP or MoE) on one GPU."""
    return attention_params(model, tp) + (moe_params(model, tp, ep, etp) if is_moe else mlp_params(model, tp))


def embedding_params(model: ModelSpec, tp: int) -> ParamCounts:
    """Word embedding (vocab-parallel over TP) plus a learned position table (whole on every TP rank)."""
    words = model.padded_vocab_size(tp) * model.hidden_size // tp
    positions = model.max_position_embeddings * model.hidden_size \
        if model.position_embedding_type == "learned_absolute" else 0
    return ParamCounts(words, positions, 0)


def head_block_params(model: ModelSpec, feature: HeadFeature, tp: int, ep: int, etp: int) -> ParamCounts:
    """One block of head feature ``feature`` (an MTP depth: enorm, hnorm, the ``2h → h`` projection (TP-split),
    a final norm) and its decoder layer, like the last one."""
    last_is_moe = bool(moe_pattern(model)[-1])
    own = ParamCounts(*head_pricing(feature).params(model, tp), 0)
    return own + layer_params(model, tp, ep, etp, last_is_moe)


# ---- stages and totals ----------------------------------------------------------------------------
@per_model_cache
def _stage_kinds(model: ModelSpec, pp: int, vpp: int, stage: int, split: PipelineSplit) -> tuple[int, int]:
    """(dense layers, MoE layers) of pipeline rank ``stage``."""
    pattern = moe_pattern(model)
    layers = [i for chunk in layer_chunks(model.num_layers, pp, vpp, split)[stage] for i in chunk]
    num_moe = sum(pattern[i] for i in layers)
    return len(layers) - num_moe, num_moe


@per_model_cache
def _edge_params(model: ModelSpec, tp: int, ep: int, etp: int, first: bool, last: bool) -> ParamCounts:
    """What the first / last rank holds beyond its decoder layers (embedding; final norm, output, head blocks)."""
    counts = embedding_params(model, tp) if first else ZERO
    if last:
        words = model.padded_vocab_size(tp) * model.hidden_size // tp
        embeds = last_stage_embeds(model)
        extra = 0
        if embeds and not first:
            extra += words  # a head block (MTP) embeds the shifted tokens on the last stage
        if model.untie_embeddings_and_output_weights or not (first or embeds):
            extra += words  # own output matrix, or the tied copy of the embedding
        counts = counts + ParamCounts(extra, _norm(model, model.hidden_size), 0)  # + final norm
        for feature, depth in head_features(model):
            counts = counts + head_block_params(model, feature, tp, ep, etp) * depth
    return counts


@per_model_cache
def stage_counts_and_gemm(model: ModelSpec, tp: int, pp: int, vpp: int, ep: int, etp: int,
                          stage: int, split: PipelineSplit = DEFAULT_SPLIT) -> tuple[ParamCounts, int]:
    """(parameters of rank ``stage`` on one GPU, the part of them in decoder-layer GEMM weights).

    The GEMM part (attention, MLP, shared and routed experts; not norms, router, embedding, output, MTP)
    is what fp8 training keeps an extra fp8 copy of. Cached: the planner asks for every layout.
    """
    num_dense, num_moe = _stage_kinds(model, pp, vpp, stage, split)
    attn = attention_params(model, tp)
    layers = num_dense + num_moe
    sharded, replicated, expert = attn.dense_tp_sharded * layers, attn.dense_replicated * layers, 0
    gemm = sharded
    if num_dense:
        mlp = mlp_params(model, tp)
        sharded += mlp.dense_tp_sharded * num_dense
        replicated += mlp.dense_replicated * num_dense
        gemm += mlp.dense_tp_sharded * num_dense
    if num_moe:
        moe = moe_params(model, tp, ep, etp)
        sharded += moe.dense_tp_sharded * num_moe
        replicated += moe.dense_replicated * num_moe
        expert = moe.expert * num_moe
        gemm += (moe.dense_tp_sharded + moe.expert) * num_moe
    edges = _edge_params(model, tp, ep, etp, stage == 0, stage == pp - 1)
    return ParamCounts(sharded + edges.dense_tp_sharded, replicated + edges.dense_replicated,
                       expert + edges.expert), gemm


def _stage_counts(model: ModelSpec, tp: int, pp: int, vpp: int, ep: int, etp: int, stage: int,
                  split: PipelineSplit = DEFAULT_SPLIT) -> ParamCounts:
    return stage_counts_and_gemm(model, tp, pp, vpp, ep, etp, stage, split)[0]


def stage_param_counts(model: ModelSpec, config: ParallelConfig, stage: int) -> ParamCounts:
    """Parameters held by one GPU of pipeline rank ``stage`` (all its virtual chunks), by sharding bucket."""
    if not 0 <= stage < config.pp:
        raise InvalidConfigError(f"stage {stage} is outside the pipeline (pp={config.pp})")
    return _stage_counts(model, config.tp, config.pp, config.vpp, config.ep, config.etp, stage, config.pipeline_split)


@lru_cache(maxsize=256)
def total_param_counts(model: ModelSpec) -> tuple[int, int]:
    """(total parameters, parameters active per token) of the whole model, unsharded, for display.

    Counts the embedding once (twice when untied), at the vocabulary padded for TP=1, and excludes MTP
    blocks, as published totals do (DeepSeek-V3's 671B/37B leave its MTP module out). Active counts
    ``top-k`` routed experts per MoE layer instead of all of them.
    """
    pattern = model.moe_layer_pattern()
    num_moe = sum(pattern)
    num_dense = model.num_layers - num_moe
    h = model.hidden_size
    attn = attention_params(model, 1).total
    dense_layer = attn + mlp_params(model, 1).total
    moe = moe_params(model, 1, 1, 1)
    moe_layer = attn + moe.dense_tp_sharded + moe.dense_replicated
    per_expert = moe.expert // (model.num_experts or 1)
    edges = embedding_params(model, 1).total + _norm(model, h)
    if model.untie_embeddings_and_output_weights:
        edges += model.padded_vocab_size(1) * h
    total = num_dense * dense_layer + num_moe * (moe_layer + moe.expert) + edges
    active = num_dense * dense_layer + num_moe * (moe_layer + model.moe_router_topk * per_expert) + edges
    return total, active
