"""Time per optimizer step of one folded layout, as a breakdown of exposed terms.

The model works per micro-batch and per layer kind (dense layer, MoE layer, and the extras of the first
and last pipeline stages), sums the layers of each pipeline stage, runs the pipeline schedule over
``m = global_batch_size / (micro_batch_size · dp)`` micro-batches and adds what happens once per step
(gradient reduction, parameter all-gather, optimizer). ``docs/time-model.md`` gives every formula and
where each constant comes from.

Speed: the planner calls :func:`estimate_step_time` for 10^4-10^5 layouts. Everything that depends on a
few fields is cached inside a context per (model, training, cluster) object triple (looked up by
identity): layer parts keyed on the fields each part depends on (attention and TP-side parts on tp, cp,
micro-batch, SP, TP overlap; the routed-expert part on MoE tokens per rank, ep, etp, dispatcher), stage
sums keyed on the layer shape and (pp, vpp, pipeline placement), and the once-per-step collectives keyed on the layout and
the optimizer. No rank group is enumerated: placements come from the named groups' strides in closed form
(:class:`costmodel.comm.GroupPlacements`, :meth:`spec.rank_groups.GridSizes.group`). The per-call path only
combines cached vectors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from operator import add as _add

from costmodel import host as _host
from costmodel.activation import glu_traffic, is_plain_swiglu
from costmodel.attention_pricing import attention_pricing
from costmodel import loss as _loss
from costmodel import params as _params
from costmodel import collective_inventory as _calls
from costmodel.comm import (
    Call,
    GroupPlacements,
    LinkRates,
    Placement,
    call_time,
    group_placement,
    link_rates,
    p2p_time,
    ring_time,
)
from costmodel.compute import (
    ComputeRates,
    attention_time,
    compute_rates,
    gemm_fwd_bwd,
    gemm_time,
    grouped_gemm_fwd_bwd,
    memory_time,
)
from costmodel.context_parallel import cp_attention_time, cp_pricing
from costmodel.dispatch import dispatcher_pricing, sort_bytes
from costmodel.fixed_costs import CP_EXCHANGE, exchange_fixed
from costmodel.head_pricing import head_pricing
from costmodel.layout_keys import (DenseKey, DenseParamsKey, ExpertParamsKey, GemmWeightsKey, GradGroupsKey, HostKey,
                                   LayerKey, RoutedKey, StepStatKey)
from costmodel.memory import OPT_STATE_BLOCK_ELEMENTS, offloaded_layer_bytes
from costmodel.terms import (
    BOTTLENECK_TERMS,
    HIDDEN_TERMS,
    LAYER_SLOT,
    LAYER_TERMS,
    TERM_INDEX,
    TERM_TABLE,
    TERMS,
    term_index,
)
from spec.documents import chunk_pair_share
from spec.errors import InvalidConfigError
from spec.flops import flops_per_step
from spec.fp8_choice import fp8_chosen
from spec.hardware import ClusterSpec
from spec.head_features import HEAD_FEATURES, head_features
from spec.model_spec import ModelSpec
from spec.optimizer_dtypes import OPTIMIZER_DTYPE_BYTES
from spec.parallel_config import ParallelConfig
from spec.pipeline_layout import PipelineSplit, check_placement
from spec.rank_groups import GridSizes, GroupStride
from spec.router_options import RouterOptions
from spec.shape_defaults import is_cpu
from spec.training_spec import TrainingSpec
from spec.validity import experts_ep_rule, seq_cp_rule

# A non-compute limiter is named only when it takes at least this share of the step.
BOTTLENECK_MIN_SHARE = 0.10

# With tp_comm_overlap the TP collectives run under the GEMMs they feed (chunked pipelining); the first
# chunk's transfer stays exposed. Assumption: 1/8 of the TP traffic (8 chunks) at least, more when the
# traffic exceeds the GEMM time it hides behind.
TP_OVERLAP_EXPOSED_FRACTION = 0.125
# Megatron's DDP bucket: max(40M, 1M·dp) parameters; the last bucket's reduction (and the first
# bucket's all-gather) cannot overlap with compute.
BUCKET_PARAMS = 40_000_000
BUCKET_PARAMS_PER_DP = 1_000_000
# Adam step bytes per parameter on this rank: read fp32 grad, master weight, m, v (16); write master,
# m, v (12) and the bf16 model weight (2); the grad-norm for clipping reads the grad again (4).
OPTIMIZER_BYTES_PER_PARAM = 34
# The precision-aware optimizer (executor/optimizer.py, blocked_step): a state kept in d bytes is widened to an
# fp32 block before the same fused kernel (read d, write 4) and narrowed after it (read 4, write d): 2·d + 8
# bytes more per element than an fp32 state, which the kernel updates in place. A scaled state (fp16; fp8 in
# Megatron) is also multiplied by its scale on the way in (read 4, write 4), and on the way out its block's
# largest magnitude is read (4) and the block scaled again (8): 24 more. Each block of OPT_STATE_BLOCK_ELEMENTS
# costs its kernels' launches: per such state 2 (widen, narrow), 7 for a scaled one, and the fused step.
NARROW_STATE_SCALE_BYTES = 24
NARROW_STATE_KERNELS = {"bf16": 2, "fp16": 7, "fp8": 7}
# Megatron's vocab-parallel cross-entropy in fp32 over bf16 logits: bytes of HBM traffic per logit element
# (the executor's blocked loss: costmodel.loss).
LOSS_BYTES_PER_LOGIT_FWD = 8
LOSS_BYTES_PER_LOGIT_BWD = 8
# fp8 quantisation, bytes an element. foldtune's executor (executor/kernels/fp8): a dense linear's input, and in
# backward its output gradient, in both forms at once (rowwise for the forward or dgrad GEMM, transposed for the
# wgrad) from two reads: read 2 + 2, write 1 + 1; the Q, K and V projections each quantise their common input.
# The experts' rows rowwise only, from one read (2 + 1): their wgrad runs in bf16. Every GEMM weight in both
# forms once a step (6 bytes a weight; reused by the step's micro-batches). Transformer Engine
# (TrainingSpec.transformer_engine_fp8): one fused cast-transpose per GEMM input, read 2, write 1 + 1, dense and
# expert inputs alike, and each weight once a step the same way.
FP8_BOTH_FORMS_BYTES = 6
FP8_ROWWISE_BYTES = 3
FP8_TE_CAST_BYTES = 4
# Backward of an elementwise op reads its saved input and the incoming gradient, writes one gradient.
ELEMENTWISE_BWD_RATIO = 2.0
# Every micro-batch's weight gradient is accumulated into the fp32 main gradient (Megatron's recipe without
# gradient-accumulation fusion, as the executor does it): read the 16-bit gradient (2), read and write the
# fp32 main gradient (4 + 4). fp32 weights accumulate into .grad: read both and write one (4 + 4 + 4).
# Paid per weight element held on this rank, per micro-batch: more micro-batches (TP, CP, small mbs) or
# more local weights (EDP > 1 replicas of the experts) cost more, whatever the tokens.
MAIN_GRAD_ACCUM_BYTES = 10
FP32_GRAD_ACCUM_BYTES = 12
# The fp32 main gradients are not zero-filled between steps: the first micro-batch of a step writes its 16-bit
# gradient into them (read 2, write 4) where the others add (10), so a step pays MAIN_GRAD_ACCUM_BYTES -
# MAIN_GRAD_FIRST_BYTES per local weight less than ``m`` adds (executor/parallel/grad_reduce.py: mark_main_grads_stale).
MAIN_GRAD_FIRST_BYTES = 6
_FP32_BYTES = 4
_INT64_BYTES = 8

# Slots of a layer vector (per-micro-batch seconds of one layer kind), from the term table.
N_SLOTS = len(LAYER_TERMS)
GEMM, GROUPED, ATTN, MEM = (LAYER_SLOT[n] for n in ("gemm", "grouped_gemm", "attention_core", "memory_bound"))
TP, CP, A2A, ETP = (LAYER_SLOT[n] for n in ("tp_comm", "cp_comm", "ep_a2a", "etp_comm"))
# the slots of work on the device that communication can overlap with (the layer's window)
_COMPUTE = tuple(LAYER_SLOT[t.name] for t in TERM_TABLE
                 if t.scope == "layer" and t.group in ("compute", "memory_bound"))
# StepTimeBreakdown.terms starts with every term up to the last layer term (the per-micro-batch prefix);
# a layer's contribution to it: its slot, or None where the term is not a layer term (recompute)
_PREFIX_SLOTS = tuple(LAYER_SLOT.get(name) for name in TERMS[:max(TERM_INDEX[n] for n in LAYER_TERMS) + 1])
N_PREFIX = len(_PREFIX_SLOTS)
# positions in StepTimeBreakdown.terms and .hidden the step assembly writes by name
_I_RECOMPUTE, _I_A2A, _I_ETP, _I_BUBBLE = (TERM_INDEX[n] for n in ("recompute", "ep_a2a", "etp_comm", "pp_bubble"))
_I_MEM = TERM_INDEX["memory_bound"]
# the per-micro-batch terms of the rank's own arithmetic (compute and memory-bound groups): what contention slows
_COMPUTE_TERM_INDICES = tuple(TERM_INDEX[t.name] for t in TERM_TABLE
                              if t.scope == "layer" and t.group in ("compute", "memory_bound"))
# the hidden seconds estimate_step_time computes, by name
_HIDDEN_PRICED = ("tp_comm", "cp_comm", "ep_a2a", "dp_grad", "edp_grad", "param_gather", "pp_p2p")
_H_TP, _H_CP, _H_A2A, _H_DP, _H_EDP, _H_GATHER, _H_P2P = (HIDDEN_TERMS.index(n) for n in _HIDDEN_PRICED)
# the terms after the prefix, in the order estimate_step_time appends them
_STEP_TAIL = ("dp_grad", "edp_grad", "param_gather", "pp_p2p", "pp_bubble", "optimizer", "host_overhead")
if TERMS[N_PREFIX:] != _STEP_TAIL or set(HIDDEN_TERMS) != set(_HIDDEN_PRICED):
    raise ImportError("costmodel.terms.TERM_TABLE changed: estimate_step_time must price the new term "
                      f"(after the prefix it appends {_STEP_TAIL}, the table has {TERMS[N_PREFIX:]}; it hides "
                      f"{_HIDDEN_PRICED}, the table has {HIDDEN_TERMS})")
# (bottleneck label, position of its first term, positions of the others), the labels after 'compute' in table order
_LIMITERS = tuple((label, TERM_INDEX[names[0]], tuple(TERM_INDEX[n] for n in names[1:]))
                  for label, names in BOTTLENECK_TERMS.items() if label != "compute")


@dataclass(frozen=True)
class StepTimeBreakdown:
    """Predicted time of one optimizer step and where it goes (all times in seconds)."""

    step_time: float  # seconds per optimizer step
    terms: tuple[tuple[str, float], ...]  # exposed (critical-path) seconds per term, in TERMS order
    hidden: tuple[tuple[str, float], ...]  # communication seconds hidden by overlap, per HIDDEN_TERMS name
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float  # model TFLOP/s per GPU (spec.flops conventions)
    mfu: float  # against cluster.gpu.peak(training.precision)
    bottleneck: str  # 'compute' or the largest non-compute limiter (costmodel.terms: bottleneck column)

    def term(self, name: str) -> float:
        """Exposed seconds of term ``name`` (0.0 for a term this layout does not have)."""
        return dict(self.terms).get(name, 0.0)


# ---- per-layer costs ------------------------------------------------------------------------------
class _Block:
    """Forward and backward seconds per micro-batch of one layer kind, split by term (raw, before overlap)."""

    __slots__ = ("fwd", "bwd", "modules", "a2a_fixed", "skip", "cp_hidden", "fp8_weights", "low_precision_weights")

    def __init__(self) -> None:
        self.fwd = [0.0] * N_SLOTS
        self.bwd = [0.0] * N_SLOTS
        self.modules: dict[str, float] = {}  # recompute module -> forward seconds it re-runs
        # the dispatcher's per-call seconds inside ep_a2a (fwd + bwd): host work and the alltoall's host sync
        # for its split sizes, which EP overlap cannot run beside another micro-batch's compute
        self.a2a_fixed = 0.0
        self.skip = 0.0  # forward seconds full recomputation does not re-run (collective_inventory.recompute_skipped)
        self.cp_hidden = 0.0  # CP exchange seconds (fwd + bwd) a ring's blocks hide (costmodel.context_parallel)
        # GEMM weights of the linears that may run in the training's low precision, and of those priced in fp8:
        # the executor quantises a weight only when its linear runs fp8 (the per-step weight cast's share)
        self.low_precision_weights = 0.0
        self.fp8_weights = 0.0

    def add(self, term: int, fwd: float, bwd: float, module: str | tuple[str, ...] = ()) -> None:
        self.fwd[term] += fwd
        self.bwd[term] += bwd
        for name in (module,) if isinstance(module, str) else module:
            self.modules[name] = self.modules.get(name, 0.0) + fwd


class _LayerCost:
    """One layer kind (or part, or a stage's extras) per micro-batch after in-layer overlap."""

    __slots__ = ("exposed", "hidden", "total", "fwd_total", "compute_fwd", "compute_bwd", "a2a", "modules", "terms",
                 "weights")

    def __init__(self, exposed: tuple[float, ...], hidden: tuple[float, ...], fwd_total: float, compute_fwd: float,
                 compute_bwd: float, a2a: float, modules: dict[str, float],
                 weights: tuple[float, float] = (0.0, 0.0)) -> None:
        self.exposed = exposed  # per-micro-batch seconds per layer slot, forward + backward
        self.hidden = hidden  # communication hidden by in-layer overlap, same slots
        self.total = sum(exposed)
        self.fwd_total = fwd_total  # forward compute + exposed forward communication (full recompute re-runs it)
        self.compute_fwd, self.compute_bwd = compute_fwd, compute_bwd
        # exposed EP all-to-all seconds: what EP overlap hides (the executor's overlap runs the ETP collectives
        # in line, so they stay exposed; Megatron's would hide them too), the dispatcher's per-call cost excluded
        self.a2a = a2a
        self.modules = modules  # recompute module -> forward seconds it re-runs
        # the per-micro-batch prefix of TERMS; terms that are not layer slots (recompute) are 0 here
        self.terms = tuple([0.0 if slot is None else exposed[slot] for slot in _PREFIX_SLOTS])
        self.weights = weights  # (low-precision-eligible GEMM weights, those priced fp8), as _Block's

    def __add__(self, other: _LayerCost) -> _LayerCost:
        # the constructor's work with the same float operations, without its per-field Python loops (a planner
        # sweep adds ~10^5 of these)
        modules = dict(self.modules)
        for name, seconds in other.modules.items():
            modules[name] = modules.get(name, 0.0) + seconds
        out = _new_object(_LayerCost)
        out.exposed = exposed = tuple(map(_add, self.exposed, other.exposed))
        out.hidden = tuple(map(_add, self.hidden, other.hidden))
        out.total = sum(exposed)
        out.fwd_total = self.fwd_total + other.fwd_total
        out.compute_fwd = self.compute_fwd + other.compute_fwd
        out.compute_bwd = self.compute_bwd + other.compute_bwd
        out.a2a = self.a2a + other.a2a
        out.modules = modules
        out.terms = tuple(map(_add, self.terms, other.terms))  # each slot's exposed sum, 0.0 + 0.0 elsewhere
        out.weights = (self.weights[0] + other.weights[0], self.weights[1] + other.weights[1])
        return out


_new_object = object.__new__
_ZERO_LAYER = _LayerCost((0.0,) * N_SLOTS, (0.0,) * N_SLOTS, 0.0, 0.0, 0.0, 0.0, {})


def _finish(block: _Block, tp_overlap: bool) -> _LayerCost:
    """Apply the overlap that happens inside a layer: TP comm under its GEMMs. The CP exchange's exposed part is
    priced by its type (costmodel.context_parallel: the ring's hops hide behind its blocks, the all-gather and the
    all-to-alls precede or follow the attention and stay exposed), its hidden part recorded."""
    exposed = [f + b for f, b in zip(block.fwd, block.bwd)]
    hidden = [0.0] * N_SLOTS
    hidden[CP] = block.cp_hidden
    fwd_comm = block.fwd[TP] + block.fwd[A2A] + block.fwd[ETP]
    if tp_overlap:
        tp_exposed_f = max(block.fwd[TP] - block.fwd[GEMM], TP_OVERLAP_EXPOSED_FRACTION * block.fwd[TP])
        tp_exposed_b = max(block.bwd[TP] - block.bwd[GEMM], TP_OVERLAP_EXPOSED_FRACTION * block.bwd[TP])
        fwd_comm += tp_exposed_f - block.fwd[TP]
        hidden[TP] = exposed[TP] - tp_exposed_f - tp_exposed_b
        exposed[TP] = tp_exposed_f + tp_exposed_b
    fwd_comm += block.fwd[CP]
    compute_fwd = sum(block.fwd[i] for i in _COMPUTE)
    compute_bwd = sum(block.bwd[i] for i in _COMPUTE)
    return _LayerCost(tuple(exposed), tuple(hidden), compute_fwd + fwd_comm - block.skip, compute_fwd, compute_bwd,
                      exposed[A2A] - block.a2a_fixed, dict(block.modules),
                      (block.low_precision_weights, block.fp8_weights))


class _Layers:
    """Per-micro-batch costs of every layer kind for one (tp, cp, ep, etp, mbs, sp, dispatcher, TP overlap).

    ``extras[(first, last)]`` is what a stage adds besides its decoder layers: the embedding on the first
    stage, the output head(s) and head blocks (MTP) on the last.
    """

    __slots__ = ("dense", "moe", "extras", "p2p_bytes", "selective")

    def __init__(self, dense: _LayerCost, moe: _LayerCost, extras: dict[tuple[bool, bool], _LayerCost],
                 p2p_bytes: float) -> None:
        self.dense, self.moe, self.extras = dense, moe, extras
        self.p2p_bytes = p2p_bytes
        self.selective: dict[tuple[str, ...], tuple[float, float]] = {}

    def selective_cost(self, modules: tuple[str, ...]) -> tuple[float, float]:
        """(dense layer, MoE layer) forward seconds re-run by selective recomputation of ``modules``."""
        hit = self.selective.get(modules)
        if hit is None:
            dense, moe = self.dense.modules, self.moe.modules
            hit = self.selective[modules] = (sum(dense.get(m, 0.0) for m in modules),
                                             sum(moe.get(m, 0.0) for m in modules))
        return hit


def dense_linear_seconds_and_cast_bytes(rates: ComputeRates, choice_bf16_rates: ComputeRates | None, m: float, n: float,
                                   k: float, input_cast_bytes: float, grad_cast_bytes: float,
                                   low_precision: bool = True) -> tuple[float, float, float, float, bool]:
    """(forward s, backward s, forward cast bytes, backward cast bytes, whether it runs fp8) of a linear layer
    whose forward GEMM is
    (m x k)·(k x n): its GEMMs at ``rates`` plus, where ``input_cast_bytes`` is non-zero (fp8), the quantisation of
    its input (``input_cast_bytes`` per input element) and of its output gradient (``grad_cast_bytes`` per
    element); with ``choice_bf16_rates`` (the executor's per-shape choice) the bf16 GEMMs without casts unless
    fp8 beats them by ``spec.fp8_choice.FP8_CHOICE_MARGIN``, as in the executor. Where ``rates`` carry a
    calibrated fp8 linear (``dense_fp8_ratio_curve``: bf16 / fp8 seconds by forward FLOPs, quantisation
    included) the choice reads it: fp8 is the bf16 GEMMs' seconds over that ratio, no cast bytes apart."""
    fwd, bwd = gemm_fwd_bwd(rates, round(m), round(n), round(k), low_precision)
    if not input_cast_bytes:
        return fwd, bwd, 0.0, 0.0, False
    if choice_bf16_rates is not None and rates.dense_fp8_ratio_curve is not None:
        f16, b16 = gemm_fwd_bwd(choice_bf16_rates, round(m), round(n), round(k), True)
        ratio = rates.dense_fp8_ratio_curve(2.0 * m * n * k)
        if not fp8_chosen(1.0 / ratio, 1.0):  # fp8's seconds per bf16 second
            return f16, b16, 0.0, 0.0, False
        return f16 / ratio, b16 / ratio, 0.0, 0.0, True
    cast_fwd, cast_bwd = input_cast_bytes * m * k, grad_cast_bytes * m * n
    if choice_bf16_rates is not None:
        f16, b16 = gemm_fwd_bwd(choice_bf16_rates, round(m), round(n), round(k), True)
        if not fp8_chosen(fwd + bwd + memory_time(rates, cast_fwd) + memory_time(rates, cast_bwd), f16 + b16):
            return f16, b16, 0.0, 0.0, False
    return fwd, bwd, cast_fwd, cast_bwd, True


class _Shape:
    """What the layer builders need: token counts, groups' placements and the rates."""

    def __init__(self, ctx: _Context, key: LayerKey) -> None:
        tp, cp, ep, etp, mbs = key.tp, key.cp, key.ep, key.etp, key.micro_batch_size
        sp, dispatcher = key.sequence_parallel, key.dispatcher
        model, training = ctx.model, ctx.training
        self.model, self.rates, self.link = model, ctx.rates, ctx.link
        self.tp, self.cp, self.ep, self.etp, self.sp, self.dispatcher = tp, cp, ep, etp, sp, dispatcher
        self.seq, self.mbs = training.seq_length, mbs
        self.tokens = mbs * training.seq_length // cp  # rows of every attention-side GEMM on this rank
        self.tokens_local = self.tokens / tp if sp else float(self.tokens)  # rows of elementwise ops
        self.moe_tokens = self.tokens / tp  # tokens entering the MoE layer on this rank (SP-sharded)
        self.act_bytes = training.activation_bytes
        if training.gradient_accumulation_fusion:
            self.accum_bytes = 0
        elif training.precision == "fp32":
            self.accum_bytes = FP32_GRAD_ACCUM_BYTES
        else:
            self.accum_bytes = MAIN_GRAD_ACCUM_BYTES if training.main_grads_fp32 else 3 * training.param_bytes
        self.flash = training.flash_attention
        self.regather = training.sequence_parallel_regather
        self.megatron_loss = training.megatron_cross_entropy
        # (fwd, bwd) bytes per logit of the blocked loss: its Triton kernels' on GPUs, the torch path's on CPU
        self.loss_bytes = _loss.blocked_loss_bytes_per_logit(self.act_bytes,
                                                             _loss.loss_kernels_run(ctx.cluster.gpu.name))
        self.fused_special = training.fused_window_sink_attention
        # packed sequences: a block-skipping causal kernel attends within documents (spec.documents)
        self.document_share = training.document_attention_share()
        self.document_lengths = training.document_lengths
        self.dropout = model.attention_dropout > 0.0
        self.fp8 = ctx.rates.gemm_elem_bytes == 1
        te = training.transformer_engine_fp8
        self.fp8_dense_cast = FP8_TE_CAST_BYTES if te else FP8_BOTH_FORMS_BYTES
        self.fp8_expert_cast = FP8_TE_CAST_BYTES if te else FP8_ROWWISE_BYTES
        # the executor runs Q, K and V as one GEMM in bf16 but as three in fp8 (each weight keeps its own cached
        # quantised forms), each quantising the common input
        self.qkv_input_casts = 1 if te else 3
        # the executor's fp8 runs the expert wgrad in bf16 (executor.kernels.fp8.gemm: faster measured, since
        # the fp8 2D×2D kernel barely beat bf16's and needs two per-expert quantisations), at the bf16 rates
        # (the profile's grouped curves are bf16 measurements: costmodel.compute). Transformer Engine's grouped
        # linears run it in fp8.
        self.wgrad_rates = ctx.bf16_rates if self.fp8 and not training.transformer_engine_fp8 else None
        # the executor's fp8 runs each linear, expert or dense, in bf16 where bf16 is faster at its shape (its
        # defaults ExecutorOptions.fp8_expert_gemm 'fastest' and FOLDTUNE_FP8_DENSE 'fastest' time both): priced as
        # the cheaper of the two; Transformer Engine's linears stay fp8
        self.choice_bf16_rates = ctx.bf16_rates if self.fp8 and not training.transformer_engine_fp8 else None
        # the layer's groups depend on tp, cp, etp and ep only (the slower dp and pp axes do not space them)
        self.places = GroupPlacements(GridSizes(tp=tp, cp=cp, etp=etp, ep=ep), ctx.gpus_per_node)
        self.tp_place, self.cp_place, self.ep_place, self.etp_place, self.tp_ep_place = (
            self.places.of(name) for name in ("tp", "cp", "ep", "etp", "tp_ep"))
        # the CP communication type and its groups: the CP group, and a2a+p2p's all-to-all sub-group (its a
        # nearest members) and ring sub-group (members a apart)
        self.cp_comm_type, self.cp_split = key.cp_comm, key.cp_split
        cp_stride = self.places.sizes.group("cp").stride
        self.cp_places = {"cp": self.cp_place,
                          "cp_a2a": group_placement(cp_stride, self.cp_split[0], ctx.gpus_per_node),
                          "cp_p2p": group_placement(cp_stride * self.cp_split[0], self.cp_split[1], ctx.gpus_per_node)}
        # the busiest EP rank sets the pace, the others wait in the a2a; capacity routing caps its rows, padding
        # to capacity fixes them at the capacity (the zero rows are computed and sent like the others)
        imbalance = training.expert_rows_factor(ep)
        capacity = training.routing_mode == "capacity" and training.moe_expert_capacity_factor is not None
        self.imbalance = imbalance
        # seconds per dispatch + combine beyond its bytes (an unpriced name fails in dispatcher_pricing)
        self.dispatch_fixed = ctx.fixed.get(dispatcher, 0.0)
        self.router_factor, self.permute_factor = ctx.router_factor, ctx.permute_factor
        self.cp_fixed = ctx.fixed[CP_EXCHANGE]  # seconds per K/V exchange beyond its bytes
        # the executor's collectives of this layer shape, call by call (router options: the executor's defaults)
        self.calls = _calls.Geometry(model, tp, cp, ep, etp, sp, self.tokens, self.act_bytes, dispatcher,
                                     self.regather, self.megatron_loss, ctx.aux_loss_sets(mbs), capacity, imbalance,
                                     capacity and training.moe_pad_expert_input_to_capacity, False, 1,
                                     self.cp_comm_type, *self.cp_split)
        self.layer_calls = _calls.attention_calls(self.calls)  # the attention's, the CP exchange's among them

    # -- primitives --------------------------------------------------------------------------------
    def linear(self, block: _Block, m: float, n: float, k: float, module: str | tuple[str, ...] = (),
               low_precision: bool = True, input_casts: int = 1) -> None:
        """A linear layer of forward GEMM (m x k)·(k x n), plus its fp8 casts: the input ``input_casts`` times
        (once per GEMM the layer is run as), the output gradient once in all."""
        fwd, bwd, cast_fwd, cast_bwd, runs_fp8 = dense_linear_seconds_and_cast_bytes(
            self.rates, self.choice_bf16_rates if low_precision else None, m, n, k,
            self.fp8_dense_cast * input_casts if self.fp8 and low_precision else 0, self.fp8_dense_cast,
            low_precision)
        block.add(GEMM, fwd, bwd, module)
        if low_precision:
            block.low_precision_weights += n * k
            if runs_fp8:
                block.fp8_weights += n * k
        self.grad_accumulation(block, n * k)
        if cast_fwd or cast_bwd:
            self.elementwise(block, cast_fwd, module, bwd_bytes=cast_bwd)

    def elementwise(self, block: _Block, fwd_bytes: float, module: str | tuple[str, ...] = (),
                    bwd_bytes: float | None = None, term: int = MEM, scale: float = 1.0,
                    op: str = "elementwise") -> None:
        """One memory-bound kernel of class ``op`` moving ``fwd_bytes`` forward (backward: ELEMENTWISE_BWD_RATIO
        x), its seconds times ``scale`` (a measured factor)."""
        if bwd_bytes is None:
            bwd_bytes = ELEMENTWISE_BWD_RATIO * fwd_bytes
        block.add(term, scale * memory_time(self.rates, fwd_bytes, op=op),
                  scale * memory_time(self.rates, bwd_bytes, op=op), module)

    def grad_accumulation(self, block: _Block, weights: float) -> None:
        """Backward-only: add this micro-batch's gradient of ``weights`` elements into the main gradient."""
        if self.accum_bytes:
            block.add(MEM, 0.0, memory_time(self.rates, self.accum_bytes * weights))

    def comm(self, block: _Block, calls: tuple[Call, ...], module: str | tuple[str, ...] = ()) -> None:
        """Each call (costmodel.collective_inventory) at its own size over its group, in its group's term."""
        for call in calls:
            seconds = call_time(self.link, call, self.places.of(call.group))
            slot = LAYER_SLOT[_calls.GROUP_TERM[call.group]]
            if call.phase == "forward":
                block.add(slot, seconds, 0.0, module)
            else:
                block.add(slot, 0.0, seconds, module)

    def skip_recompute(self, block: _Block, call: Call | None, module: str | tuple[str, ...]) -> None:
        """A forward call that recomputation does not re-run, the last of a full layer and of the selective
        ``module`` regions that end with it (its seconds leave their re-run)."""
        if call is not None:
            seconds = call_time(self.link, call, self.places.of(call.group))
            block.skip += seconds
            for name in (module,) if isinstance(module, str) else module:
                block.modules[name] -= seconds

    def tp_block_comm(self, block: _Block, gather_bytes: float, scatter_bytes: float,
                      module: str | tuple[str, ...] = ()) -> None:
        """TP traffic of a column-then-row parallel block (full-size buffers in bytes;
        :func:`costmodel.collective_inventory.tp_block`)."""
        self.comm(block, _calls.tp_block(self.calls, gather_bytes, scatter_bytes), module)

    def activation(self, block: _Block, elements: float, module: str | tuple[str, ...]) -> None:
        """The activation of an MLP or experts over ``elements`` outputs: one fused kernel for plain SwiGLU (or
        a non-gated MLP), else the executor's separate torch ops (GPT-OSS's clamped quick-GeGLU)."""
        m, ab = self.model, self.act_bytes
        if not m.gated_linear_unit or is_plain_swiglu(m):
            self.elementwise(block, (2 if m.gated_linear_unit else 1) * elements * ab + elements * ab, module,
                             op="activation")
            return
        moved, kernels = glu_traffic(m)
        block.add(MEM, memory_time(self.rates, moved * elements * ab, kernels, "activation"),
                  memory_time(self.rates, ELEMENTWISE_BWD_RATIO * moved * elements * ab, kernels, "activation"), module)

    def biases(self, block: _Block, column: float, row: float, module: str | tuple[str, ...] = ()) -> None:
        """Bias adds of a column-parallel output (``column`` elements per token on this rank, full-sequence) and a
        row-parallel one (``row``, on the sequence slice): each reads and writes its tensor."""
        self.elementwise(block, 2 * (column * self.tokens + row * self.tokens_local) * self.act_bytes, module)

    def norm(self, block: _Block, width: float, module: str | tuple[str, ...] = ("layernorm",)) -> None:
        self.elementwise(block, 2 * width * self.tokens_local * self.act_bytes, module, op="norm")

    def residual(self, block: _Block) -> None:
        self.elementwise(block, 3 * self.model.hidden_size * self.tokens_local * self.act_bytes)

    # -- layer parts -------------------------------------------------------------------------------
    def attention(self, block: _Block) -> None:
        """The input norm, the kind's projections, collectives and core (costmodel.attention_pricing), the residual."""
        self.norm(block, self.model.hidden_size)
        fwd, bwd = attention_pricing(self.model).layer_time(self, block)
        block.add(ATTN, fwd, bwd, "core_attn")
        self.residual(block)

    def flash_core(self, heads: int, qk: int, v: int) -> tuple[float, float]:
        """(forward, backward) seconds of causal attention on the fused kernel: under CP its communication
        type's kernels, each at its own key length (:mod:`costmodel.context_parallel`), scaled by the packed
        documents' share of the work (``TrainingSpec.document_attention_share``; under CP the share of its
        split's chunk pairs a document spans, ``spec.documents.chunk_pair_share``, except a2a's whole
        sequences); unfused attention (``flash_attention`` off) computes the whole [s/cp, s] score matrix
        either way."""
        if not self.flash:
            return attention_time(self.rates, self.tokens, self.seq, heads, qk, v, True, False, self.dropout, 1)
        share = self.document_share
        if self.cp <= 1:
            fwd, bwd = cp_attention_time(self.rates, self.mbs, self.seq, 1, heads, qk, v)
        else:
            pricing = cp_pricing(self.cp_comm_type)
            fwd, bwd = pricing.core(self, heads, qk, v)
            chunks = pricing.skip_chunks(self)
            if self.document_lengths is not None and chunks is not None:  # whole chunk pairs skipped, or computed
                share = chunk_pair_share(self.document_lengths, self.seq, chunks)
        # packed sequences: the kernel skips the blocks between documents, Σ len²/2 of seq²/2 pairs computed
        return fwd * share, bwd * share

    def masked_core(self, heads: int, qk: int, v: int) -> tuple[float, float]:
        """(forward, backward) seconds of SDPA under an explicit boolean mask: every score of the
        [s/cp, s] matrix computed, plus the mask's conversion to an additive bias."""
        t, seq, rates = self.tokens, self.seq, self.rates
        fwd, bwd = attention_time(rates, t, seq, heads, qk, v, False, True, self.dropout, 1)
        return fwd + memory_time(rates, t * seq * (1 + self.act_bytes)), bwd

    def attention_comm(self, block: _Block) -> None:
        """The attention's calls over TP (costmodel.collective_inventory.attention_calls; CP: cp_comm)."""
        self.comm(block, tuple(c for c in self.layer_calls if not c.group.startswith("cp")))

    def cp_comm(self, block: _Block, reorder: bool, heads: int, qk: int, v: int) -> None:
        """The executor's exchange under CP, priced by its communication type
        (:class:`costmodel.context_parallel.CpPricing`) for ``heads`` local heads of head dims ``qk`` / ``v``.
        allgather: this rank's K and V all-gathered over CP forward (one call each), their gradients
        reduce-scattered backward, exposed (it runs before the attention that needs it), plus the exchange's
        per-call seconds beyond the bytes (:mod:`costmodel.fixed_costs`, for K and V together) half each way;
        with ``reorder`` (the flash path) the gathered K/V put into global sequence order (one read and one
        write of the gathered buffer each way). p2p, a2a, a2a+p2p: costmodel.context_parallel's module
        docstring."""
        if self.cp <= 1:
            return
        cp_pricing(self.cp_comm_type).comm(self, block, reorder, heads, qk, v)

    def dense_mlp(self, block: _Block) -> None:
        m, t, ab, tp = self.model, self.tokens, self.act_bytes, self.tp
        h, ffn, gate = m.hidden_size, m.ffn_hidden_size, 2 if m.gated_linear_unit else 1
        self.norm(block, h)
        self.comm(block, _calls.mlp_calls(self.calls), "mlp")
        self.skip_recompute(block, _calls.recompute_skipped(self.calls, False), "mlp")  # the last reduce-scatter
        self.linear(block, t, gate * ffn / tp, h, "mlp")
        self.activation(block, ffn / tp * t, "mlp")
        self.linear(block, t, h, ffn / tp, "mlp")
        if m.add_bias_linear:
            self.biases(block, gate * ffn / tp, h, "mlp")
        self.residual(block)

    def moe(self, block: _Block) -> None:
        """The whole MoE block: pre-MLP norm, routed experts with their dispatch, shared experts, residual."""
        self.moe_dense(block)
        self.moe_routed(block)

    def moe_dense(self, block: _Block) -> None:
        """The TP-side parts of an MoE block: pre-MLP norm, shared experts, residual add."""
        m, ab = self.model, self.act_bytes
        h, gate = m.hidden_size, 2 if m.gated_linear_unit else 1
        self.norm(block, h)
        self.comm(block, _calls.router_calls(self.calls), "moe")
        if m.shared_expert_ffn_hidden_size:
            self.comm(block, _calls.mlp_calls(self.calls), ("moe", "shared_experts"))
            self.skip_recompute(block, _calls.recompute_skipped(self.calls, True), ("moe", "shared_experts"))
            self.shared_experts(block)
        self.residual(block)

    def shared_experts(self, block: _Block) -> None:
        """The shared experts' GEMMs, activation and biases (their TP collectives are moe_dense's)."""
        m, t, tp = self.model, self.tokens, self.tp
        h, gate, shared = m.hidden_size, 2 if m.gated_linear_unit else 1, m.shared_expert_ffn_hidden_size
        mods = ("moe", "shared_experts")
        self.linear(block, t, gate * shared / tp, h, mods)
        self.activation(block, shared / tp * t, mods)
        self.linear(block, t, h, shared / tp, mods)
        if m.add_bias_linear:
            self.biases(block, gate * shared / tp, h, mods)

    def moe_routed(self, block: _Block) -> None:
        """Router, permutation, dispatch (all-to-all + ETP gather, or all-gather), experts, combine.

        Depends only on the MoE tokens per rank, EP, ETP and the dispatcher, so it is cached on those.
        """
        m = self.model
        experts = m.num_experts or 1
        local = self.moe_tokens
        self.moe_router(block)
        self.moe_permute(block)
        received = self.moe_received()
        local_experts = max(1, experts // self.ep)
        dispatcher_pricing(self.dispatcher).routed_time(self, block, local, received, local_experts)
        if self.tp_ep_place.size > 1:  # where every pricing adds its per-call cost (costmodel.dispatch)
            block.a2a_fixed += self.dispatch_fixed
        if not m.shared_expert_ffn_hidden_size:  # else the shared experts end the layer (moe_dense)
            self.skip_recompute(block, _calls.recompute_skipped(self.calls, True), "moe")
        self.moe_experts(block)
        self.moe_unpermute(block)

    # the routed part's pieces, each its own method so that bench/finegrained_moe.py can price them one by one
    def moe_received(self) -> float:
        """Token copies this rank's local experts process per micro-batch."""
        return self.moe_tokens * self.model.moe_router_topk * self.etp * self.imbalance

    def moe_router(self, block: _Block) -> None:
        """The router: a small bf16 GEMM over the local tokens, then fp32 scores, top-k and the aux loss (times
        the profile's measured router factor)."""
        local, experts, f = self.moe_tokens, self.model.num_experts or 1, self.router_factor
        fwd, bwd = gemm_fwd_bwd(self.rates, max(1, round(local)), experts, self.model.hidden_size, False)
        block.add(MEM, f * fwd, f * bwd, "moe")
        self.grad_accumulation(block, experts * self.model.hidden_size)
        self.elementwise(block, 12 * local * experts, "moe", scale=f)

    def moe_permute(self, block: _Block) -> None:
        """Permute: gather each token's top-k copies (times the profile's measured permutation factor)."""
        m = self.model
        self.elementwise(block, (1 + m.moe_router_topk) * self.moe_tokens * m.hidden_size * self.act_bytes, "moe",
                         scale=self.permute_factor, op="permute")

    def moe_unpermute(self, block: _Block) -> None:
        """Unpermute and weight by the probabilities (times the profile's measured permutation factor)."""
        self.moe_permute(block)

    def moe_experts(self, block: _Block) -> None:
        """The local experts: two grouped GEMMs, their activation (and fp8 casts, biases), the weights' gradient
        accumulation."""
        m = self.model
        h, experts = m.hidden_size, m.num_experts or 1
        gate = 2 if m.gated_linear_unit else 1
        ffn = m.expert_ffn_hidden_size
        received = self.moe_received()
        local_experts = max(1, experts // self.ep)
        per_expert = received / local_experts
        # (N, K, input columns the forward quantises, output-gradient columns the backward quantises)
        linears = ((gate * ffn / self.etp, h, h, gate * ffn / self.etp), (h, ffn / self.etp, ffn / self.etp, h))
        fwd = bwd = cast_fwd = cast_bwd = 0.0
        casts = False  # a linear runs fp8: its quantisation kernels are priced
        for n, k, x_cols, dy_cols in linears:
            f, b = grouped_gemm_fwd_bwd(self.rates, local_experts, per_expert, n, k, self.wgrad_rates)
            cf = cb = 0.0
            if self.fp8:
                cf, cb = self.fp8_expert_cast * received * x_cols, self.fp8_expert_cast * received * dy_cols
            runs_fp8 = self.fp8
            if self.choice_bf16_rates is not None:  # bf16 unless fp8 beats it by the executor's margin
                f16, b16 = grouped_gemm_fwd_bwd(self.choice_bf16_rates, local_experts, per_expert, n, k)
                runs_fp8 = fp8_chosen(f + b + memory_time(self.rates, cf) + memory_time(self.rates, cb), f16 + b16)
                if not runs_fp8:
                    f, b, cf, cb = f16, b16, 0.0, 0.0
            casts = casts or runs_fp8
            block.low_precision_weights += local_experts * n * k
            if runs_fp8:
                block.fp8_weights += local_experts * n * k
            fwd, bwd, cast_fwd, cast_bwd = fwd + f, bwd + b, cast_fwd + cf, cast_bwd + cb
        block.add(GROUPED, fwd, bwd, "moe")
        self.grad_accumulation(block, local_experts * (gate + 1) * ffn / self.etp * h)
        if casts:
            self.elementwise(block, cast_fwd, "moe", bwd_bytes=cast_bwd)
        self.activation(block, ffn / self.etp * received, ("moe", "moe_act"))
        if m.add_bias_linear:  # gather each row's gate/up and down biases, add them (the down one zero-padded to h)
            self.elementwise(block, received * (4 * gate * ffn / self.etp + (1 / self.etp + 4) * h) * self.act_bytes,
                             "moe")

    def embedding(self, block: _Block) -> None:
        h, ab, t = self.model.hidden_size, self.act_bytes, self.tokens
        # vocab-parallel lookup of every token on each TP rank, then a reduction over TP
        self.elementwise(block, 2 * t * h * ab, bwd_bytes=t * h * (ab + 8))
        self.grad_accumulation(block, self.model.padded_vocab_size(self.tp) / self.tp * h)
        self.comm(block, _calls.embedding_calls(self.calls))

    def head(self, block: _Block) -> None:
        """Final norm, output layer (16-bit) and vocab-parallel cross-entropy of one output head: the executor's
        loss fused with the output layer, its logits kept whole or blocked over the vocabulary (then one more
        output GEMM in backward; its Triton kernels' traffic on GPUs, its torch ops' on CPU: ``costmodel.loss``),
        or Megatron's over the whole logits (``TrainingSpec.megatron_cross_entropy``)."""
        m, t, ab, tp = self.model, self.tokens, self.act_bytes, self.tp
        h = m.hidden_size
        vocab = m.padded_vocab_size(tp) / tp
        self.norm(block, h, ())
        self.comm(block, _calls.head_calls(self.calls))  # the input gathered over TP, the loss's sums
        self.linear(block, t, vocab, h, low_precision=False)
        if self.megatron_loss:
            self.elementwise(block, LOSS_BYTES_PER_LOGIT_FWD * t * vocab,
                             bwd_bytes=LOSS_BYTES_PER_LOGIT_BWD * t * vocab)
            return
        # the executor's loss (costmodel.loss): with its logits kept, no more work than their kernels' passes;
        # blocked, its backward computes each block's logits again and sums the input gradient over blocks
        rows = _loss.vocab_rows(m, tp)
        fwd_bytes, bwd_bytes = self.loss_bytes
        accumulate = 0.0
        if not _loss.keeps_logits(t, rows, ab):
            block.add(GEMM, 0.0, gemm_time(self.rates, t, round(vocab), h, False))
            accumulate = _loss.BLOCKED_LOSS_ACCUM_BYTES * t * h * _loss.num_blocks(t, rows)
        self.elementwise(block, fwd_bytes * t * rows, bwd_bytes=bwd_bytes * t * rows + accumulate)

    def chunk_end(self, block: _Block) -> None:
        """What every pipeline chunk issues once per micro-batch besides its layers (the router losses' sum)."""
        self.comm(block, _calls.chunk_end_calls(self.calls))

    def head_block_own(self, feature: str, block: _Block) -> None:
        """One block of the head feature named ``feature``, its own work only (an MTP depth: embedding of shifted
        tokens, two norms and the 2h -> h projection; ``costmodel.head_pricing``)."""
        head_pricing(HEAD_FEATURES[feature]).own_time(self, block)


def _part(ctx: _Context, name: str, key: DenseKey | RoutedKey, shape: _Shape | None,
          layer_key: LayerKey, *args) -> _LayerCost:
    """The cost of one layer part (``_Shape``'s method ``name`` with ``args``), built once per (part, its
    arguments, the fields it depends on)."""
    cached = ctx.parts.get((name, args, key))
    if cached is None:
        block = _Block()
        getattr(shape or _Shape(ctx, layer_key), name)(*args, block)
        cached = ctx.parts[(name, args, key)] = _finish(block, layer_key.tp_comm_overlap)
    return cached


def _combos(ctx: _Context, key: LayerKey) -> tuple[tuple[_LayerCost, ...], _Shape | None]:
    """The layer parts of ``key`` that do not depend on the expert layout or the dispatcher: (dense layer,
    the MoE layer's TP side, embedding, output head, each head feature's block's own work (a tuple, in
    ``head_features`` order), chunk end), cached per (tp, cp, micro-batch, SP, TP overlap); and the shape they
    were built with (None when cached)."""
    model = ctx.model
    dense_key = key.dense()
    combos = ctx.combos.get(dense_key)
    shape = None
    if combos is None:
        shape = _Shape(ctx, key)
        attention = _part(ctx, "attention", dense_key, shape, key)
        combos = ctx.combos[dense_key] = (
            attention + _part(ctx, "dense_mlp", dense_key, shape, key),
            attention + _part(ctx, "moe_dense", dense_key, shape, key) if model.is_moe else _ZERO_LAYER,
            _part(ctx, "embedding", dense_key, shape, key),
            _part(ctx, "head", dense_key, shape, key),
            tuple(_part(ctx, "head_block_own", dense_key, shape, key, f.name) for f, _ in head_features(model)),
            _part(ctx, "chunk_end", dense_key, shape, key))
    return combos, shape


def _build_layers(ctx: _Context, key: LayerKey) -> _Layers:
    model = ctx.model
    # attention and the TP-side parts do not depend on the expert layout; the routed experts depend only
    # on the MoE tokens per rank and the expert layout
    (dense, moe_base, embed, head, head_own, chunk_end), shape = _combos(ctx, key)
    moe = _ZERO_LAYER
    if model.is_moe:
        routed = _part(ctx, "moe_routed", key.routed(ctx.training.seq_length), shape, key)
        moe = moe_base + routed
        if key.shared_overlap and model.shared_expert_ffn_hidden_size:
            shared = _part(ctx, "shared_experts", key.dense(), shape, key)
            moe = _a2a_hidden(moe, shared_overlap_hidden(shared.compute_fwd, routed.a2a))
    tail = head
    for own, (feature, depth) in zip(head_own, head_features(model)):
        # a head block: its own work, a layer of the last layer's kind, its output heads
        one = own + (moe if ctx.pattern[-1] else dense)
        for _ in range(feature.output_heads_per_block):
            one = one + head
        for _ in range(depth):
            tail = tail + one
    # every stage ends its chunk with the router losses' sum (once per micro-batch; vpp > 1 chunks: once each,
    # priced once)
    extras = {(False, False): chunk_end, (True, False): embed + chunk_end, (False, True): tail + chunk_end,
              (True, True): embed + tail + chunk_end}
    # Megatron sends the SP-sharded activation (or scatters it over TP and re-gathers it): 1/tp per rank
    p2p_bytes = (key.micro_batch_size * ctx.training.seq_length // key.cp / key.tp * model.hidden_size
                 * ctx.training.activation_bytes)
    return _Layers(dense, moe, extras, p2p_bytes)


def shared_overlap_hidden(shared_fwd: float, a2a: float) -> float:
    """Seconds of a MoE layer's EP all-to-all that ``moe_shared_expert_overlap`` hides per micro-batch: the shared
    experts' forward compute (``shared_fwd`` seconds) runs while the dispatch all-to-all is in flight, so the
    smaller of the two. ``a2a``: the layer's exposed all-to-all seconds, forward and backward, without the
    dispatcher's per-call cost; its four exchanges (dispatch and combine, each forward and transposed in
    backward) move the same rows, so the dispatch's forward is a quarter of it. The backward runs in line."""
    return min(shared_fwd, a2a / 4)


def _a2a_hidden(cost: _LayerCost, seconds: float) -> _LayerCost:
    """``cost`` with ``seconds`` of its forward EP all-to-all hidden under other work of the same layer."""
    exposed, hidden = list(cost.exposed), list(cost.hidden)
    exposed[A2A] -= seconds
    hidden[A2A] += seconds
    return _LayerCost(tuple(exposed), tuple(hidden), cost.fwd_total - seconds, cost.compute_fwd, cost.compute_bwd,
                      cost.a2a - seconds, dict(cost.modules), cost.weights)


def _layers(ctx: _Context, c: ParallelConfig) -> _Layers:
    key = LayerKey.of(c)
    layers = ctx.layers.get(key)
    if layers is None:
        _check(ctx.model, ctx.training, c)
        layers = ctx.layers[key] = _build_layers(ctx, key)
    return layers


# ---- pipeline stages ------------------------------------------------------------------------------
def _stage_kinds(ctx: _Context, pp: int, vpp: int, split: PipelineSplit) -> tuple[tuple, ...]:
    """Pipeline ranks grouped by what they hold: (count, dense layers, MoE layers, (first, last), ranks).

    Uneven placements (Megatron's options, ``split``) give ranks of different layer counts, zero included:
    each kind is priced on its own and the slowest runs the steady state."""
    kinds = ctx.kinds.get((pp, vpp, split))
    if kinds is None:
        chunks = _params.layer_chunks(len(ctx.pattern), pp, vpp, split)
        groups: dict[tuple[int, int, tuple[bool, bool]], list[int]] = {}
        for stage in range(pp):
            layers = [i for chunk in chunks[stage] for i in chunk]
            num_moe = sum(ctx.pattern[i] for i in layers)
            groups.setdefault((len(layers) - num_moe, num_moe, (stage == 0, stage == pp - 1)), []).append(stage)
        kinds = ctx.kinds[(pp, vpp, split)] = tuple((len(ranks), nd, nm, ends, tuple(ranks))
                                             for (nd, nm, ends), ranks in groups.items())
    return kinds


def _stage_times(layers: _Layers, kinds: tuple[tuple, ...], c: ParallelConfig,
                 regions: list[float] | None = None) -> tuple[list[float], list[float]]:
    """Per stage kind: (exposed seconds per micro-batch including recomputation, recomputation seconds);
    ``regions``: per stage kind, the checkpoint regions' own seconds the device pays (:func:`_region_seconds`)."""
    d, e, extras = layers.dense, layers.moe, layers.extras
    granularity = c.recompute_granularity
    if granularity == "none":
        return [nd * d.total + nm * e.total + extras[ends].total for _, nd, nm, ends, _ in kinds], [0.0] * len(kinds)
    if granularity == "selective":
        rd, rm = layers.selective_cost(c.recompute_modules)
        recompute = [nd * rd + nm * rm for _, nd, nm, _, _ in kinds]
    else:
        k = c.recompute_num_layers
        recompute = [(1.0 if k == 0 else min(1.0, k / max(1, nd + nm))) * (nd * d.fwd_total + nm * e.fwd_total)
                     for _, nd, nm, _, _ in kinds]
    if regions:
        recompute = [r + s for r, s in zip(recompute, regions)]
    return ([nd * d.total + nm * e.total + extras[ends].total + r for (_, nd, nm, ends, _), r in zip(kinds, recompute)],
            recompute)


def _stage_scalar(layers: _Layers, kind: tuple, field: str) -> float:
    """One per-layer scalar (compute_fwd, compute_bwd, a2a, ...) summed over a stage kind."""
    _, nd, nm, ends, _ = kind
    return (nd * getattr(layers.dense, field) + nm * getattr(layers.moe, field)
            + getattr(layers.extras[ends], field))


def _stage_costs(layers: _Layers, kinds: tuple[tuple, ...], c: ParallelConfig,
                 regions: list[float] | None = None) -> tuple[list[float], ...]:
    """Per stage kind: (seconds per micro-batch incl. recompute, recompute seconds, forward compute,
    backward compute, exposed a2a+ETP seconds)."""
    times, recompute = _stage_times(layers, kinds, c, regions)
    return (times, recompute, [_stage_scalar(layers, k, "compute_fwd") for k in kinds],
            [_stage_scalar(layers, k, "compute_bwd") for k in kinds], [_stage_scalar(layers, k, "a2a") for k in kinds])


def cpu_contention(cores: int, ranks_per_node: int, micro_batches: int, pp: int, vpp: int) -> float:
    """How many times longer a CPU rank's own work (arithmetic and host ops) takes in a step than alone: the ranks
    of one node that compute at once, on average, over the ``cores`` they share, at least 1.

    All of a node's ranks compute at once but for a pipeline's fill and drain, where stages wait: over a step of
    ``micro_batches`` through ``pp`` stages of ``vpp`` chunks each, a rank is busy m / (m + (pp - 1) / vpp) of the
    time (the bubble's share), so ``ranks_per_node`` · m / (m + (pp - 1) / vpp) compete for the cores. Measured on
    the 2-core machine with four ranks of tiny-moe (docs/benchmarks.md, "CPU ranks' contention priced per layout"):
    a dp4 step's expert blocks took 2.1x the seconds per token and layer of a pp2 step's with one micro-batch (four
    ranks busy against two; its attention blocks 1.35x)."""
    busy = ranks_per_node * micro_batches / (micro_batches + (pp - 1) / vpp)
    return max(1.0, busy / cores)


#: correction keys that scale the host floor (estimate_step_time) rather than a time term
HOST_FACTOR = "host"
HOST_RECOMPUTE_FACTOR = "host_recompute"
HOST_FACTORS = (HOST_FACTOR, HOST_RECOMPUTE_FACTOR)


def _region_counts(ctx: _Context, c: ParallelConfig, kinds: tuple[tuple, ...]) -> list[float]:
    """Per stage kind: the activation-checkpoint regions one micro-batch opens (costmodel.host.SELECTIVE_REGIONS;
    full recomputation: one per recomputed layer)."""
    if c.recompute_granularity == "selective":
        dense, moe = _host.recompute_regions(ctx.model, c, False), _host.recompute_regions(ctx.model, c, True)
        return [nd * dense + nm * moe for _, nd, nm, _, _ in kinds]
    if c.recompute_granularity == "full":
        k = c.recompute_num_layers
        return [float(nd + nm if k == 0 else min(k, nd + nm)) for _, nd, nm, _, _ in kinds]
    return [0.0] * len(kinds)


def _region_seconds(ctx: _Context, c: ParallelConfig, kinds: tuple[tuple, ...]) -> list[float] | None:
    """Per stage kind: the seconds its checkpoint regions' own work adds to the DEVICE's time per micro-batch, or
    None. That work is the host's (HardwareProfile.recompute_region_s, in the host floor: _host_seconds); only
    where the host is the device (CPU ranks: every op runs where it is issued) does the device pay it too."""
    if not ctx.region_device_s or c.recompute_granularity == "none":
        return None
    return [n * ctx.region_device_s for n in _region_counts(ctx, c, kinds)]


def _host_seconds(ctx: _Context, c: ParallelConfig, kinds: tuple[tuple, ...],
                  key: HostKey) -> tuple[list[float], list[float], float, list[float]]:
    """(Host seconds per micro-batch of each stage kind without full recomputation, the seconds full
    recomputation adds to them, host seconds once per step of the rank holding the most layers: the step
    ends when its optimizer has run, and the per-micro-batch sums); see costmodel/host.py."""
    model = ctx.model
    hw = ctx.cluster.hardware
    dense, moe = _host.layer_host_ops(model, c, False, hw), _host.layer_host_ops(model, c, True, hw)
    per_mb, recompute, most_layers = [], [], 0
    regions = _region_counts(ctx, c, kinds) if ctx.region_s else [0.0] * len(kinds)
    for (_, nd, nm, (first, last), _), n_regions in zip(kinds, regions):
        ops = dense * nd + moe * nm + _host.extras_host_ops(c, first, last)
        extra = 0.0
        if c.recompute_granularity == "full":
            k = c.recompute_num_layers
            share = 1.0 if k == 0 else min(1.0, k / max(1, nd + nm))
            extra = ((_host.full_recompute_ops(False) * nd + _host.full_recompute_ops(True) * nm) * share).seconds(
                ctx.op_launch, ctx.collective_launch)
        per_mb.append(ops.seconds(ctx.op_launch, ctx.collective_launch))
        recompute.append(extra + n_regions * ctx.region_s)
        most_layers = max(most_layers, nd + nm)
    per_step = _host.step_host_ops(most_layers).seconds(ctx.op_launch, ctx.collective_launch)
    # the last entry, base + recomputation, is what the estimate uses without host factors (the planner's path)
    hit = ctx.host[key] = (per_mb, recompute, per_step, [b + r for b, r in zip(per_mb, recompute)])
    return hit


def host_seconds_per_micro_batch(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec,
                                 config: ParallelConfig) -> tuple[float, float]:
    """The host floor of ``config``'s busiest pipeline stage before any host factor: (seconds per micro-batch
    without full recomputation, seconds full recomputation adds per micro-batch). What ``foldtune calibrate
    --model``'s host probe compares its measurement with (costmodel.calibrate.host_factors)."""
    ctx = _context(model, training, cluster)
    c = config
    _check_pipeline(model, c)
    kinds = _stage_kinds(ctx, c.pp, c.vpp, c.pipeline_split)
    base, recompute, _, _ = _host_seconds(ctx, c, kinds, HostKey.of(c, ctx.per_expert_host))
    i = max(range(len(base)), key=lambda j: base[j] + recompute[j])
    return base[i], recompute[i]


# ---- step-level terms -----------------------------------------------------------------------------
def _grad_sync(link: LinkRates, params: float, grad_bytes: int, param_bytes: int, place: Placement,
               distributed: bool) -> tuple[float, float, float, float]:
    """(grad seconds, its last bucket, param all-gather seconds, its first bucket) for one replica group."""
    if place.size <= 1 or params <= 0:
        return 0.0, 0.0, 0.0, 0.0
    bucket = min(params, max(BUCKET_PARAMS, BUCKET_PARAMS_PER_DP * place.size))
    if distributed:
        grad = ring_time(link, "reduce_scatter", params * grad_bytes, place)
        grad_bucket = ring_time(link, "reduce_scatter", bucket * grad_bytes, place)
        gather = ring_time(link, "all_gather", params * param_bytes, place)
        gather_bucket = ring_time(link, "all_gather", bucket * param_bytes, place)
        return grad, grad_bucket, gather, gather_bucket
    grad = ring_time(link, "all_reduce", params * grad_bytes, place)
    return grad, ring_time(link, "all_reduce", bucket * grad_bytes, place), 0.0, 0.0


def _step_stat_seconds(ctx: _Context, c: ParallelConfig, key: StepStatKey) -> float:
    """Seconds of the first pipeline rank's once-per-step calls besides the DP·CP / EDP gradient buckets
    (costmodel.collective_inventory.step_stat_groups), each at its own size, exposed."""
    places = GroupPlacements.of_config(c, ctx.gpus_per_node)
    seconds = sum(n * call_time(ctx.link, call, places.of(call.group))
                  for call, n in _calls.step_stat_groups(ctx.model, ctx.training, c))
    ctx.step_stats[key] = seconds
    return seconds


def _first_write_seconds(ctx: _Context, dense: int, expert: int) -> float:
    """Seconds a step's main-gradient accumulation takes less than the layer blocks price (an add per
    micro-batch): the first gradient of each of the rank's ``dense`` + ``expert`` weights is written, not
    added (``MAIN_GRAD_FIRST_BYTES``; 0 where no add is priced)."""
    return memory_time(ctx.rates, ctx.first_write_saving * (dense + expert), kernels=0)


def _most_gemm_weights(ctx: _Context, c: ParallelConfig) -> int:
    """GEMM weights per GPU of the pipeline rank holding the most (decoder-layer linears and experts: what fp8
    quantises once a step; costmodel.params.stage_counts_and_gemm), cached on (tp, pp, vpp, ep, etp, split)."""
    key = GemmWeightsKey.of(c)
    hit = ctx.gemm_weights.get(key)
    if hit is None:
        hit = ctx.gemm_weights[key] = max(
            _params.stage_counts_and_gemm(ctx.model, c.tp, c.pp, c.vpp, c.ep, c.etp, stage, c.pipeline_split)[1]
            for stage in range(c.pp))
    return hit


def _most_params(ctx: _Context, c: ParallelConfig) -> tuple[int, int]:
    """(dense, expert) parameters per GPU of the pipeline ranks holding the most of each.

    Dense counts depend on (tp, pp, vpp, placement) only and expert counts on (ep, etp, pp, vpp, placement),
    so each is cached on those fields.
    """
    split = c.pipeline_split
    dkey, ekey = DenseParamsKey.of(c), ExpertParamsKey.of(c)
    dense, expert = ctx.dense_params.get(dkey), ctx.expert_params.get(ekey)
    if dense is None or expert is None:
        counts = [_params.stage_param_counts(ctx.model, c, kind[4][0]) for kind in _stage_kinds(ctx, c.pp, c.vpp, split)]
        dense = ctx.dense_params[dkey] = max(n.dense for n in counts)
        expert = ctx.expert_params[ekey] = max(n.expert for n in counts)
    return dense, expert


def _sync(ctx: _Context, params: int, group: GroupStride, distributed: bool) -> tuple[float, float, float, float]:
    key = (params, group, distributed)
    hit = ctx.syncs.get(key)
    if hit is None:
        place = group_placement(group.stride, group.size, ctx.gpus_per_node)
        hit = ctx.syncs[key] = _grad_sync(ctx.link, params, ctx.grad_bytes, ctx.training.param_bytes, place,
                                          distributed)
    return hit


class _Context:
    """Everything derived from one (model, training, cluster) triple, with the caches built on it."""

    def __init__(self, model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec) -> None:
        self.model, self.training, self.cluster = model, training, cluster
        self.rates: ComputeRates = compute_rates(cluster.hardware, training.precision)
        self.bf16_rates: ComputeRates = compute_rates(cluster.hardware, "bf16")
        self.link: LinkRates = link_rates(cluster.hardware)
        self.fixed = exchange_fixed(cluster.hardware)  # per-call exchange seconds (costmodel.fixed_costs)
        self.gpus_per_node = cluster.gpus_per_node
        self.pattern = model.moe_layer_pattern()
        # packed documents: the attention FLOPs of Σ len²/2 pairs a sequence, the share the kernels are priced at
        self.flops_per_step = flops_per_step(model, training.seq_length, training.global_batch_size,
                                             training.document_attention_share())
        self.peak = cluster.gpu.peak(training.precision)
        self.tokens_per_step = training.global_batch_size * training.seq_length
        self.grad_bytes = 4 if training.main_grads_fp32 else training.param_bytes
        # bytes per local weight a step saves because its first gradient is written, not added (0 where the
        # layer blocks price no main-gradient accumulation, or fp32 weights, whose .grad autograd accumulates)
        unfused_main = (training.main_grads_fp32 and not training.gradient_accumulation_fusion
                        and training.precision != "fp32")
        self.first_write_saving = MAIN_GRAD_ACCUM_BYTES - MAIN_GRAD_FIRST_BYTES if unfused_main else 0
        # bytes per GEMM weight a step to quantise the weights for fp8 (0 in other precisions)
        self.fp8_weight_cast = 0
        if self.rates.gemm_elem_bytes == 1:
            self.fp8_weight_cast = FP8_TE_CAST_BYTES if training.transformer_engine_fp8 else FP8_BOTH_FORMS_BYTES
        self.gemm_weights: dict[tuple, int] = {}
        # measured by calibrate where it ran (the fused kernel's real traffic and launch pattern), else the bytes
        self.optimizer_seconds_per_param = (cluster.hardware.optimizer_seconds_per_param
                                            or OPTIMIZER_BYTES_PER_PARAM / self.rates.hbm_bandwidth)
        self.overlap_slowdown = cluster.hardware.overlap_slowdown or 0.0
        self.parts: dict[tuple, _LayerCost] = {}
        self.combos: dict[tuple, tuple[_LayerCost, ...]] = {}
        self.layers: dict[tuple, _Layers] = {}
        self.kinds: dict[tuple, tuple[tuple, ...]] = {}
        self.dense_params: dict[tuple, int] = {}
        self.expert_params: dict[tuple, int] = {}
        self.syncs: dict[tuple, tuple[float, float, float, float]] = {}
        self.grad_groups: dict[GradGroupsKey, tuple[GroupStride, GroupStride]] = {}
        self.step_stats: dict[tuple, float] = {}
        self.hops: dict[tuple, float] = {}
        self.op_launch = _host.seconds_per_op(cluster.hardware)
        self.per_expert_host = _host.local_experts_priced(cluster.hardware)
        # measured / priced device seconds of the router and the permutation (bench/finegrained_moe.py), else 1
        self.router_factor = cluster.hardware.moe_router_factor or 1.0
        self.permute_factor = cluster.hardware.moe_permute_factor or 1.0
        self.collective_launch = cluster.hardware.collective_launch_seconds
        # host seconds per activation-checkpoint region (measured; None: not priced), and what of it the device
        # pays too: all of it on CPU ranks, where the host runs every op itself
        self.region_s = cluster.hardware.recompute_region_s or 0.0
        self.cpu_cores = cluster.hardware.cpu_cores  # CPU ranks timed alone: price each layout's contention
        self.region_device_s = self.region_s if is_cpu(cluster.hardware.gpu.name) else 0.0
        self.host: dict[tuple, tuple[list[float], list[float], float, list[float]]] = {}
        self._aux: dict[int, int] = {}

    def aux_loss_sets(self, micro_batch_size: int) -> int:
        """Sets the router's load-balancing loss counts over (collective_inventory.Geometry), under the
        executor's default router options for this model."""
        hit = self._aux.get(micro_batch_size)
        if hit is None:
            hit = self._aux[micro_batch_size] = _calls.aux_loss_sets(self.model, RouterOptions(), micro_batch_size)
        return hit


_CONTEXTS: dict[tuple[int, int, int], tuple[ModelSpec, TrainingSpec, ClusterSpec, _Context]] = {}
_MAX_CONTEXTS = 64


def _context(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec) -> _Context:
    key = (id(model), id(training), id(cluster))
    hit = _CONTEXTS.get(key)
    # the entry holds the objects themselves, so their ids cannot be reused while it lives
    if hit is not None and hit[0] is model and hit[1] is training and hit[2] is cluster:
        return hit[3]
    ctx = _context_by_value(model, training, cluster)
    if len(_CONTEXTS) >= _MAX_CONTEXTS:
        _CONTEXTS.clear()
    _CONTEXTS[key] = (model, training, cluster, ctx)
    return ctx


@lru_cache(maxsize=_MAX_CONTEXTS)
def _context_by_value(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec) -> _Context:
    return _Context(model, training, cluster)


def _check(model: ModelSpec, training: TrainingSpec, config: ParallelConfig) -> None:
    """Raise InvalidConfigError for a layout the time model cannot price (checked once per layer shape): the
    rule book's preconditions of the cost model (``spec.validity.COSTMODEL_RULES``; the pipeline's is
    :func:`_check_pipeline`)."""
    for rejection in (experts_ep_rule(model, config.ep), seq_cp_rule(training.seq_length, config.cp)):
        if rejection is not None:
            raise InvalidConfigError(str(rejection))


def pipeline_bubble(stage_times: list[float] | tuple[float, ...], vpp: int = 1) -> float:
    """Seconds of fill and drain of a 1F1B (vpp = 1) or interleaved (vpp > 1) pipeline.

    ``stage_times`` are the per-micro-batch (forward + backward) seconds of every pipeline rank. The
    slowest rank runs the steady state; filling and draining passes once through every other rank, in
    chunks of 1/vpp: ``(sum - max) / vpp``, which is ``(pp - 1)/(vpp · m)`` of the ideal ``m · t`` when
    all ranks take ``t``.
    """
    return (sum(stage_times) - max(stage_times)) / vpp


def stage_times(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec,
                config: ParallelConfig) -> tuple[float, ...]:
    """Exposed seconds per micro-batch (forward + backward + recomputation) of every pipeline rank."""
    ctx = _context(model, training, cluster)
    _check_pipeline(model, config)
    kinds = _stage_kinds(ctx, config.pp, config.vpp, config.pipeline_split)
    times = _stage_times(_layers(ctx, config), kinds, config, _region_seconds(ctx, config, kinds))[0]
    out = [0.0] * config.pp
    for kind, t in zip(kinds, times):
        for stage in kind[4]:
            out[stage] = t
    return tuple(out)


def _check_pipeline(model: ModelSpec, config: ParallelConfig) -> None:
    # raises PipelineLayoutError (an InvalidConfigError) naming what does not fit
    check_placement(model.num_layers, config.pp, config.vpp, config.pipeline_split, model.mtp_num_layers)


def estimate_step_time(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, config: ParallelConfig,
                       corrections: Mapping[str, float] | None = None,
                       router: RouterOptions | None = None) -> StepTimeBreakdown:
    """Predicted seconds per optimizer step of ``config`` and their breakdown by term.

    ``router``: the router options trained with, where they add calls the executor's defaults do not: the global
    aux loss's all-reduce of the tokens per expert over DP·CP, in line in every MoE layer's forward of every
    micro-batch (priced into ``dp_grad``, the DP communication; :func:`global_aux_seconds`). The layers are
    otherwise priced under the executor's default router options.

    ``corrections`` (term name -> multiplier, e.g. fitted by calibration) scales each exposed term
    before they are summed; terms it does not name keep factor 1. Two further keys scale the host floor
    instead of a term: ``HOST_FACTOR`` (the host seconds per micro-batch and per step) and
    ``HOST_RECOMPUTE_FACTOR`` (what full recomputation adds per micro-batch; default: ``HOST_FACTOR``), as
    ``foldtune calibrate --model``'s host probe measures them for one model.
    """
    c = config
    world = c.world_size
    dp = world // (c.tp * c.cp * c.pp)
    m = _micro_batches(training, c, dp)
    hit = _CONTEXTS.get((id(model), id(training), id(cluster)))  # _context's fast path, inlined
    if hit is not None and hit[0] is model and hit[1] is training and hit[2] is cluster:
        ctx = hit[3]
    else:
        ctx = _context(model, training, cluster)
    layers = ctx.layers.get(LayerKey.of(c))
    if layers is None:
        layers = _layers(ctx, c)
    pp, vpp = c.pp, c.vpp
    split = c.pipeline_split
    kinds = ctx.kinds.get((pp, vpp, split))
    if kinds is None:
        _check_pipeline(model, c)
        kinds = _stage_kinds(ctx, pp, vpp, split)

    # the slowest pipeline rank runs the steady state; the others' time per micro-batch makes the bubble
    ep_overlap = c.overlap_moe_expert_parallel_comm and m > 1
    if ep_overlap:  # the a2a of one micro-batch hides behind another's compute
        times, recompute, fwd, bwd, a2a = _stage_costs(layers, kinds, c, _region_seconds(ctx, c, kinds))
        times = [t - a + max(0.0, a - f - b) for t, a, f, b in zip(times, a2a, fwd, bwd)]
    else:
        times, recompute = _stage_times(layers, kinds, c, _region_seconds(ctx, c, kinds))
    contention = 1.0
    if ctx.cpu_cores:
        contention = cpu_contention(ctx.cpu_cores, min(world, ctx.gpus_per_node), m, pp, vpp)
    if contention != 1.0:  # the rank's own work slows down; its collectives were timed under contention already
        times = [t + (contention - 1.0) * (_stage_scalar(layers, kind, "compute_fwd")
                                           + _stage_scalar(layers, kind, "compute_bwd") + r)
                 for t, kind, r in zip(times, kinds, recompute)]
        recompute = [r * contention for r in recompute]
    # a rank cannot finish a micro-batch before its host has issued the micro-batch's kernels
    hkey = HostKey.of(c, ctx.per_expert_host)
    host = ctx.host.get(hkey) or _host_seconds(ctx, c, kinds, hkey)
    host_factor = recompute_factor = 1.0
    if corrections and (HOST_FACTOR in corrections or HOST_RECOMPUTE_FACTOR in corrections):
        host_factor = corrections.get(HOST_FACTOR, 1.0)
        recompute_factor = corrections.get(HOST_RECOMPUTE_FACTOR, host_factor)
        corrections = {k: v for k, v in corrections.items() if k not in HOST_FACTORS}
    if host_factor == 1.0 and recompute_factor == 1.0:
        host_mb = host[3]
    else:
        host_mb = [b * host_factor + r * recompute_factor for b, r in zip(host[0], host[1])]
    if contention != 1.0:
        host_mb = [h * contention for h in host_mb]
    floored = [t if t >= h else h for t, h in zip(times, host_mb)]
    if len(times) == 1:
        i, others = 0, 0.0
    else:
        i = floored.index(max(floored))
        others = sum([k[0] * t for k, t in zip(kinds, floored)]) - floored[i]
    host_overhead = m * (floored[i] - times[i])
    _, nd, nm, ends, _ = kinds[i]
    d, e, x = layers.dense, layers.moe, layers.extras[ends]
    values = [m * (nd * a + nm * b + c_) for a, b, c_ in zip(d.terms, e.terms, x.terms)]
    values[_I_RECOMPUTE] = m * recompute[i]
    if contention != 1.0:
        for slot in _COMPUTE_TERM_INDICES:
            values[slot] *= contention
    dh, eh, xh = d.hidden, e.hidden, x.hidden
    # HIDDEN_TERMS order: tp_comm, cp_comm, ep_a2a, then the once-per-step terms filled below
    hidden = [m * (nd * dh[TP] + nm * eh[TP] + xh[TP]), m * (nd * dh[CP] + nm * eh[CP] + xh[CP]),
              m * (nd * dh[A2A] + nm * eh[A2A] + xh[A2A]), 0.0, 0.0, 0.0, 0.0]
    window_fwd = nd * d.compute_fwd + nm * e.compute_fwd + x.compute_fwd
    window_bwd = nd * d.compute_bwd + nm * e.compute_bwd + x.compute_bwd
    if ep_overlap:
        crit_a2a = a2a[i]
        if crit_a2a > 0.0:
            # the first forward and last backward have no other micro-batch to hide behind: one a2a's worth
            total_a2a = m * crit_a2a
            shown = min(total_a2a, (m - 1) * max(0.0, crit_a2a - window_fwd - window_bwd) + crit_a2a)
            values[_I_A2A] += shown - total_a2a  # the dispatcher's per-call seconds stay (not in crit_a2a)
            hidden[_H_A2A] += total_a2a - shown

    # once per step: gradient sync, parameter all-gather and optimizer of the rank holding the most parameters
    dense = ctx.dense_params.get(DenseParamsKey.of(c))
    expert = ctx.expert_params.get(ExpertParamsKey.of(c))
    if dense is None or expert is None:
        dense, expert = _most_params(ctx, c)
    distributed = c.use_distributed_optimizer
    edp = world // (c.etp * c.ep * pp)
    gkey = GradGroupsKey.of(c)
    groups = ctx.grad_groups.get(gkey)
    if groups is None:  # the gradient-reduction groups, DP·CP and EDP, in closed form
        grids = gkey.grids()
        groups = ctx.grad_groups[gkey] = (grids.group("dp_cp"), grids.group("edp"))
    dp_cp, edp_group = groups
    sync = ctx.syncs.get((dense, dp_cp, distributed)) or _sync(ctx, dense, dp_cp, distributed)
    dg, dg_b, dpg, dpg_b = sync
    sync = ctx.syncs.get((expert, edp_group, distributed)) or _sync(ctx, expert, edp_group, distributed)
    eg, eg_b, epg, epg_b = sync
    local = dense / (c.cp * dp) + expert / edp if distributed else dense + expert
    values[_I_MEM] -= _first_write_seconds(ctx, dense, expert)
    if ctx.fp8_weight_cast:
        # the busiest rank's GEMM weights, the share of them whose linears are priced fp8 (the executor
        # quantises a weight only where its linear runs fp8; all of them under Transformer Engine)
        low = nd * d.weights[0] + nm * e.weights[0] + x.weights[0]
        fp8 = nd * d.weights[1] + nm * e.weights[1] + x.weights[1]
        share = fp8 / low if low > 0 else 1.0
        values[_I_MEM] += memory_time(ctx.rates, ctx.fp8_weight_cast * share * _most_gemm_weights(ctx, c), kernels=0)
    traffic, kernels = optimizer_traffic(c.optimizer_dtypes, training.param_bytes == _FP32_BYTES)
    blocks = -(-local // OPT_STATE_BLOCK_ELEMENTS) if kernels else 0
    optimizer = (local * ctx.optimizer_seconds_per_param * traffic
                 + (4 + blocks * kernels) * ctx.rates.kernel_overhead) * contention
    if c.optimizer_cpu_offload_fraction:
        optimizer = optimizer_offload_seconds(local, c.optimizer_cpu_offload_fraction, optimizer,
                                              training.param_bytes, cluster.hardware, traffic)
    if c.activation_offload_modules:
        values[_I_MEM] += m * activation_offload_seconds(model, training, cluster, c, nd, nm, d.compute_fwd,
                                                         e.compute_fwd)
    grads = dg + eg
    gathers = dpg + epg
    dp_grad = edp_grad = param_gather = pp_p2p = 0.0
    skey = StepStatKey.of(c)
    stats = ctx.step_stats.get(skey)
    if stats is None:
        stats = _step_stat_seconds(ctx, c, skey)
    if grads:
        exposed = grads
        if c.overlap_grad_reduce:  # hidden behind the last micro-batch's backward, but for the last bucket
            exposed = min(grads, max(grads - window_bwd, dg_b, eg_b))
        dp_grad = exposed * dg / grads
        edp_grad = exposed * eg / grads
        hidden[_H_DP] = dg - dp_grad
        hidden[_H_EDP] = eg - edp_grad
        # hidden is not free: the compute beside the collective loses the measured share of its seconds
        dp_grad += ctx.overlap_slowdown * hidden[_H_DP]
        edp_grad += ctx.overlap_slowdown * hidden[_H_EDP]
    # after the backward, in line: the TP sums of replicated gradients and the step's statistics
    dp_grad += stats
    if router is not None:
        dp_grad += global_aux_seconds(ctx, c, router, m)
    if gathers:
        param_gather = gathers
        if c.overlap_param_gather:  # hidden behind the first micro-batch's forward, but for the first bucket
            param_gather = min(gathers, max(gathers - window_fwd, dpg_b, epg_b))
        hidden[_H_GATHER] = gathers - param_gather
        param_gather += ctx.overlap_slowdown * hidden[_H_GATHER]
    if pp > 1:
        hkey = (layers.p2p_bytes, world, pp)
        hop = ctx.hops.get(hkey)
        if hop is None:
            place = GroupPlacements.of_config(c, ctx.gpus_per_node).of("pp")
            hop = ctx.hops[hkey] = p2p_time(ctx.link, layers.p2p_bytes, place.crosses_nodes)
        pp_p2p = 2 * (pp * vpp - 1) * hop  # the first micro-batch's trip through every chunk boundary
        if vpp > 1:  # interleaved schedules overlap their steady-state p2p with compute
            hidden[_H_P2P] = 2 * m * vpp * hop
        else:
            pp_p2p += 2 * m * hop
    # once per step the host issues the reduction, optimizer and zeroing ops of the rank's layers
    once = dp_grad + edp_grad + param_gather + optimizer
    host_step = host[2] * host_factor * contention
    # CPU ranks (timed alone, ctx.cpu_cores): a gloo collective and every op run on the rank's own thread, so the
    # host's once-per-step work (issuing the reduction, the optimizer's and zeroing ops) adds to them
    serial_host = ctx.cpu_cores is not None
    values += (dp_grad, edp_grad, param_gather, pp_p2p, others / vpp, optimizer,  # _STEP_TAIL order
               host_overhead + (host_step if serial_host else host_step - once if host_step > once else 0.0))
    if corrections:
        values = _corrected(values, corrections)
    if corrections or serial_host:
        step = sum(values)
    else:
        # the same sum, grouped so that layouts whose once-per-step work hides under the same host floor get
        # bit-identical step times (the ranker orders them without a tolerance)
        step = (sum(values[:N_PREFIX]) + pp_p2p + values[_I_BUBBLE] + host_overhead) + (host_step if host_step > once
                                                                                          else once)
    per_gpu = step * world
    # The frozen dataclass's generated __init__ sets each field through object.__setattr__ and costs
    # about as much as the arithmetic above; filling the instance dict directly gives the same object.
    breakdown = _new_object(StepTimeBreakdown)
    breakdown.__dict__.update(
        step_time=step, terms=tuple(zip(TERMS, values)), hidden=tuple(zip(HIDDEN_TERMS, hidden)),
        tokens_per_s_per_gpu=ctx.tokens_per_step / per_gpu, tflops_per_gpu=ctx.flops_per_step / per_gpu / 1e12,
        mfu=ctx.flops_per_step / per_gpu / ctx.peak, bottleneck=_bottleneck(values, step))
    return breakdown


def _micro_batches(training: TrainingSpec, c: ParallelConfig, dp: int) -> int:
    """Micro-batches per step of each pipeline; InvalidConfigError unless the global batch divides evenly."""
    m, rest = divmod(training.global_batch_size, c.micro_batch_size * dp)
    if m == 0 or rest:
        raise InvalidConfigError(
            f"global_batch_size ({training.global_batch_size}) must be a positive multiple of "
            f"micro_batch_size·dp ({c.micro_batch_size}·{dp} = {c.micro_batch_size * dp})")
    return m


# Relative amount steady_state_floor is rounded down by: its sum and estimate_step_time's add the same non-negative
# seconds in another order, so the two may differ by float rounding (~1e-16 of the step), never by this much.
FLOOR_ROUNDING = 1e-9
_ALL_SLOTS = tuple(range(N_SLOTS))
_NO_A2A_SLOTS = tuple(i for i in range(N_SLOTS) if i != A2A)


def steady_state_floor(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, config: ParallelConfig,
                       corrections: Mapping[str, float] | None = None) -> float:
    """A lower bound (seconds) on the step time of ``config`` (``estimate_step_time`` with ``corrections``)
    less its once-per-step terms, its pipeline bubble and, with EP overlap, its ep_a2a: the micro-batches of a
    step times the exposed seconds per micro-batch of the least loaded pipeline rank's decoder layers (with EP
    overlap without their EP all-to-all slot), its embedding, output head and chunk end, less the step's
    first-write saving on the main-gradient accumulation (which the estimate takes off memory_bound too),
    rounded down by ``FLOOR_ROUNDING``.

    It holds because the estimate only adds non-negative seconds to these (recomputation, the host floor,
    activation offload, the MTP blocks), its slowest rank carries at least the least loaded rank's layers, and
    corrections are positive factors per term. Cheap: it sums cached layer parts (per tp, cp, micro-batch, SP,
    TP overlap, and the routed experts' per MoE tokens, ep, etp, dispatcher) without assembling a step, so the
    planner keys its best-first queue on it and spends a full estimate on the exact bound only for the
    candidates the queue reaches. Raises InvalidConfigError where ``estimate_step_time`` would reject the layout.
    """
    c = config
    m = _micro_batches(training, c, c.world_size // (c.tp * c.cp * c.pp))
    ctx = _context(model, training, cluster)
    _check(model, training, c)
    kinds = ctx.kinds.get((c.pp, c.vpp, c.pipeline_split))
    if kinds is None:
        _check_pipeline(model, c)
        kinds = _stage_kinds(ctx, c.pp, c.vpp, c.pipeline_split)
    factors = None
    if corrections:
        factors = [1.0] * N_SLOTS
        for name, factor in corrections.items():
            if name not in HOST_FACTORS:
                slot = LAYER_SLOT.get(TERMS[term_index(name, "correction term")])
                if slot is not None:
                    factors[slot] = factor
    key = LayerKey.of(c)
    (dense, moe, embed, head, _, chunk_end), shape = _combos(ctx, key)
    routed = _ZERO_LAYER
    if model.is_moe:  # as _build_layers
        routed = _part(ctx, "moe_routed", key.routed(training.seq_length), shape, key)
    # a floor must not exceed the estimate: without the all-to-all where either overlap may hide it
    slots = (_NO_A2A_SLOTS if c.overlap_moe_expert_parallel_comm or c.moe_shared_expert_overlap
             else _ALL_SLOTS)
    d, e, r, x, em, hd = (_part_seconds(part, slots, factors) for part in (dense, moe, routed, chunk_end, embed, head))
    least = min(nd * d + nm * (e + r) + x + (em if first else 0.0) + (hd if last else 0.0)
                for _, nd, nm, (first, last), _ in kinds)
    # the estimate's once-per-step saving on the main-gradient accumulation, from its memory_bound term
    saving = 0.0
    if ctx.first_write_saving:
        dense_params, expert_params = _most_params(ctx, c)
        saving = _first_write_seconds(ctx, dense_params, expert_params) * (factors[MEM] if factors else 1.0)
    return (m * least - saving) * (1.0 - FLOOR_ROUNDING)


def _part_seconds(part: _LayerCost, slots: tuple[int, ...], factors: list[float] | None) -> float:
    """Exposed seconds per micro-batch of ``part`` in ``slots``, each slot's times its factor (None: all 1)."""
    if factors is None:
        return part.total if slots is _ALL_SLOTS else sum([part.exposed[i] for i in slots])
    return sum([factors[i] * part.exposed[i] for i in slots])


def global_aux_seconds(ctx: _Context, c: ParallelConfig, router: RouterOptions, micro_batches: int) -> float:
    """Seconds a step of ``c`` spends in the global aux loss's all-reduces over DP·CP (one per MoE layer of the
    busiest pipeline rank and micro-batch, the tokens per expert in int64; 0 without the global aux loss or
    with one DP·CP rank): costmodel.collective_inventory.router_calls lists the same call."""
    model = ctx.model
    if not model.is_moe or c.world_size // (c.tp * c.pp) <= 1:
        return 0.0
    resolved = router.resolve(model)
    if resolved.moe_router_load_balancing_type != "global_aux_loss" or not resolved.moe_aux_loss_coeff:
        return 0.0
    chunks = _params.layer_chunks(len(ctx.pattern), c.pp, c.vpp, c.pipeline_split)
    moe_layers = max(sum(ctx.pattern[i] for chunk in stage for i in chunk) for stage in chunks)
    call = Call("all_reduce", "dp_cp", (model.num_experts or 0) * _INT64_BYTES, "forward")
    place = GroupPlacements.of_config(c, ctx.gpus_per_node).of("dp_cp")
    return micro_batches * moe_layers * call_time(ctx.link, call, place)


def optimizer_traffic(dtypes: tuple[str, str, str], params_fp32: bool) -> tuple[float, int]:
    """(the step's bytes per element relative to the fp32 recipe's :data:`OPTIMIZER_BYTES_PER_PARAM`, kernels
    launched per block of :data:`costmodel.memory.OPT_STATE_BLOCK_ELEMENTS`: 0 when every state is fp32) for
    optimizer state ``dtypes`` (exp_avg, exp_avg_sq, main_params; fp32 weights keep no master)."""
    states = dtypes if not params_fp32 else dtypes[:2]
    narrow = [d for d in states if d != "fp32"]
    if not narrow:
        return 1.0, 0
    extra = sum(2 * OPTIMIZER_DTYPE_BYTES[d] + 8 + (NARROW_STATE_SCALE_BYTES if d != "bf16" else 0) for d in narrow)
    return (OPTIMIZER_BYTES_PER_PARAM + extra) / OPTIMIZER_BYTES_PER_PARAM, 1 + sum(NARROW_STATE_KERNELS[d]
                                                                                   for d in narrow)


def optimizer_offload_seconds(local_params: float, fraction: float, gpu_seconds: float, param_bytes: int,
                              hardware, traffic: float = 1.0) -> float:
    """Seconds of an optimizer step with ``fraction`` of this rank's ``local_params`` optimizer elements on the
    CPU (executor/optimizer.py): their fp32 gradients go device-to-host first (4 B each over the host link);
    then the GPU steps its share (``(1 - fraction)`` of ``gpu_seconds``, the whole step's device seconds) while
    the CPU steps the rest (12 B of fp32 state each at ``cpu_adam_bytes_per_s``, times ``traffic`` for a
    precision-aware optimizer's widening and narrowing, :func:`optimizer_traffic`); then the updated weights
    come back host-to-device in their dtype (``param_bytes`` each)."""
    host = fraction * local_params
    link = hardware.host_link_bytes_per_s
    d2h, h2d = host * _FP32_BYTES / link, host * param_bytes / link
    cpu = host * 3 * _FP32_BYTES * traffic / hardware.cpu_adam_bytes_per_s
    gpu = (1.0 - fraction) * gpu_seconds
    return d2h + (gpu if gpu > cpu else cpu) + h2d


def activation_offload_seconds(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec,
                               config: ParallelConfig, dense_layers: int, moe_layers: int, dense_fwd: float,
                               moe_fwd: float) -> float:
    """Exposed seconds per micro-batch of activation offload on a rank with these layers: each layer's
    offloaded tensors go to the host on a side stream during its forward (exposed only where the copy
    outlasts the layer's forward compute, ``dense_fwd``/``moe_fwd`` seconds) and come back in its backward on
    the compute stream, unprefetched (exposed whole)."""
    link = cluster.hardware.host_link_bytes_per_s
    dense, moe = offloaded_layer_bytes(model, training, config)
    out = 0.0
    for n, nbytes, fwd in ((dense_layers, dense, dense_fwd), (moe_layers, moe, moe_fwd)):
        copy = nbytes / link
        out += n * ((copy - fwd if copy > fwd else 0.0) + copy)
    return out


def _corrected(values: list[float], corrections: Mapping[str, float]) -> list[float]:
    """``values`` (in TERMS order) with each named term multiplied by its correction factor."""
    out = list(values)
    for name, factor in corrections.items():
        out[term_index(name, "correction term")] *= factor
    return out


def _bottleneck(v: list[float], step: float) -> str:
    """The largest non-compute limiter when it takes BOTTLENECK_MIN_SHARE of the step, else 'compute'.

    ``v`` is in TERMS order; each candidate sums the terms the term table gives its label.
    """
    label, seconds = None, 0.0
    for name, first, rest in _LIMITERS:
        s = v[first]
        for i in rest:
            s += v[i]
        if label is None or s > seconds:  # the earlier label wins a tie
            label, seconds = name, s
    return label if seconds >= BOTTLENECK_MIN_SHARE * step > 0.0 else "compute"


@dataclass(frozen=True)
class PartTime:
    """Raw (before overlap) seconds per micro-batch of one part of a layer, forward and backward, per term."""

    fwd: tuple[tuple[str, float], ...]
    bwd: tuple[tuple[str, float], ...]

    @property
    def fwd_time(self) -> float:
        return sum(v for _, v in self.fwd)

    @property
    def bwd_time(self) -> float:
        return sum(v for _, v in self.bwd)


def layer_times(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec,
                config: ParallelConfig) -> dict[str, PartTime]:
    """Raw forward/backward seconds per micro-batch of each layer part on one GPU of ``config``.

    Parts: 'attention' (input norm to residual), 'dense_mlp', 'moe' (pre-MLP norm, router, dispatch,
    experts, combine, shared experts, residual), 'embedding', 'head'. For explanations and for checking
    single-layer measurements; not used by the hot path.
    """
    ctx = _context(model, training, cluster)
    shape = _Shape(ctx, LayerKey.of(config))
    parts = {"attention": shape.attention, "dense_mlp": shape.dense_mlp, "embedding": shape.embedding,
             "head": shape.head}
    if model.is_moe:
        parts["moe"] = shape.moe
    out = {}
    for name, build in parts.items():
        block = _Block()
        build(block)
        out[name] = PartTime(tuple(zip(LAYER_TERMS, block.fwd)), tuple(zip(LAYER_TERMS, block.bwd)))
    return out


def moe_piece_times(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec,
                    config: ParallelConfig) -> dict[str, float]:
    """Forward + backward seconds per micro-batch of the routed MoE part's pieces on one rank of ``config``, each
    priced alone as :meth:`_Shape.moe_routed` prices it (the profile's router and permutation factors applied):
    'router', 'permute', 'sort' (by local expert and back, where a token exchange has more than one local
    expert), 'unpermute', 'grouped_gemm' (the two grouped GEMMs) and 'experts_other' (the experts' activation,
    casts, biases and gradient accumulation). The exchange itself is left out (``costmodel.dispatch``).
    What bench/finegrained_moe.py compares its measurements with."""
    if not model.is_moe:
        raise InvalidConfigError(f"model {model.name!r} has no MoE layers to price")
    ctx = _context(model, training, cluster)
    shape = _Shape(ctx, LayerKey.of(config))
    out = {}
    for name, build in (("router", shape.moe_router), ("permute", shape.moe_permute),
                        ("unpermute", shape.moe_unpermute), ("experts", shape.moe_experts)):
        block = _Block()
        build(block)
        if name == "experts":
            out["grouped_gemm"] = block.fwd[GROUPED] + block.bwd[GROUPED]
            out["experts_other"] = sum(block.fwd) + sum(block.bwd) - out["grouped_gemm"]
        else:
            out[name] = sum(block.fwd) + sum(block.bwd)
    local_experts = max(1, (model.num_experts or 1) // config.ep)
    sort = 0.0
    if local_experts > 1 and config.moe_token_dispatcher_type != "allgather":
        block = _Block()
        shape.elementwise(block, sort_bytes(shape.moe_received(), model.hidden_size, shape.act_bytes),
                          scale=shape.permute_factor)
        sort = sum(block.fwd) + sum(block.bwd)
    out["sort"] = sort
    return out


@dataclass(frozen=True)
class StageKind:
    """Pipeline ranks that hold the same work: how many, their decoder layers of each kind, whether they hold the
    embedding (first stage) and the output head (last), and their recomputation seconds per micro-batch."""

    count: int
    dense_layers: int
    moe_layers: int
    first: bool
    last: bool
    recompute_s: float
    stages: tuple[int, ...]


@dataclass(frozen=True)
class LayoutParts:
    """Per micro-batch seconds, by term (exposed after the in-layer overlap of TP traffic), of the pieces a
    layout's pipeline ranks are made of: one dense and one MoE decoder layer, the embedding, one output head,
    what else the last stage adds (head-feature blocks: MTP) and each chunk's end; how the ranks group into
    stage kinds; micro-batches per step and virtual stages. What ``foldtune verify`` compares a one-rank slice
    with, and re-assembles a step from (:mod:`costmodel.slices`)."""

    dense: dict[str, float]
    moe: dict[str, float]
    embedding: dict[str, float]
    head: dict[str, float]
    head_blocks: dict[str, float]
    chunk_end: dict[str, float]
    kinds: tuple[StageKind, ...]
    micro_batches: int
    vpp: int


def layout_parts(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec,
                 config: ParallelConfig) -> LayoutParts:
    """The :class:`LayoutParts` of ``config``: the same cached parts :func:`estimate_step_time` sums."""
    c = config
    ctx = _context(model, training, cluster)
    _check_pipeline(model, c)
    m = _micro_batches(training, c, c.world_size // (c.tp * c.cp * c.pp))
    layers = _layers(ctx, c)
    (_, _, embed, head, _, chunk_end), _ = _combos(ctx, LayerKey.of(c))
    kinds = _stage_kinds(ctx, c.pp, c.vpp, c.pipeline_split)
    _, recompute = _stage_times(layers, kinds, c, _region_seconds(ctx, c, kinds))

    def terms(part: _LayerCost) -> dict[str, float]:
        return dict(zip(LAYER_TERMS, part.exposed))

    tail = layers.extras[(False, True)]  # the last stage's head, head blocks and chunk end
    blocks = {name: t - h - e for name, t, h, e in zip(LAYER_TERMS, tail.exposed, head.exposed, chunk_end.exposed)}
    return LayoutParts(
        dense=terms(layers.dense), moe=terms(layers.moe), embedding=terms(embed), head=terms(head),
        head_blocks=blocks, chunk_end=terms(chunk_end),
        kinds=tuple(StageKind(count, nd, nm, first, last, r, tuple(ranks))
                    for (count, nd, nm, (first, last), ranks), r in zip(kinds, recompute)),
        micro_batches=m, vpp=c.vpp)
