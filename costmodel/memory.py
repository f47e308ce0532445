"""Per-GPU memory of a folded layout: weights, grads, optimizer states, activations, logits, buffers.

The model is the one described in ``docs/memory-model.md``. In short, per GPU of pipeline rank ``i``:

- weights ``P·w`` (``w`` = 2 bytes for bf16/fp16/fp8, 4 for fp32; fp8 adds the cached fp8 forms of each GEMM
  weight, ``costmodel.fp8_storage``, which replace the 16-bit copy with ``fp8_param_gather``), grads ``P·4``
  with fp32 main grads (else ``P·w``), Adam states ``P·12`` (fp32 master + m + v; 8 when the weights already
  are fp32; the precision-aware optimizer's dtypes instead where the layout names them,
  :func:`optimizer_state_bytes`: bf16 moments and fp32 master 8, bf16 moments and fp16 master 6). With the
  distributed optimizer the dense states are divided by DP·CP and the expert states by EDP (Megatron's
  18 bytes/param recipe when it is off).
- activations: the tensors autograd keeps for backward, per layer, per micro-batch, times the micro-batches
  in flight (1F1B: ``min(PP − i, m)``; interleaved: Megatron's warm-up count + 1, which on rank 0 is
  Korthikanti's ``L·(1 + (PP−1)/(PP·VPP))``). Recomputation removes tensors per module or keeps only
  each layer's input (full).
- logits: the output layer and loss of one micro-batch on the last stage. The executor's fused loss, blocked
  over the vocabulary, holds one block of logits (16-bit and fp32, at most ``CROSS_ENTROPY_CHUNK_LOGITS``),
  the fp32 input-gradient accumulator, the per-token log-sum-exp of each head and the output weight's 16-bit
  gradient; Megatron's loss (``TrainingSpec.megatron_cross_entropy``) the whole 16-bit logits and one fp32
  softmax per output head.
- comm_buffers: the largest per-layer communication buffer (SP gather / reduce-scatter, EP dispatch and
  combine, CP key/value ring) plus the PP send/receive pair.
- allocator_overhead: the backward working set of one layer (recomputed tensors and the gradients of
  two adjacent intermediates, which the caching allocator must hold on top of the stored tensors) plus
  :data:`FRAGMENTATION` of every dynamic allocation.

What Megatron-Core with Transformer Engine keeps where it differs from the executor is priced under
``TrainingSpec`` switches (``megatron_memory``, ``transformer_engine_fp8`` with ``fp8_recipe``, ...; see
docs/memory-model.md, "Megatron-Core's accounting").

All functions are pure; the expensive parts are cached per (model, training) and per layout shape so that
a planner sweep costs a few microseconds per configuration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import NamedTuple

from costmodel.activation import glu_saved_intermediates
from costmodel.attention_kinds import has_sinks, masked_layer_share
from costmodel.attention_pricing import attention_pricing
from costmodel.dispatch import dispatcher_pricing
from costmodel.fp8_storage import fp8_weight_extra_bytes, te_saved_input_bytes
from costmodel.head_pricing import head_pricing
from costmodel.loss import FusedLoss, loss_fixed_bytes as _loss_fixed, loss_memory_terms
from spec.dispatchers import DEFAULT_DISPATCHER
from spec.errors import InvalidConfigError
from spec.hardware import ClusterSpec
from spec.head_features import head_blocks, head_features
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from costmodel.params import moe_pattern, per_model_cache, stage_counts_and_gemm
from spec.pipeline_layout import DEFAULT_SPLIT, PipelineSplit, layer_chunks
from spec.optimizer_dtypes import state_bytes
from spec.training_spec import TrainingSpec

#: Share of dynamic allocations (activations, logits, buffers, working set) the PyTorch caching allocator
#: loses to block rounding and fragmentation: the prior for a profile without a measured
#: ``HardwareProfile.allocator_fragmentation`` (``foldtune calibrate`` on a GPU measures it from a proxy's
#: peak reserved vs allocated bytes, executor/microbench/fragmentation.py). CUDA context and NCCL's own
#: buffers are outside the PyTorch allocator and are covered by ``ClusterSpec.hbm_reserved_bytes`` instead.
FRAGMENTATION = 0.05

_FP32 = 4
_MASK = 1  # dropout masks and routing maps are stored as one byte per element
_MIB = 2**20

#: cuBLAS workspace per handle: 32 MiB on Hopper and newer, 4 MiB before (NVIDIA's recommendation for
#: cublasSetWorkspace, which PyTorch follows). PyTorch takes it from its caching allocator, so it counts in
#: ``memory_allocated``; one per (handle, stream), and training uses two handles: the Python thread's for
#: the forward and the autograd engine's device thread's for the backward.
CUBLAS_WORKSPACE_HOPPER = 32 * _MIB
CUBLAS_WORKSPACE_OLDER = 4 * _MIB
CUBLAS_HANDLES = 2
#: The executor's gradient/optimizer bucket (executor/train_step.py: ``bucket_mb=25``), in parameter bytes.
EXECUTOR_BUCKET_BYTES = 25 * _MIB
#: Bytes the executor's Adam step allocates per element of one optimizer unit (bucket shard ``S`` of a bucket
#: ``B``): none for the update itself (torch's fused AdamW kernel, which the executor runs wherever torch has
#: it, updates master, moments and gradient in place; the chain of in-place ops it replaced made sqrt and divide
#: temporaries of 2 · 4 B · S), then the write-back, which makes the 16-bit copy of the master shard (2 B · S)
#: and, over a group of two or more without overlap_param_gather, the all-gathered 16-bit bucket (2 B · B).
#: With overlap_param_gather the gather runs in place into the parameters (no bucket copy). The step's peak is
#: the larger of the two moments. Measured on 2 × H200 (Mixtral proxy, pp2 mbs1 full recompute;
#: docs/benchmarks.md): the peak was 2.5 GiB below a prediction that counted the chain's 8 B per element.
OPT_STEP_TEMP_PER_SHARD_ELEMENT = 0
OPT_WRITE_BACK_PER_SHARD_ELEMENT = 2
OPT_WRITE_BACK_PER_BUCKET_ELEMENT = 2
#: A unit with a state below fp32 (the precision-aware optimizer) is stepped in blocks of this many elements
#: (executor/optimizer.py: STATE_BLOCK_ELEMENTS); each such state widens one block to fp32 at a time (an fp16
#: one is scaled in place), an fp32 one is updated in place.
OPT_STATE_BLOCK_ELEMENTS = 1 << 22
OPT_NARROW_STATE_TEMP_BLOCKS = {"fp32": 0, "bf16": 1, "fp16": 1, "fp8": 1}


@lru_cache(maxsize=64)
def library_workspace_bytes(gpu_name: str) -> int:
    """Bytes of cuBLAS workspaces in the PyTorch allocator on ``gpu_name`` (0 on CPU)."""
    name = gpu_name.lower()
    if name == "cpu":
        return 0
    hopper_or_newer = name.startswith(("h100", "h200", "gh200", "b100", "b200", "gb200", "gb300", "b300"))
    return CUBLAS_HANDLES * (CUBLAS_WORKSPACE_HOPPER if hopper_or_newer else CUBLAS_WORKSPACE_OLDER)


@dataclass(frozen=True, init=False)
class MemoryBreakdown:
    """Bytes on the most-loaded GPU (or on one named pipeline rank, from :func:`estimate_stage_memory`).

    ``details`` is an ordinary field (``fields``, ``asdict``, ``==``, ``repr`` and pickling see it), but
    when the estimate builds the breakdown it is computed on first access: a planner sweep reads the
    totals of 10⁵ layouts and the details of the few it shows. ``host_offloaded`` is what the layout's offload
    knobs moved to this rank's CPU memory (optimizer state and activations, bytes): not part of ``total``.
    """

    stage: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    comm_buffers: float
    allocator_overhead: float
    details: tuple[tuple[str, float], ...]
    host_offloaded: float

    def __init__(self, stage: int, weights: float, grads: float, optimizer: float, activations: float,
                 logits: float, comm_buffers: float, allocator_overhead: float,
                 details: tuple[tuple[str, float], ...] | None = None, host_offloaded: float = 0.0, *,
                 details_source: Callable[[], tuple[tuple[str, float], ...]] | None = None) -> None:
        if (details is None) == (details_source is None):
            raise TypeError("MemoryBreakdown needs exactly one of details or details_source")
        # frozen: fill the instance dict directly (one call, the hot path builds one per layout)
        self.__dict__.update(stage=stage, weights=weights, grads=grads, optimizer=optimizer,
                             activations=activations, logits=logits, comm_buffers=comm_buffers,
                             allocator_overhead=allocator_overhead, host_offloaded=host_offloaded)
        if details is not None:
            self.__dict__["details"] = tuple(details)
        else:
            self.__dict__["_details_source"] = details_source

    def __getattr__(self, name: str):  # only reached while ``details`` is not materialised yet
        source = self.__dict__.get("_details_source") if name == "details" else None
        if source is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        value = self.__dict__["details"] = source()
        del self.__dict__["_details_source"]
        return value

    def __reduce__(self):
        return (type(self), (self.stage, self.weights, self.grads, self.optimizer, self.activations, self.logits,
                             self.comm_buffers, self.allocator_overhead, self.details, self.host_offloaded))

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.activations + self.logits
                + self.comm_buffers + self.allocator_overhead)

    def detail(self, prefix: str) -> float:
        """Sum of the detail entries whose name starts with ``prefix`` (bytes)."""
        return sum(v for k, v in self.details if k.startswith(prefix))


# ---- per-layer tensors ----------------------------------------------------------------------------
# One tensor: (name, bytes per local token, recompute modules any of which drops it).
_Tensor = tuple[str, float, frozenset[str]]
_NONE: frozenset[str] = frozenset()


def _drops(*modules: str) -> frozenset[str]:
    return frozenset(modules)


class _Shape(NamedTuple):
    """The layout fields the per-token activation terms depend on (a tuple: hashing it is cheap)."""

    tp: int
    cp: int
    ep: int
    etp: int
    sp: bool
    dispatcher: str


def _attention_tensors(model: ModelSpec, training: TrainingSpec, s: _Shape) -> list[_Tensor]:
    b = training.activation_bytes
    h, n, t = model.hidden_size, model.num_attention_heads, s.tp
    dsp = t if s.sp else 1  # tensors in the sequence-parallel region are split over TP only with SP
    pricing = attention_pricing(model)
    q = te_saved_input_bytes(training)
    # Transformer Engine's fp8 saves the norm output as each reading GEMM's fp8 copy (its LayerNormLinear's
    # ln_out), not the 16-bit tensor; under layernorm recompute Megatron has the GEMM save the original input
    # instead (Attention.set_for_recompute_input_layernorm), which the recompute discards: gone either way
    normed = h * b / dsp if q is None else pricing.norm_output_readers(model) * h * q / dsp
    out: list[_Tensor] = [("act.attn.norm_input", h * b / dsp, _NONE),
                          ("act.attn.norm_output", normed, _drops("layernorm"))]
    tensors, v_width, masked = pricing.activations(model, training, s)
    out += tensors
    if training.flash_attention:
        lse_share = 1.0 - masked if has_sinks(model) else 1.0  # the fp32 sink path keeps no log-sum-exp
        if lse_share:
            out.append(("act.attn.softmax_lse", lse_share * n * _FP32 / t, _drops("core_attn")))
    else:  # unfused path keeps the s×s probabilities (and dropout mask + output) per head
        keys = training.seq_length
        out.append(("act.attn.softmax", n * keys * b / t, _drops("core_attn")))
        if model.attention_dropout > 0:
            out.append(("act.attn.softmax_dropout", n * keys * (_MASK + b) / t, _drops("core_attn")))
    out.append(("act.attn.proj_input", v_width * b / t, _NONE))
    if q is not None and training.fp8_recipe == "delayed":
        # linear_proj saves its fp8 copy of the attention output beside the output the fused attention keeps:
        # Megatron has it save the original input for every recipe but delayed scaling (attention.py,
        # set_save_original_input(self.linear_proj))
        out.append(("act.attn.proj_input_fp8", v_width * q / t, _NONE))
    if model.hidden_dropout > 0:
        out.append(("act.attn.dropout_mask", h * _MASK / dsp, _NONE))
    return out


def _mlp_tensors(model: ModelSpec, training: TrainingSpec, s: _Shape) -> list[_Tensor]:
    b, h, t = training.activation_bytes, model.hidden_size, s.tp
    dsp = t if s.sp else 1
    ffn, gate = model.ffn_hidden_size, (2 if model.gated_linear_unit else 1)
    q = te_saved_input_bytes(training)
    gemm_in = b if q is None else q  # fc1's and fc2's saved inputs: fp8 copies under Transformer Engine's fp8
    # Megatron-Core's fc1 is TELayerNormColumnParallelLinear: its norm is inside the recomputed MLP
    fc1_drops = _drops("layernorm", "mlp") if training.megatron_memory else _drops("layernorm")
    out: list[_Tensor] = [("act.mlp.norm_input", h * b / dsp, _NONE),
                          ("act.mlp.fc1_input", h * gemm_in / dsp, fc1_drops),
                          ("act.mlp.fc1_output", gate * ffn * b / t, _drops("mlp")),
                          ("act.mlp.act_output", ffn * gemm_in / t, _drops("mlp"))]
    glu = glu_saved_intermediates(model)
    if glu:
        out.append(("act.mlp.glu_intermediates", glu * ffn * b / t, _drops("mlp")))
    if model.hidden_dropout > 0:
        out.append(("act.mlp.dropout_mask", h * _MASK / dsp, _NONE))
    return out


def routed_tokens_per_token(model: ModelSpec, training: TrainingSpec, tp: int, sp: bool, ep: int, etp: int) -> float:
    """Token copies the busiest GPU's experts process per local token of a micro-batch.

    Each GPU of the ETP·EP group serves ``1/EP`` of the experts for the tokens of ``ETP·EP`` ranks, so in
    balance it sees ``k·ETP`` copies per token of its own (``/TP`` with SP). The busiest GPU sees
    ``TrainingSpec.ep_imbalance(ep)`` times that (1 with EP = 1: every expert is local and the total cannot
    be imbalanced); capacity routing caps it at the capacity factor, and padding to capacity makes it exactly
    the capacity factor on every rank (``TrainingSpec.expert_rows_factor``).
    """
    rho = training.expert_rows_factor(ep)
    return model.moe_router_topk * etp * rho / (tp if sp else 1)


def _moe_tensors(model: ModelSpec, training: TrainingSpec, s: _Shape) -> list[_Tensor]:
    b, h, t = training.activation_bytes, model.hidden_size, s.tp
    dsp = t if s.sp else 1
    experts = model.num_experts or 0
    fe, gate = model.expert_ffn_hidden_size / s.etp, (2 if model.gated_linear_unit else 1)
    te = routed_tokens_per_token(model, training, s.tp, s.sp, s.ep, s.etp)
    q = te_saved_input_bytes(training)
    # the grouped and shared GEMMs' saved inputs: fp8 copies under Transformer Engine's fp8. Under moe_act
    # recompute Megatron has fc2 save its original input, which the recompute discards (TEGroupedMLP.__init__,
    # set_save_original_input(self.linear_fc2)): the act output goes with moe_act either way
    gemm_in = b if q is None else q
    moe = _drops("moe")
    out: list[_Tensor] = [
        ("act.moe.norm_input", h * b / dsp, _NONE),
        ("act.moe.router_input", h * b / dsp, _drops("layernorm")),
        ("act.moe.router_scores", experts * _FP32 / dsp, moe),  # fp32 softmax/sigmoid output
        ("act.moe.routing_map", experts * _MASK / dsp, moe),
        ("act.moe.router_probs", experts * _FP32 / dsp, moe),  # [tokens, E] top-k probabilities
        ("act.moe.permuted_tokens", te * h * gemm_in, moe),  # expert FC1 input after dispatch
        ("act.moe.permuted_probs", te * _FP32, moe),  # probabilities applied inside the activation
        ("act.moe.expert_fc1_output", te * gate * fe * b, moe),
        ("act.moe.expert_act_output", te * fe * gemm_in, _drops("moe", "moe_act")),
    ]
    k = model.moe_router_topk
    if training.megatron_memory:
        # Megatron-Core applies the probabilities in the experts' activation (TEGroupedMLP.forward,
        # weighted_bias_swiglu_impl) and unpermutes without them (MoEAlltoAllTokenDispatcher.combine_postprocess):
        # its unpermute keeps no input. Its fused permute (--moe-permute-fusion, TE's moe_permute_with_probs)
        # keeps an int32 row map of [local tokens, 2·E + 1]; behind an EP exchange the chunk sort after it
        # (TE's moe_sort_chunks_by_index) an int32 row per received copy (Megatron skips the sort with one local
        # expert; priced for every EP > 1, which the cached terms see, at 4 bytes per copy).
        out.append(("act.moe.permute_row_map", (2 * experts + 1) * 4 / dsp, moe))
        if s.ep > 1:
            out.append(("act.moe.sort_chunks_row_map", 4 * te, moe))
    else:
        # This project's executor (executor/dispatcher.py) weights by the probabilities in its unpermute, which
        # saves the returned expert rows (k per local token) and, as int64, each slot's row and the sorted
        # slot order (2·8·k per local token), plus under EP·ETP > 1 the (source, expert) reordering index and
        # its inverse (2·8 per received copy).
        out += [("act.moe.unpermute_input", k * h * b / dsp, moe), ("act.moe.dispatch_indices", 2 * 8 * k / dsp, moe)]
        if s.ep * s.etp > 1:
            out.append(("act.moe.reorder_indices", 2 * 8 * te, moe))
    if not model.gated_linear_unit:  # unfused act·prob keeps both the activation and the weighted product
        out.append(("act.moe.expert_weighted_output", te * fe * b, moe))
    glu = glu_saved_intermediates(model)
    if glu:
        out.append(("act.moe.expert_glu_intermediates", glu * te * fe * b, _drops("moe", "moe_act")))
    if model.add_bias_linear:  # each routed row's expert index (int64), to pick its biases
        out.append(("act.moe.expert_bias_rows", 8 * te, moe))
    fs = model.shared_expert_ffn_hidden_size
    if fs:
        shared = _drops("moe", "shared_experts")
        out += [("act.shared.fc1_output", gate * fs * b / t, shared),
                ("act.shared.act_output", fs * gemm_in / t, shared)]
        if q is not None:
            # the shared experts' fc1 (TEColumnParallelLinear) keeps its own fp8 copy of the normed input beside
            # the router's 16-bit one; under layernorm recompute Megatron has it save the original instead
            # (MoELayer.set_for_recompute_pre_mlp_layernorm), which the recompute discards
            out.append(("act.shared.fc1_input_fp8", h * q / dsp, _drops("moe", "shared_experts", "layernorm")))
        if glu:
            out.append(("act.shared.glu_intermediates", glu * fs * b / t, shared))
    if model.hidden_dropout > 0:
        out.append(("act.moe.dropout_mask", h * _MASK / dsp, _NONE))
    return out


def _gradient_peak(model: ModelSpec, training: TrainingSpec, s: _Shape, is_moe: bool) -> float:
    """Bytes per local token of the largest pair of gradients alive at once in one layer's backward.

    Along a GEMM chain ``x → fc1 → act → fc2`` the gradient of one intermediate is freed only after the
    gradient of the one before it exists, so the peak is the largest adjacent pair. Attention: dq, dk, dv
    with flash attention, or two s×s gradients (probabilities and scores) without it.
    """
    b, h, t = training.activation_bytes, model.hidden_size, s.tp
    gate = 2 if model.gated_linear_unit else 1

    def chain(tokens: float, ffn: float) -> float:
        return max(tokens * (h + gate * ffn), tokens * (gate + 1) * ffn, tokens * (ffn + h)) * b

    qkv = attention_pricing(model).gradient_width(model)
    attn = qkv * b / t if training.flash_attention else \
        2 * model.num_attention_heads * training.seq_length * b / t
    if training.flash_attention and not training.fused_window_sink_attention and has_sinks(model) \
            and masked_layer_share(model):  # softmax backward: the probabilities' and the scores' fp32 gradients
        attn = max(attn, 2 * model.num_attention_heads * (training.seq_length + 1) * _FP32 / t)
    if not is_moe:
        return max(attn, chain(1.0, model.ffn_hidden_size / t))
    te = routed_tokens_per_token(model, training, s.tp, s.sp, s.ep, s.etp)
    peak = max(attn, chain(te, model.expert_ffn_hidden_size / s.etp))
    if model.shared_expert_ffn_hidden_size:
        peak = max(peak, chain(1.0, model.shared_expert_ffn_hidden_size / t))
    return peak


def _comm_per_token(model: ModelSpec, training: TrainingSpec, s: _Shape,
                    has_moe: bool) -> tuple[tuple[str, float], ...]:
    """Per-layer communication buffers (bytes per local token); only the largest is live at a time."""
    b, h = training.activation_bytes, model.hidden_size
    dsp = s.tp if s.sp else 1
    out: list[tuple[str, float]] = []
    if s.sp and s.tp > 1:  # gathered GEMM input + full-sequence row-parallel output before reduce-scatter
        out.append(("comm.sp.gather_scatter", 2 * h * b))
    if has_moe:
        te = routed_tokens_per_token(model, training, s.tp, s.sp, s.ep, s.etp)
        out.append(dispatcher_pricing(s.dispatcher).comm_buffer(model, b, dsp, s.ep, s.etp, te))
    if s.cp > 1:  # two key/value chunks in flight around the CP ring
        heads, k_dim, v_dim = attention_pricing(model).kv_exchange(model)
        kv = heads * (k_dim + v_dim)
        out.append(("comm.cp.kv_ring", 2 * kv * b / s.tp))
    return tuple(out)


@lru_cache(maxsize=4096)
def _layer_terms(model: ModelSpec, training: TrainingSpec, s: _Shape, is_moe: bool) -> tuple[_Tensor, ...]:
    tensors = _attention_tensors(model, training, s)
    tensors += _moe_tensors(model, training, s) if is_moe else _mlp_tensors(model, training, s)
    return tuple(tensors)


def layer_activation_bytes(model: ModelSpec, training: TrainingSpec, config: ParallelConfig,
                           is_moe: bool) -> tuple[tuple[str, float], ...]:
    """Stored tensors of one decoder layer for one micro-batch on one GPU, by name (bytes).

    Honours selective recompute (dropped tensors are absent) but not 'full' (see :func:`estimate_memory`).
    """
    s = _shape(config)
    modules = frozenset(config.recompute_modules) if config.recompute_granularity == "selective" else _NONE
    tokens = config.micro_batch_size * training.seq_length / config.cp
    return tuple((name, v * tokens) for name, v, drop in _layer_terms(model, training, s, is_moe)
                 if not drop & modules)


def offloaded_layer_bytes(model: ModelSpec, training: TrainingSpec, config: ParallelConfig) -> tuple[float, float]:
    """Bytes one dense and one MoE decoder layer send to the CPU per micro-batch on one GPU under
    ``config.activation_offload_modules`` (the stored tensors those modules hold, as recomputing them would
    drop; each goes to the host in forward and comes back in backward). (0, 0) without activation offload."""
    offloaded = frozenset(config.activation_offload_modules)
    if not offloaded:
        return 0.0, 0.0
    s = _shape(config)
    tokens = config.micro_batch_size * training.seq_length / config.cp
    return tuple(tokens * sum(v for _, v, drop in _layer_terms(model, training, s, is_moe) if drop & offloaded)
                 for is_moe in (False, True))


def _shape(config: ParallelConfig) -> _Shape:
    return _Shape(config.tp, config.cp, config.ep, config.etp, bool(config.sequence_parallel),
                  config.moe_token_dispatcher_type)


# ---- cached pieces: per-kind terms, stage layouts, stage parameters --------------------------------
class _KindTerms(NamedTuple):
    """Per-token bytes of the two layer kinds for one (layout shape, selective modules), plus stage extras."""

    names: tuple[str, ...]  # stored-tensor names of both kinds, dense-layer names first
    dense: tuple[float, ...]  # stored bytes/token of a dense layer, aligned with names (0 where absent)
    moe: tuple[float, ...]
    stored_dense: float
    stored_moe: float
    layer_input: float  # what a fully recomputed layer keeps
    work_selective_dense: float  # backward working set of a stored layer (remat of dropped modules + grads)
    work_selective_moe: float
    work_full_dense: float  # ... of a fully recomputed layer (whole layer rematerialised + grads)
    work_full_moe: float
    comm_dense: tuple[str, float]  # largest per-layer buffer of a stage without / with MoE layers
    comm_moe: tuple[str, float]
    pp_buffer: float
    head_input: float  # final-norm and output-layer inputs (last stage)
    head_blocks: tuple[tuple[str, float], ...]  # (feature name, stored bytes of its blocks) (last stage)
    logits: float  # per token: the output layer + loss (costmodel.loss.loss_memory_terms)
    embedding_mask: float  # embedding dropout mask (first stage)
    loss_fixed: FusedLoss | None  # the executor's loss's token-dependent part (costmodel.loss)


def _largest(comm: tuple[tuple[str, float], ...]) -> tuple[str, float]:
    return max(comm, key=lambda c: c[1], default=("comm.none", 0.0))


def _kind_terms(model: ModelSpec, training: TrainingSpec, s: _Shape, modules: frozenset[str]) -> _KindTerms:
    """Activation and working-set terms; they depend on TP, SP, ETP and on EP only through EP > 1."""
    b, h = training.activation_bytes, model.hidden_size
    dsp = s.tp if s.sp else 1
    dense_t, moe_t = _layer_terms(model, training, s, False), _layer_terms(model, training, s, True)
    names: list[str] = []
    pattern = moe_pattern(model)
    present = (dense_t if 0 in pattern else ()) + (moe_t if 1 in pattern else ())
    for name, _, _ in present:
        if name not in names:
            names.append(name)

    def aligned(terms: tuple[_Tensor, ...]) -> tuple[float, ...]:
        kept = {name: v for name, v, drop in terms if not drop & modules}
        return tuple(kept.get(name, 0.0) for name in names)

    dense, moe = aligned(dense_t), aligned(moe_t)
    full_dense, full_moe = sum(v for _, v, _ in dense_t), sum(v for _, v, _ in moe_t)
    grad_dense, grad_moe = _gradient_peak(model, training, s, False), _gradient_peak(model, training, s, True)
    layer_input = h * b / dsp
    last_layer = sum(moe) if moe_pattern(model)[-1] else sum(dense)  # what each head block's layer stores
    blocks = tuple((f.name, d * (last_layer + head_pricing(f).activation_bytes(model, training, dsp)))
                   for f, d in head_features(model))
    logits_per_token, loss_fixed = loss_memory_terms(model, training, s.tp)
    return _KindTerms(
        tuple(names), dense, moe, sum(dense), sum(moe), layer_input,
        full_dense - sum(dense) + grad_dense, full_moe - sum(moe) + grad_moe,
        full_dense - layer_input + grad_dense, full_moe - layer_input + grad_moe,
        ("comm.none", 0.0), ("comm.none", 0.0),  # filled per full layout shape by _kind_terms_for
        2 * h * b / dsp, 2 * h * b / dsp, blocks, logits_per_token,
        h * _MASK / dsp if model.hidden_dropout > 0 else 0.0, loss_fixed,
    )


def _kind_terms_for(ctx: _Context, s: _Shape, modules: tuple[str, ...]) -> _KindTerms:
    """:func:`_kind_terms` (shared by every EP > 1 and dispatcher, and by every CP size unless some layers take
    the executor's masked attention path, whose gathered keys scale with CP) plus this shape's buffers."""
    cp = s.cp if masked_layer_share(ctx.model) else 1
    akey = (s.tp, cp, s.sp, s.ep > 1, s.etp, modules)
    acts = ctx.acts.get(akey)
    if acts is None:
        # any dispatcher: the stored tensors do not depend on it, only the comm buffers below do
        canonical = _Shape(s.tp, cp, 2 if s.ep > 1 else 1, s.etp, s.sp, DEFAULT_DISPATCHER)
        acts = ctx.acts[akey] = _kind_terms(ctx.model, ctx.training, canonical, frozenset(modules))
    comm = ctx.comms.get(s)
    if comm is None:
        comm = ctx.comms[s] = (_largest(_comm_per_token(ctx.model, ctx.training, s, False)),
                               _largest(_comm_per_token(ctx.model, ctx.training, s, True)))
    return acts._replace(comm_dense=comm[0], comm_moe=comm[1])


class _StageLayout(NamedTuple):
    """Layer kinds of one pipeline rank, split into stored and fully recomputed layers."""

    stage: int
    stored_dense: int
    stored_moe: int
    recomputed_dense: int
    recomputed_moe: int
    first: bool
    last: bool
    has_moe: bool
    cap: int  # chunk-micro-batches in flight given enough micro-batches (Megatron's warm-up + 1)
    # decoder layers of each of the rank's virtual chunks when they differ (None: equal chunks)
    chunk_sizes: tuple[int, ...] | None = None
    # in_flight_chunk_equivalents at the cap: the rank's chunk-micro-batches when the step has enough of them
    at_cap: float = 0.0


def in_flight_chunk_equivalents(lay: _StageLayout, n: float, pp: int, vpp: int) -> float:
    """The ``n`` chunk-micro-batches a rank holds at its peak, as a count of average chunks of the rank.

    Each holds ``1/vpp`` of the rank's layers when its chunks are equal. When they are not (Megatron's
    placement options, or layers % (pp·vpp) != 0), the warm-up forwards in flight are those of Megatron's
    order, chunk ``(k // pp) % vpp`` for the k-th: their layers, over the rank's mean layers per chunk.
    """
    sizes = lay.chunk_sizes
    if sizes is None or vpp == 1:
        return n
    layers = sum(sizes)
    if layers == 0:
        return n
    whole = int(n)
    cycles, rest = divmod(whole, pp * vpp)
    held = cycles * pp * layers + pp * sum(sizes[:rest // pp])
    if rest // pp < vpp:
        held += (rest % pp) * sizes[rest // pp]
    return held * vpp / layers


def _stage_layout(model: ModelSpec, pp: int, vpp: int, full_layers: int, stage: int,
                  split: PipelineSplit) -> _StageLayout:
    """Layer kinds of rank ``stage``; ``full_layers`` is -1 without full recompute, 0 for all layers of a chunk."""
    pattern = moe_pattern(model)
    counts = [0, 0, 0, 0]  # stored dense, stored moe, recomputed dense, recomputed moe
    for chunk in layer_chunks(model.num_layers, pp, vpp, split)[stage]:
        for pos, layer in enumerate(chunk):
            recomputed = full_layers == 0 or pos < full_layers
            counts[2 * recomputed + pattern[layer]] += 1
    last = stage == pp - 1
    has_moe = counts[1] + counts[3] > 0 or (last and head_blocks(model) > 0 and bool(pattern[-1]))
    sizes = tuple(len(chunk) for chunk in layer_chunks(model.num_layers, pp, vpp, split)[stage])
    cap = in_flight_micro_batches(pp, vpp, stage, 1 << 62)
    lay = _StageLayout(stage, *counts, stage == 0, last, has_moe, cap, sizes if len(set(sizes)) > 1 else None)
    return lay._replace(at_cap=cap if lay.chunk_sizes is None else in_flight_chunk_equivalents(lay, cap, pp, vpp))


def _param_entries(ctx: _Context, stages: tuple[tuple, ...]) -> tuple[tuple, ...]:
    """(counts, fp8 GEMM weights, weight bytes, grad bytes, dense count, expert count) per candidate rank."""
    extra = ctx.fp8_weight_extra
    return tuple((p, gemm, p.total * ctx.weight_bytes + (gemm * extra if extra else 0), p.total * ctx.grad_bytes,
                  p.dense, p.expert) for p, gemm in stages)


@per_model_cache
def _candidate_stages(model: ModelSpec, pp: int, vpp: int, split: PipelineSplit) -> tuple[int, ...]:
    """Pipeline ranks that can be the most loaded: first, last, and middle ranks not dominated by an earlier one.

    Earlier ranks hold at least as many micro-batches in flight, so a middle rank with no more dense and
    no more MoE layers than an earlier middle rank cannot hold more bytes. Under Megatron's placement options
    a rank's chunks may differ, and which chunks are in flight decides its bytes: every rank is a candidate.
    """
    if not split.is_default:
        return tuple(range(pp))
    pattern = moe_pattern(model)
    chunks = layer_chunks(model.num_layers, pp, vpp, split)
    kept: list[tuple[int, int, int]] = []
    for i in range(1, pp - 1):
        layers = [j for chunk in chunks[i] for j in chunk]
        moe = sum(pattern[j] for j in layers)
        dense = len(layers) - moe
        if not any(d >= dense and m >= moe for _, d, m in kept):
            kept.append((i, dense, moe))
    return tuple(sorted({0, pp - 1, *(i for i, _, _ in kept)}))


def in_flight_micro_batches(pp: int, vpp: int, stage: int, num_micro_batches: int) -> int:
    """Chunk-micro-batches whose activations pipeline rank ``stage`` holds at its peak (start of steady state).

    1F1B: ``min(PP − i, m)``. Interleaved: Megatron's warm-up ``2·(PP − i − 1) + (VPP − 1)·PP`` plus the
    one in steady state, capped at ``m·VPP``; each holds ``1/VPP`` of the rank's layers.
    """
    if vpp == 1:
        return min(pp - stage, num_micro_batches)
    return min(2 * (pp - stage - 1) + (vpp - 1) * pp + 1, num_micro_batches * vpp)


class _Context:
    """Per (model, training): byte widths and the caches of the pieces above, keyed on small int tuples.

    A sweep calls with the same spec objects, so an identity check replaces re-hashing the (large)
    frozen specs on every call.
    """

    __slots__ = ("model", "training", "weight_bytes", "grad_bytes", "fp8_weight_extra", "kinds", "acts",
                 "layouts", "params", "seq", "rows", "comms", "statics", "losses", "least", "wgrads")

    def __init__(self, model: ModelSpec, training: TrainingSpec) -> None:
        self.model, self.training = model, training
        self.weight_bytes = training.param_bytes
        self.grad_bytes = _FP32 if training.main_grads_fp32 else training.param_bytes
        # bytes per GEMM weight beyond its param_bytes copy: the fp8 forms (costmodel.fp8_storage)
        self.fp8_weight_extra = fp8_weight_extra_bytes(training)
        self.seq = training.seq_length
        self.kinds: dict[tuple, _KindTerms] = {}
        self.acts: dict[tuple, _KindTerms] = {}
        self.layouts: dict[tuple[int, int, int], tuple[_StageLayout, ...]] = {}
        self.params: dict[tuple[int, ...], tuple[tuple, ...]] = {}
        self.rows: dict[tuple, tuple[_Row, ...]] = {}
        self.comms: dict[_Shape, tuple] = {}
        # per-row (static bytes, reduction peak) per parameter layout and sharding / overlap switches (_prepare)
        self.statics: dict[tuple, tuple[tuple[float, float], ...]] = {}
        self.losses: dict[tuple, tuple[float, float]] = {}  # the loss's _loss_split per (its terms, tokens)
        self.least: dict[tuple, float] = {}  # LayoutMemory.least_bytes before the workspace, per parameter layout
        self.wgrads: dict[tuple[int, int], float] = {}  # expert_weight_grad_bytes per (EP, ETP)


# The (model, training) objects of the last call and their context, replaced as one tuple so that a reader
# in another thread always sees a consistent triple.
_last: tuple = (None, None, None)


@lru_cache(maxsize=64)
def _cached_context(model: ModelSpec, training: TrainingSpec) -> _Context:
    return _Context(model, training)


def _context(model: ModelSpec, training: TrainingSpec) -> _Context:
    global _last
    last_model, last_training, ctx = _last
    if last_model is model and last_training is training:
        return ctx
    ctx = _cached_context(model, training)  # equal specs (even distinct objects) share one context
    _last = (model, training, ctx)
    return ctx


# One candidate rank of one layout shape, reduced to what the per-call total needs (a plain tuple, built
# ~10⁵ times per planner sweep):
#   total = static + ob · (dense_states / (DP·CP) + expert_states / EDP)
#           + tokens · (n · per_chunk_mb + once) · (1 + FRAGMENTATION),   n = min(cap, m · VPP)
# fields: static (weight + grad bytes), dense_states, expert_states (optimizer elements before sharding: times
# the layout's optimizer_state_bytes),
# per_chunk_mb (stored activations per in-flight chunk-micro-batch per token, embedding extras included),
# once (per token: last-stage tensors + logits + buffers + working set), cap, layout, params entry,
# act_once, logits, comm, work (per token, for the breakdown), loss_fixed (the last stage's blocked loss, whose
# block and weight gradient do not scale with the tokens: added per call, see _loss_fixed), at_cap (n at the
# cap, in average chunks of the rank: in_flight_chunk_equivalents of cap, computed once per row), expert_wgrad
# (bytes: expert_weight_grad_bytes on a rank with MoE layers, else 0; alive in a MoE layer's backward, after the
# loss's bytes are freed, so it adds only what exceeds them).
_Row = tuple


def _stage_parts(ctx: _Context, config: ParallelConfig, full: int, only_stage: int | None) -> tuple[tuple, tuple]:
    """The candidate ranks' stage layouts and parameter entries (cached per placement unless ``only_stage``)."""
    model = ctx.model
    tp, pp, vpp, ep, etp = config.tp, config.pp, config.vpp, config.ep, config.etp
    split = config.pipeline_split
    if only_stage is not None:
        return ((_stage_layout(model, pp, vpp, full, only_stage, split),),
                _param_entries(ctx, (stage_counts_and_gemm(model, tp, pp, vpp, ep, etp, only_stage, split),)))
    skey = None if split is DEFAULT_SPLIT else split  # the usual case: hashing None is cheaper
    lkey = (pp, vpp, full, skey)
    layouts = ctx.layouts.get(lkey)
    if layouts is None:
        layouts = ctx.layouts[lkey] = tuple(_stage_layout(model, pp, vpp, full, stage, split)
                                            for stage in _candidate_stages(model, pp, vpp, split))
    pkey = (tp, pp, vpp, ep, etp, skey)
    params = ctx.params.get(pkey)
    if params is None:
        params = ctx.params[pkey] = _param_entries(ctx, tuple(
            stage_counts_and_gemm(model, tp, pp, vpp, ep, etp, stage, split)
            for stage in _candidate_stages(model, pp, vpp, split)))
    return layouts, params


def _rows(ctx: _Context, k: _KindTerms, config: ParallelConfig, layouts: tuple, params: tuple) -> tuple[_Row, ...]:
    pp, vpp = config.pp, config.vpp
    (_, _, _, stored_dense, stored_moe, layer_input, work_sd, work_sm, work_fd, work_fm, comm_dense, comm_moe,
     pp_buffer, head_input, blocks, logits_tok, embedding_mask, loss_fixed) = k
    blocks_bytes = sum(v for _, v in blocks)
    if pp == 1:
        pp_buffer = 0.0
    wkey = (config.ep, config.etp)
    wgrad = ctx.wgrads.get(wkey)
    if wgrad is None:  # per (EP, ETP): a sweep builds rows for ~10^5 layouts, hashing the specs would cost
        wgrad = ctx.wgrads[wkey] = expert_weight_grad_bytes(ctx.model, ctx.training, *wkey)
    rows = []
    for lay, par in zip(layouts, params):
        _, sd, sm, rd, rm, first, last, has_moe, cap, _, at_cap = lay
        per_chunk = (sd * stored_dense + sm * stored_moe + (rd + rm) * layer_input) / vpp
        if first:
            per_chunk += embedding_mask / vpp
        act_once = head_input + blocks_bytes if last else 0.0
        logits = logits_tok if last else 0.0
        work = 0.0
        if sd:
            work = work_sd
        if sm and work_sm > work:
            work = work_sm
        if rd and work_fd > work:
            work = work_fd
        if rm and work_fm > work:
            work = work_fm
        comm = (comm_moe[1] if has_moe else comm_dense[1]) + pp_buffer
        rows.append((par[2] + par[3], par[4], par[5], per_chunk, act_once + logits + comm + work, cap,
                     lay, par, act_once, logits, comm, work, loss_fixed if last else None, at_cap,
                     wgrad if has_moe else 0.0))
    return tuple(rows)


def optimizer_state_bytes(training: TrainingSpec, config: ParallelConfig) -> int:
    """Bytes of Adam state per parameter (before sharding) of ``config``: the two moments and, unless the weights
    are fp32 (their own master weights), the master weights, each in the layout's dtype
    (``spec.optimizer_dtypes``): 12 for the classic fp32 recipe, 8 for bf16 moments."""
    return state_bytes(config.optimizer_dtypes, training.param_bytes == _FP32)


def _narrow_temp_blocks(config: ParallelConfig) -> int:
    """fp32 blocks the blocked step of a precision-aware unit holds at once (0 when every state is fp32)."""
    return sum(OPT_NARROW_STATE_TEMP_BLOCKS[d] for d in config.optimizer_dtypes)


def fragmentation_of(cluster: ClusterSpec) -> float:
    """The allocator's share of the dynamic bytes on ``cluster``: measured by its profile, else the prior."""
    measured = cluster.hardware.allocator_fragmentation
    return FRAGMENTATION if measured is None else measured


def _evaluate(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, only_stage: int | None,
              frag: float = FRAGMENTATION):
    """Totals of the candidate ranks (or of ``only_stage``); returns the largest with what details need."""
    ctx = _context(model, training)
    kkey, rows, statics, shards = _prepare(ctx, config, only_stage)
    mbs, cp = config.micro_batch_size, config.cp
    tokens = mbs * ctx.seq / cp
    mv = (training.global_batch_size // (mbs * shards[6]) or 1) * config.vpp
    best, best_total = _peak(rows, statics, mv, tokens * (1.0 + frag), _loss_bytes(ctx, rows, tokens, frag),
                             config.pp, config.vpp)
    return ctx, kkey, rows[best], best_total, mv, tokens, shards[:6]


def _prepare(ctx: _Context, config: ParallelConfig, only_stage: int | None) -> tuple:
    """What every micro-batch size of ``config`` shares: the kind-terms key, the candidate ranks' rows, their
    (static bytes, gradient-reduction peak) and the shards (dense, expert, the two state growths, the kept share
    of the Adam states, the Adam state bytes per parameter, DP)."""
    granularity = config.recompute_granularity
    kkey, rows, full = _rows_for(ctx, config, granularity, config.recompute_modules, config.recompute_num_layers,
                                 config.activation_offload_modules, only_stage)
    # rows hold their rank's stage layout and parameter entry (the same objects _stage_parts gives)
    stages = (tuple(row[6] for row in rows), tuple(row[7] for row in rows))
    statics, shards = _statics_for(ctx, config, *stages, full, config.use_distributed_optimizer,
                                   config.overlap_grad_reduce, config.overlap_param_gather,
                                   config.optimizer_cpu_offload_fraction, only_stage is None,
                                   optimizer_state_bytes(ctx.training, config), _narrow_temp_blocks(config),
                                   config.use_precision_aware_optimizer)
    return kkey, rows, statics, shards


def _rows_for(ctx: _Context, layout: ParallelConfig, granularity: str, modules: tuple[str, ...], num_layers: int | None,
              offloaded: tuple[str, ...], only_stage: int | None, keep: bool = True,
              parts: Callable[[int], tuple[tuple, tuple]] | None = None) -> tuple[tuple, tuple[_Row, ...], int]:
    """The kind-terms key, the rows of the candidate ranks (cached unless ``only_stage``; looked up but not
    stored unless ``keep``) and the full-recompute layer count (-1 without) of ``layout`` (its parallel sizes,
    dispatcher and placement) with this recompute and these activation-offloaded modules. ``parts(full)``, when
    given, returns the candidate ranks' :func:`_stage_parts` (a caller's cache of them)."""
    modules = modules if granularity == "selective" else ()
    # an offloaded module's stored tensors leave the GPU as a recomputed module's do, and come back for its
    # backward (the same working set); the validity rules keep the two sets apart
    modules += offloaded
    full = num_layers if granularity == "full" else -1
    kkey = (layout.tp, layout.cp, layout.ep, layout.etp, layout.sequence_parallel, layout.moe_token_dispatcher_type,
            modules)
    split = layout.pipeline_split
    rkey = (kkey, layout.pp, layout.vpp, full, None if split is DEFAULT_SPLIT else split)
    rows = ctx.rows.get(rkey) if only_stage is None else None
    if rows is None:
        k = ctx.kinds.get(kkey)
        if k is None:
            k = ctx.kinds[kkey] = _kind_terms_for(ctx, _Shape(*kkey[:6]), modules)
        rows = _rows(ctx, k, layout, *(_stage_parts(ctx, layout, full, only_stage) if parts is None else parts(full)))
        if only_stage is None and keep:
            ctx.rows[rkey] = rows
    return kkey, rows, full


def _statics_for(ctx: _Context, layout: ParallelConfig, layouts: tuple, params: tuple, full: int, distributed: bool,
                 overlap_grad_reduce: bool, overlap_param_gather: bool, offload_fraction: float,
                 cache: bool, ob: int, narrow_blocks: int = 0,
                 precision_aware: bool = False) -> tuple[tuple, tuple]:
    """Per candidate rank (static bytes: weights, grads and the GPU's share of the sharded optimizer states; the
    gradient-reduction peak) and the shards (dense, expert, the two state growths, the share of the Adam states
    kept on the GPU, ``ob``, DP) of ``layout`` with these optimizer switches, optimizer CPU offload fraction and
    ``ob`` bytes of Adam state per parameter (:func:`optimizer_state_bytes`; ``narrow_blocks``: the fp32 blocks
    its step widens at once, :func:`_narrow_temp_blocks`; ``precision_aware``: Megatron's precision-aware
    optimizer, ``ParallelConfig.use_precision_aware_optimizer``), from the ranks' stage layouts and parameter entries
    (:func:`_stage_parts`)."""
    tp, cp, pp, ep, etp = layout.tp, layout.cp, layout.pp, layout.ep, layout.etp
    world = layout.world_size
    dp = world // (tp * cp * pp)
    if distributed:
        dense_shard, expert_shard = dp * cp, world // (etp * ep * pp)
    else:
        dense_shard = expert_shard = 1
    # The executor keeps each reduced fp32 gradient shard next to the Adam states (distributed optimizer, a
    # group of two or more: the reduce-scatter's output). A one-member group's shard is a view of the
    # bucket's gradient buffer, already counted in grads: nothing more (16-bit weights; fp32 weights, which
    # have no buffer, keep a flat copy that is not counted, see docs/memory-model.md, "Known gaps").
    # Megatron-Core's distributed optimizer reduce-scatters in place in its grad buffer and reads its shard as a
    # view (DistributedOptimizer._copy_model_grads_to_main_grads): nothing kept beside the Adam states; what its
    # step copies with 16-bit grads is the step's transient (_reduce_peak).
    grown = 1.0 if ctx.training.megatron_memory else (ob + _FP32) / ob
    ds = grown if distributed and dense_shard > 1 else 1.0
    es = grown if distributed and expert_shard > 1 else 1.0
    # optimizer CPU offload: that share of the Adam states leaves the GPU (the reduced gradient shard stays)
    keep = 1.0 - offload_fraction
    dkeep, ekeep = ds - 1.0 + keep, es - 1.0 + keep
    shards = (dense_shard, expert_shard, ds, es, keep, ob, dp)
    # the static bytes and the reduction peak depend on the rank's parameters (the same for every recompute
    # option and dispatcher) and, with fp32 weights only, on its stored layers (full recompute)
    switches = (dense_shard, expert_shard, distributed, overlap_grad_reduce, overlap_param_gather, narrow_blocks,
                precision_aware)
    split = layout.pipeline_split
    skey = (tp, layout.pp, layout.vpp, ep, etp, None if split is DEFAULT_SPLIT else split,
            full if ctx.weight_bytes == _FP32 else None,
            switches, offload_fraction, ob)
    statics = ctx.statics.get(skey) if cache else None
    if statics is None:
        # the same operations as a row's static total: (weights + grads) + states / shards
        statics = tuple(((par[2] + par[3]) + ob * par[4] / dense_shard * dkeep + ob * par[5] / expert_shard * ekeep,
                         _reduce_peak(ctx, tp, ep, etp, switches, par, lay)) for lay, par in zip(layouts, params))
        if cache:
            ctx.statics[skey] = statics
    return statics, shards


def _loss_split(fixed, tokens: float) -> tuple[float, float]:
    """(bytes of the executor's loss held beside its last stage's layer work, its kept logits), before
    fragmentation. With one output head the kept logits live from the loss's forward to its backward, between
    the stage's last layer's forward and its backward: they never meet a layer's backward working set nor its
    communication buffers, so only what exceeds those adds to the stage's peak (:func:`_peak`). With MTP heads
    the main head's logits are still kept while each MTP depth's decoder layer runs its backward: held."""
    parts = _loss_fixed(fixed, tokens)
    if parts.kept and fixed.heads == 1:
        return parts.block + parts.weight_grad, parts.held
    return parts.block + parts.held + parts.weight_grad, 0.0


def _loss_bytes(ctx: _Context, rows: tuple[_Row, ...], tokens: float, frag: float) -> tuple[float, float]:
    """The executor's loss's token-dependent bytes (with fragmentation): (held beside the layer work, kept
    logits; :func:`_loss_split`), the same for every row that has them (the last rank's); zeros when no row
    has them."""
    for row in rows:
        if row[12] is not None:
            lkey = (row[12], tokens)
            split = ctx.losses.get(lkey)
            if split is None:
                split = ctx.losses[lkey] = _loss_split(row[12], tokens)
            return split[0] * (1.0 + frag), split[1] * (1.0 + frag)
    return 0.0, 0.0


def _peak(rows: tuple[_Row, ...], statics: tuple[tuple[float, float], ...], mv: int, scale: float,
          loss: tuple[float, float], pp: int, vpp: int) -> tuple[int, float]:
    """(index, bytes) of the most loaded candidate rank at ``mv`` chunk-micro-batches a step and ``scale`` (tokens
    a micro-batch times 1 + fragmentation): its static bytes plus the larger of its dynamic bytes and its
    gradient-reduction peak. Both the breakdown and the planner's sweep (:class:`LayoutMemory`) use it."""
    best, best_total = 0, -1.0
    for i, (row, (static, reduce)) in enumerate(zip(rows, statics)):
        if mv < row[5]:  # fewer chunk-micro-batches in the step than the rank could hold
            n = mv if row[6].chunk_sizes is None else in_flight_chunk_equivalents(row[6], mv, pp, vpp)
        else:
            n = row[13]
        dynamic = (n * row[3] + row[4]) * scale
        held = row[9] * scale  # the loss's bytes, which the experts' weight-gradient peak comes after
        if row[12] is not None:
            # kept logits: only what exceeds the layer work they never meet (_loss_split)
            extra = loss[0] + max(0.0, loss[1] - (row[10] + row[11]) * scale)
            dynamic += extra
            held += extra
        if row[14] > held:
            dynamic += row[14] - held
        total = static + (dynamic if dynamic > reduce else reduce)
        if total > best_total:
            best, best_total = i, total
    return best, best_total


class LayoutMemory:
    """:func:`peak_memory_bytes` of the configs of one layout that differ only in micro-batch size, recompute,
    optimizer and offload fields (the precision-aware optimizer's dtypes included): what they share is looked up
    once per option, so each call costs a few float operations.

    ``layout`` gives every other field (parallel sizes, dispatcher, pipeline placement). ``peak_bytes(mbs,
    knobs)`` is the peak of ``layout`` with micro-batch size ``mbs`` and the recompute, optimizer and offload
    fields of ``knobs`` (recompute_granularity, recompute_modules, recompute_num_layers,
    activation_offload_modules, use_distributed_optimizer, overlap_grad_reduce, overlap_param_gather,
    optimizer_cpu_offload_fraction, exp_avg_dtype, exp_avg_sq_dtype, main_params_dtype); it equals ``peak_memory_bytes`` of that config to the bit (the same rows,
    static parts and :func:`_peak`). Activation offload changes the rows as recompute does, the optimizer
    offload fraction the static bytes. ``knobs`` objects are cached by identity: pass the same few.
    """

    __slots__ = ("_ctx", "_layout", "_frag", "_workspace", "_variants", "_recomputes", "_optimizers", "_losses", "_cp",
                 "_pp", "_vpp", "_seq", "_gbs", "_dp", "_parts")

    def __init__(self, model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec,
                 layout: ParallelConfig) -> None:
        self._ctx = _context(model, training)
        self._layout = layout
        self._frag = fragmentation_of(cluster)
        self._workspace = library_workspace_bytes(cluster.gpu.name)
        self._variants: dict[int, tuple] = {}  # id(knobs) -> (rows, statics, losses by mbs, knobs)
        # (granularity, modules, layers, offloaded modules) -> (rows, full, losses)
        self._recomputes: dict[tuple, tuple] = {}
        self._optimizers: dict[tuple, tuple] = {}  # (optimizer switches, offload fraction, full) -> statics
        self._losses: dict[tuple | None, dict[int, tuple[float, float]]] = {}  # loss terms -> bytes per mbs
        # full-recompute layer count (-1 without) -> the candidate ranks' stage parts: the rows of every recompute
        # option and the static bytes of every optimizer option read them (a context lookup each, otherwise)
        self._parts: dict[int, tuple[tuple, tuple]] = {}
        self._cp, self._pp, self._vpp = layout.cp, layout.pp, layout.vpp
        self._seq, self._gbs = self._ctx.seq, training.global_batch_size
        self._dp = layout.world_size // (layout.tp * layout.cp * layout.pp)

    @staticmethod
    def key(config: ParallelConfig) -> tuple:
        """The fields of ``config`` the memory model reads besides micro-batch size, recompute, optimizer and
        offload: configs with equal keys (e.g. EP all-to-all overlap on and off) have equal peaks, so one
        LayoutMemory serves them."""
        return (config.world_size, config.tp, config.cp, config.pp, config.vpp, config.ep, config.etp,
                config.sequence_parallel, config.moe_token_dispatcher_type, config.pipeline_split)

    def _variant(self, knobs: ParallelConfig) -> tuple:
        rkey = (knobs.recompute_granularity, knobs.recompute_modules, knobs.recompute_num_layers,
                knobs.activation_offload_modules)
        rec = self._recomputes.get(rkey)
        if rec is None:
            # not kept in the context: a sweep meets each layout once, and 10^5 cached rows only cost memory
            _, rows, full = _rows_for(self._ctx, self._layout, *rkey, None, keep=False, parts=self._stage_parts)
            # the loss's bytes per micro-batch size: shared by the recompute options whose rows carry equal
            # loss terms (the loss does not depend on recomputation, so in practice all of them)
            terms = next((row[12] for row in rows if row[12] is not None), None)
            losses = self._losses.get(terms)
            if losses is None:
                losses = self._losses[terms] = {}
            rec = self._recomputes[rkey] = (rows, full, losses)
        rows, full, losses = rec
        okey = (knobs.use_distributed_optimizer, knobs.overlap_grad_reduce, knobs.overlap_param_gather,
                knobs.optimizer_cpu_offload_fraction, optimizer_state_bytes(self._ctx.training, knobs),
                _narrow_temp_blocks(knobs), knobs.use_precision_aware_optimizer,
                full if self._ctx.weight_bytes == _FP32 else None)
        statics = self._optimizers.get(okey)
        if statics is None:
            statics = self._optimizers[okey] = self._statics(okey, full)
        # knobs is kept so that its id is not reused while the entry lives
        v = self._variants[id(knobs)] = (rows, statics, losses, knobs)
        return v

    def _stage_parts(self, full: int) -> tuple[tuple, tuple]:
        parts = self._parts.get(full)
        if parts is None:
            parts = self._parts[full] = _stage_parts(self._ctx, self._layout, full, None)
        return parts

    def _statics(self, okey: tuple, full: int) -> tuple:
        return _statics_for(self._ctx, self._layout, *self._stage_parts(full), full, *okey[:4], True, *okey[4:7])[0]

    def least_bytes(self, knobs: ParallelConfig) -> float:
        """A lower bound (bytes) on :meth:`peak_bytes` at every micro-batch size and recompute option with the
        optimizer fields (offload fraction included) of ``knobs`` and any activation offload: the weights, grads
        and the GPU's optimizer states of the most loaded candidate rank plus its gradient-reduction peak (16-bit
        weights: the same for any recompute; fp32 weights: without it).
        A layout whose bound exceeds the usable memory fits at no micro-batch size and no recompute."""
        okey = (knobs.use_distributed_optimizer, knobs.overlap_grad_reduce, knobs.overlap_param_gather,
                knobs.optimizer_cpu_offload_fraction, optimizer_state_bytes(self._ctx.training, knobs),
                _narrow_temp_blocks(knobs), knobs.use_precision_aware_optimizer, None)
        # the same for every CP size and dispatcher of the parameter layout (DP·CP is fixed by tp and pp)
        lay = self._layout
        split = lay.pipeline_split
        key = (lay.world_size, lay.tp, lay.pp, lay.vpp, lay.ep, lay.etp, None if split is DEFAULT_SPLIT else split,
               okey)
        least = self._ctx.least.get(key)
        if least is None:
            statics = self._optimizers.get(okey)
            if statics is None:
                statics = self._optimizers[okey] = self._statics(okey, -1)
            fp32 = self._ctx.weight_bytes == _FP32
            least = self._ctx.least[key] = max([static if fp32 else static + reduce for static, reduce in statics])
        return least + self._workspace

    def peak_bytes(self, mbs: int, knobs: ParallelConfig) -> float:
        """Peak bytes of the most loaded GPU of the layout at ``mbs`` with the fields of ``knobs`` (see the class)."""
        v = self._variants.get(id(knobs))
        if v is None:
            v = self._variant(knobs)
        rows, statics, losses = v[0], v[1], v[2]
        tokens = mbs * self._seq / self._cp
        loss = losses.get(mbs)
        if loss is None:
            loss = losses[mbs] = _loss_bytes(self._ctx, rows, tokens, self._frag)
        mv = (self._gbs // (mbs * self._dp) or 1) * self._vpp
        return _peak(rows, statics, mv, tokens * (1.0 + self._frag), loss, self._pp, self._vpp)[1] + self._workspace


@lru_cache(maxsize=256)
def _tensor_split(model: ModelSpec, tp: int, ep: int, etp: int, bucket: float) -> tuple[float, ...]:
    """Elements of the executor's parameter tensors on one GPU: those that share a gradient bucket with others
    (no larger than a bucket of ``bucket`` elements) per dense layer, MoE layer, first-stage and last-stage
    extras; then the largest dense tensor and the largest expert tensor. A tensor larger than a bucket is a
    bucket alone, whose flat gradient is a view of the tensor's own gradient (no copy; fp32 weights only,
    16-bit ones reduce in their buffer)."""
    h = model.hidden_size
    attention = attention_pricing(model).param_tensors(model, tp) + [h]  # + the pre-MLP norm
    mlp = _mlp_param_tensors(model, model.ffn_hidden_size / tp)
    router = [(model.num_experts or 0) * h] + ([model.num_experts or 0] if model.add_bias_linear else [])
    experts = _expert_param_tensors(model, ep, etp)
    shared = (_mlp_param_tensors(model, model.shared_expert_ffn_hidden_size / tp)
              if model.shared_expert_ffn_hidden_size else [])
    vocab = model.padded_vocab_size(tp) / tp * h
    first, last = [vocab], [h] + ([vocab] if model.untie_embeddings_and_output_weights else [])

    def small(tensors: list[float]) -> float:
        return sum(n for n in tensors if n <= bucket)
    return (small(attention + mlp), small(attention + router + experts + shared), small(first), small(last),
            max(attention + mlp + router + shared + first + last), max(experts, default=0.0))


def _expert_param_tensors(model: ModelSpec, ep: int, etp: int) -> list[float]:
    """Elements of one MoE layer's expert tensors on one GPU: the executor keeps gate and up in one w13 tensor,
    then w2 (and their biases); empty for a dense model."""
    if not model.is_moe:
        return []
    h = model.hidden_size
    local, f = (model.num_experts or 1) / ep, model.expert_ffn_hidden_size / etp
    experts = [2 * local * f * h, local * f * h]
    if model.add_bias_linear:
        experts += [2 * local * f, local * h / etp]
    return experts


def expert_weight_grad_bytes(model: ModelSpec, training: TrainingSpec, ep: int, etp: int) -> float:
    """Bytes of the experts' 16-bit weight gradients that one MoE layer's backward holds at once (0 without MoE).

    Autograd hands a weight its gradient as a new tensor in the weight's dtype; the fp32 main-gradient hook adds
    it in and frees it (executor/parallel/grad_reduce.py). Where the plain torch backend runs GEMM -> SwiGLU -> GEMM
    as one autograd node (executor/grouped_swiglu.py: bf16/fp16, a plain SwiGLU, no biases), that node returns
    the w13 and w2 gradients together, so both are alive before either hook runs; every other path (fp8,
    biases, other activations) makes them in separate nodes, one tensor at a time. The one-node path needs
    ``torch._grouped_mm`` on the device (Hopper in bf16); on other GPUs this over-counts by the smaller tensor
    (the model does not see the GPU here). Measured on 2 × H200
    (Qwen3-30B-A3B proxy, pp2 mbs2; docs/benchmarks.md): the first stage's peak was 1.26 GiB above
    the activations' prediction, its layer's expert weights being 1.125 GiB.
    """
    tensors = _expert_param_tensors(model, ep, etp)
    if not tensors or training.gradient_accumulation_fusion:
        # fused accumulation (Megatron's --gradient-accumulation-fusion: TE's GroupedLinear built with
        # fuse_wgrad_accumulation) writes the weight gradient into the main gradient: no 16-bit tensor
        return 0.0
    one_node = (training.precision != "fp8" and training.param_bytes < _FP32 and not model.add_bias_linear
                and model.swiglu and model.activation_func_clamp_value is None and not model.glu_linear_offset)
    return (sum(tensors) if one_node else max(tensors)) * training.param_bytes


def _mlp_param_tensors(model: ModelSpec, ffn: float) -> list[float]:
    """Elements of a TP-split MLP's parameter tensors (w1, w3, w2; their biases with add_bias_linear)."""
    h = model.hidden_size
    return [ffn * h] * 3 + ([ffn, ffn, h] if model.add_bias_linear else [])


def _reduce_peak(ctx: _Context, tp: int, ep: int, etp: int, switches: tuple, par: tuple,
                 lay: _StageLayout) -> float:
    """Transient bytes of the executor's gradient reduction and Adam step (the alternative to the backward
    peak, whichever is larger): one optimizer unit's temporaries or, with fp32 weights only, the flat copies
    of the gradients of the buckets that hold several tensors (all at once while overlapped reductions are
    in flight, one bucket otherwise). 16-bit weights' fp32 main grads live in per-bucket buffers that are
    reduced in place: no copy. ``switches``: (dense shard, expert shard, distributed optimizer,
    overlap_grad_reduce, overlap_param_gather, fp32 blocks the step of a precision-aware unit widens at once,
    the layout runs Megatron's precision-aware optimizer). Megatron-Core's (``TrainingSpec.megatron_memory``) is
    :func:`_megatron_step_peak`."""
    (dense_shard, expert_shard, distributed, overlap_grad_reduce, overlap_param_gather, narrow_blocks,
     precision_aware) = switches
    if ctx.training.megatron_memory:
        return _megatron_step_peak(ctx.training, ctx.grad_bytes, par[4] / (dense_shard if distributed else 1)
                                   + par[5] / (expert_shard if distributed else 1), precision_aware)
    params = par[4] + par[5]
    elems = EXECUTOR_BUCKET_BYTES / ctx.weight_bytes
    small_dense, small_moe, small_first, small_last, largest_dense, largest_expert = _tensor_split(
        ctx.model, tp, ep, etp, elems)
    flats = 0.0
    if ctx.weight_bytes == _FP32:
        copied = ((lay.stored_dense + lay.recomputed_dense) * small_dense
                  + (lay.stored_moe + lay.recomputed_moe) * small_moe
                  + (small_first if lay.first else 0.0) + (small_last if lay.last else 0.0))
        flats = _FP32 * (copied if overlap_grad_reduce else min(copied, elems))

    def step_of(unit: float, shard: int) -> float:  # one unit's Adam step: the larger of its two moments
        gathered = unit * OPT_WRITE_BACK_PER_BUCKET_ELEMENT if shard > 1 and not overlap_param_gather else 0.0
        widened = narrow_blocks * _FP32 * min(unit / shard, OPT_STATE_BLOCK_ELEMENTS)
        return max(unit / shard * OPT_STEP_TEMP_PER_SHARD_ELEMENT + widened,
                   unit / shard * OPT_WRITE_BACK_PER_SHARD_ELEMENT + gathered)

    if not distributed:
        dense_shard = expert_shard = 1
    # units of dense and expert buckets are sharded over different groups: the worst unit of either kind
    step = max(step_of(min(params, max(elems, largest_dense)), dense_shard),
               step_of(min(params, max(elems, largest_expert)), expert_shard) if largest_expert else 0.0)
    return flats if flats > step else step


def _megatron_step_peak(training: TrainingSpec, grad_bytes: int, shard_params: float,
                        precision_aware: bool) -> float:
    """Transient bytes of Megatron-Core's optimizer step on a rank whose optimizer holds ``shard_params`` elements:
    the fp32 copy of each 16-bit gradient shard it hands Adam (``shard_model_grad.float()`` in
    DistributedOptimizer._copy_model_grads_to_main_grads, every group before the step; the same in
    Float16OptimizerWithFloat16Params without the distributed optimizer), none with fp32 grads (a view), nor where
    the precision-aware optimizer reads the 16-bit shard itself (``decoupled_grad``: without fp8, with delayed
    scaling, OptimizerConfig.use_precision_aware_optimizer_no_fp8_or_ds_fp8; ``precision_aware``: the layout's
    ``ParallelConfig.use_precision_aware_optimizer``). Adam steps in place and the
    updated shard is written into the parameter buffer, which the all-gather fills in place: nothing more."""
    if grad_bytes == _FP32:
        return 0.0
    if precision_aware and (training.precision != "fp8" or training.fp8_recipe == "delayed"):
        return 0.0
    return _FP32 * shard_params


def _breakdown(ctx: _Context, kkey: tuple, row: _Row, mv: int, tokens: float, shards: tuple,
               config: ParallelConfig, workspace: float, frag: float) -> MemoryBreakdown:
    _, dense_states, expert_states, per_chunk, _, cap, lay, par, act_once, logits, comm, work, fixed, _, wgrad = row
    n = min(cap, mv)
    if lay.chunk_sizes is not None:
        n = in_flight_chunk_equivalents(lay, n, config.pp, config.vpp)
    activations = tokens * (n * per_chunk + act_once)
    comm, work = tokens * comm, tokens * work
    loss_held, loss_kept = _loss_split(fixed, tokens)
    logits = tokens * logits + loss_held + max(0.0, loss_kept - (comm + work))  # as _peak
    overhead = work + frag * (activations + logits + comm + work)
    wgrad_excess = max(0.0, wgrad - logits * (1.0 + frag))  # as _peak: what the loss's freed bytes do not cover
    overhead += wgrad_excess
    switches = (shards[0], shards[1], config.use_distributed_optimizer, config.overlap_grad_reduce,
                config.overlap_param_gather, _narrow_temp_blocks(config), config.use_precision_aware_optimizer)
    reduce_excess = max(0.0, _reduce_peak(ctx, config.tp, config.ep, config.etp, switches, par, lay)
                        - (activations + logits + comm + overhead))
    overhead += reduce_excess + workspace
    keep, ob = shards[4], shards[5]
    dense_states, expert_states = ob * dense_states, ob * expert_states  # elements -> bytes
    optimizer = (dense_states / shards[0] * (shards[2] - 1.0 + keep)
                 + expert_states / shards[1] * (shards[3] - 1.0 + keep))
    host = (1.0 - keep) * (dense_states / shards[0] + expert_states / shards[1])
    if config.activation_offload_modules:  # the offloaded tensors: those the recompute modules alone keep
        recomputed = config.recompute_modules if config.recompute_granularity == "selective" else ()
        plain = _kind_terms_for(ctx, _Shape(*kkey[:6]), recomputed)
        k = ctx.kinds[kkey]
        host += tokens * n / config.vpp * (lay.stored_dense * (plain.stored_dense - k.stored_dense)
                                           + lay.stored_moe * (plain.stored_moe - k.stored_moe))
    return MemoryBreakdown(lay.stage, par[2], par[3], optimizer, activations, logits, comm, overhead,
                           host_offloaded=host,
                           details_source=partial(_details, ctx, ctx.kinds[kkey], row, n, tokens, shards,
                                                  config.vpp, reduce_excess, workspace, frag, wgrad_excess))


def _details(ctx: _Context, k: _KindTerms, row: _Row, n: int, tokens: float, shards: tuple,
             vpp: int, reduce_excess: float, workspace: float, frag: float,
             wgrad_excess: float = 0.0) -> tuple[tuple[str, float], ...]:
    """Per-tensor / per-bucket bytes of one evaluated rank (names as in docs/memory-model.md)."""
    _, _, _, per_chunk, _, _, lay, par, act_once, row_logits, row_comm, row_work, fixed, _, _ = row
    p, gemm = par[0], par[1]
    dense_shard, expert_shard, ds, es, keep, ob = shards
    wb, gb, ob = ctx.weight_bytes, ctx.grad_bytes, ob * keep
    x = tokens * n * lay.stored_dense / vpp
    y = tokens * n * lay.stored_moe / vpp
    details: list[tuple[str, float]] = [
        ("weights.dense_tp_sharded", p.dense_tp_sharded * wb), ("weights.dense_replicated", p.dense_replicated * wb),
        ("weights.expert", p.expert * wb),
    ]
    if ctx.fp8_weight_extra:
        details.append(("weights.fp8_copies", ctx.fp8_weight_extra * gemm))
    details += [
        ("grads.dense", p.dense * gb), ("grads.expert", p.expert * gb),
        ("optimizer.dense_tp_sharded", ob * p.dense_tp_sharded / dense_shard),
        ("optimizer.dense_replicated", ob * p.dense_replicated / dense_shard),
        ("optimizer.expert", ob * p.expert / expert_shard),
    ]
    kept = (_FP32 * (p.dense_tp_sharded + p.dense_replicated) / dense_shard if ds > 1.0 else 0.0) + \
        (_FP32 * p.expert / expert_shard if es > 1.0 else 0.0)
    if kept:
        details.append(("optimizer.reduced_grad_shards", kept))
    details += [(name, a * x + c * y) for name, a, c in zip(k.names, k.dense, k.moe) if a * x + c * y]
    recomputed = lay.recomputed_dense + lay.recomputed_moe
    if recomputed:
        details.append(("act.full_recompute.layer_input", tokens * n * recomputed / vpp * k.layer_input))
    if lay.first and k.embedding_mask:
        details.append(("act.embedding.dropout_mask", tokens * n / vpp * k.embedding_mask))
    if lay.last:
        details.append(("act.output.final_norm_and_head_input", tokens * k.head_input))
        details += [(f"act.{name}.blocks", tokens * v) for name, v in k.head_blocks if v]
        if fixed is None:
            details.append(("logits.loss_and_output", tokens * row_logits))
        else:
            block, held, weight_grad, kept = _loss_fixed(fixed, tokens)
            name = "kept_logits" if kept else "input_grad_accumulator"
            if _loss_split(fixed, tokens)[1]:  # kept logits of one head: what exceeds the layer work
                name, held = "kept_logits_beyond_layer_work", max(0.0, held - tokens * (row_comm + row_work))
            details += [("logits.loss_block", block), (f"logits.{name}", held),
                        ("logits.output_weight_grad", weight_grad), ("logits.lse", tokens * row_logits)]
    name, value = k.comm_moe if lay.has_moe else k.comm_dense
    if value:
        details.append((name, tokens * value))
    if row_comm > value:
        details.append(("comm.pp.send_recv", tokens * (row_comm - value)))
    loss_held, loss_kept = _loss_split(fixed, tokens)
    dynamic = (tokens * (n * per_chunk + act_once + row_logits + row_comm + row_work) + loss_held
               + max(0.0, loss_kept - tokens * (row_comm + row_work)))
    details += [("allocator.backward_working_set", tokens * row_work),
                ("allocator.fragmentation", frag * dynamic)]
    if wgrad_excess:
        details.append(("allocator.expert_weight_grads", wgrad_excess))
    if reduce_excess:
        details.append(("allocator.grad_reduce_peak_excess", reduce_excess))
    if workspace:
        details.append(("allocator.cublas_workspace", workspace))
    return tuple(details)


def estimate_stage_memory(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, config: ParallelConfig,
                          stage: int) -> MemoryBreakdown:
    """Memory of one GPU of pipeline rank ``stage`` (bytes), by category with per-tensor details."""
    if not 0 <= stage < config.pp:
        raise InvalidConfigError(f"stage {stage} is outside the pipeline (pp={config.pp})")
    frag = fragmentation_of(cluster)
    ctx, kkey, row, _, mv, tokens, shards = _evaluate(model, training, config, stage, frag)
    return _breakdown(ctx, kkey, row, mv, tokens, shards, config, library_workspace_bytes(cluster.gpu.name), frag)


def estimate_memory(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec,
                    config: ParallelConfig) -> MemoryBreakdown:
    """Memory of the most-loaded GPU of ``config`` (bytes), by category with per-tensor details.

    Evaluates the first and last pipeline ranks and every middle rank that could be the largest
    (see :func:`_candidate_stages`) and returns the one with the largest total. ``cluster`` is not
    needed for the bytes themselves; compare ``total`` with ``cluster.usable_hbm_bytes``.
    """
    frag = fragmentation_of(cluster)
    ctx, kkey, row, _, mv, tokens, shards = _evaluate(model, training, config, None, frag)
    return _breakdown(ctx, kkey, row, mv, tokens, shards, config, library_workspace_bytes(cluster.gpu.name), frag)


def peak_memory_bytes(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, config: ParallelConfig) -> float:
    """``estimate_memory(...).total`` without building the breakdown: the planner's pruning fast path."""
    return _evaluate(model, training, config, None, fragmentation_of(cluster))[3] + library_workspace_bytes(
        cluster.gpu.name)
