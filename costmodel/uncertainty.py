"""Intervals on every estimate: where each term's constants come from, and how sure the model can be of it.

Every row of the term table (``costmodel.terms.TERM_TABLE``) names the constants it is priced from (its
``constants`` column: a compute curve, the HBM rate, a collective over a named group, the host, or ``derived``
from other terms). :func:`term_provenance` resolves that name against the hardware profile and the layout into
one :class:`Provenance` per term:

* ``calibrated``: the executor's own blocks were timed on this GPU type at this model's shape (the profile's
  component factors, ``foldtune calibrate --model``, at this rank's tokens per micro-batch within 2x);
* ``measured``: a microbenchmark curve of this GPU type covers the size this layout uses (GEMM FLOPs, tokens
  per expert, key length, a collective over a group of this size inside a node);
* ``extrapolated``: a curve of this GPU type exists, but this layout uses it beyond its measured sizes (a
  smaller GEMM, a larger group, another expert shape, a longer sequence), or the constant is a measured lower
  bound (the bare op launch, without the executor's Python between ops);
* ``datasheet``: nothing measured: the datasheet peak times a default efficiency, or a rule of thumb;
* ``unmeasured_network``: a collective across nodes on a network the profile never measured.

Each provenance carries a relative width (:data:`WIDTHS`): a term of ``v`` seconds lies in
``[v (1 - low), v (1 + high)]``. The widths are set from microbenchmark and datasheet reasoning
(docs/time-model.md, "Intervals"), never fitted to end-to-end results. They describe an interval meant to
hold the measured step at :data:`RATE` of layouts.

Combining (:func:`step_time_interval`): terms priced from the same constant err together, so their seconds add
linearly into one source; independent sources add in quadrature. Terms derived from others (recomputation,
the pipeline bubble) are spread over the sources of the layer terms they are made of. The host is not a term
that adds: a rank runs at the slower of its device work and its host's issuing, so the host's interval enters
through that maximum. Overlapped communication is worst-case: at the pessimistic end a hidden collective is
as slow as its own width says, and the overlap may leave :data:`OVERLAP_EXPOSED` of what the model hides
exposed. Memory (:func:`memory_interval`) follows the same pattern with the memory model's buckets.

Calibration residuals narrow an interval: :func:`narrowed` replaces each side's width by the prediction error
a fit over measured trials shows (its relative RMSE over ``n`` trials), where that is the smaller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from costmodel.comm import GroupPlacements, Placement, group_placement
from costmodel.memory import MemoryBreakdown
from costmodel.step_time import HOST_FACTOR, HOST_RECOMPUTE_FACTOR, StepTimeBreakdown, host_seconds_per_micro_batch
from costmodel.terms import HIDDEN_TERMS, TERM_TABLE
from spec.attention_kinds import attention_kind
from spec.cp_comm_types import HIERARCHICAL
from spec.dispatchers import FLEX_DISPATCHERS, GATHERING_DISPATCHERS
from spec.hardware import ClusterSpec, HardwareProfile, MeasuredCurve, expert_shape, parse_component_key
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.shape_defaults import is_cpu
from spec.training_spec import TrainingSpec

#: the share of layouts whose measured value an interval is meant to hold
RATE = 0.80


@dataclass(frozen=True)
class Width:
    """Relative uncertainty of one priced quantity: the truth lies in ``[v·(1 − low), v·(1 + high)]``."""

    low: float
    high: float


# Provenance names, most certain first.
CALIBRATED, MEASURED, EXTRAPOLATED, DATASHEET, UNMEASURED_NETWORK = (
    "calibrated", "measured", "extrapolated", "datasheet", "unmeasured_network")
PROVENANCES = (CALIBRATED, MEASURED, EXTRAPOLATED, DATASHEET, UNMEASURED_NETWORK)

# docs/time-model.md, "Intervals", gives the reasoning behind each width:
# * calibrated: the executor's blocks timed at this shape leave the spread between runs and machines of one
#   GPU type: a layout measured twice on two H200s differed by up to 12 % (host-bound rows more);
# * measured: a kernel timed alone runs 13-16 % off its time inside a step (clocks, caches, the host ahead or
#   behind), slower more often than faster;
# * extrapolated: a curve held flat beyond its last point: below the smallest measured size efficiency keeps
#   falling (a 1 GFLOP GEMM runs at 0.07 of peak, 8 GFLOP at 0.54), above it rises by up to the plateau;
# * datasheet: the default efficiencies are microbenchmark ceilings (bf16 GEMM 0.79 of peak): a kernel cannot
#   run faster than the peak (low ~ 1 - 0.79), and real shapes reach half the ceiling or less (2x);
# * unmeasured network: the NIC default is 75-80 % of line rate; an all-to-all over many peers reaches a
#   third of line rate or less on a congested fabric (2.5x), and never more than line rate.
WIDTHS: dict[str, Width] = {
    CALIBRATED: Width(0.10, 0.12),
    MEASURED: Width(0.15, 0.25),
    EXTRAPOLATED: Width(0.25, 0.50),
    DATASHEET: Width(0.25, 1.00),
    UNMEASURED_NETWORK: Width(0.25, 1.50),
}
# The host's issuing rate (costmodel/host.py). Against a host floor built from the measured executor MoE layer,
# the host probe measured 0.69-3.36x (median 2.47) over 35 layouts of two proxies; this model's own probe
# (component host factors) leaves the spread between processes, factors of 1.4-2.4 measured on one host. A bare
# op launch (7.8-10.5 us on eight H200 hosts) is a third to a half of the executor's cost per op on the same
# hosts (20-36 us, its MoE layer over its 162 ops), and the rule of thumb of 8 us is such a bare launch: both
# price the host up to ~7x short.
HOST_WIDTHS: dict[str, Width] = {
    CALIBRATED: Width(0.25, 0.50),
    MEASURED: Width(0.30, 2.40),
    EXTRAPOLATED: Width(0.50, 6.00),
    DATASHEET: Width(0.50, 6.00),
}
# Hidden seconds the overlap may leave exposed at the pessimistic end, per hidden term: the EP all-to-all
# overlap hid 0.38-0.69 of the all-to-all in the EP2 measurements (the model hides nearly all but the first
# and last); Megatron's TP overlap was never measured here; the bucketed gradient and parameter overlap runs
# in every measured multi-GPU table; interleaved p2p hides behind whole chunks.
OVERLAP_EXPOSED: dict[str, float] = {"tp_comm": 0.5, "cp_comm": 0.5, "ep_a2a": 0.5, "dp_grad": 0.1,
                                     "edp_grad": 0.1, "param_gather": 0.1, "pp_p2p": 0.25}
# Memory buckets: weights, gradients and optimizer state are exact counts of the model's parameters; the
# activations, logits and buffers are the memory model's per-tensor account of the executor, which matched the
# measured peaks of three proxies within -4.4 % .. +4.5 %; the allocator's share is a measured fraction where
# calibration measured it, a prior (5 %) otherwise; NCCL's own buffers are not in the account.
MEMORY_WIDTHS: dict[str, Width] = {
    "weights": Width(0.01, 0.01), "grads": Width(0.01, 0.01), "optimizer": Width(0.01, 0.01),
    "activations": Width(0.08, 0.10), "logits": Width(0.08, 0.10), "comm_buffers": Width(0.25, 0.50),
}
ALLOCATOR_WIDTHS = {MEASURED: Width(0.50, 0.50), DATASHEET: Width(1.00, 2.00)}
# Shared by every term priced from one calibration run: eight calibrations of H200 GPUs gave large GEMMs,
# attention and 16 MiB collectives within 3-8 % of each other (the clocks and the machine on the day), so a
# profile's measured curves may all sit a few percent off together.
COMMON_MEASURED = Width(0.05, 0.05)
# Curves are timed in bursts at the boost clock; under seconds of load H100/H200 sustain 0.83-0.85 of it (seven
# calibrations measured it). A GPU profile without that measurement may price its tensor-core terms this much
# too fast.
CLOCK_UNMEASURED = 1.0 / 0.83 - 1.0
_CLOCKED = ("gemm", "grouped_gemm", "attention")
# a component factor measured at tokens per micro-batch within this ratio of the rank's counts as this shape
COMPONENT_TOKEN_RATIO = 2.0
# a curve answers for sizes up to this factor beyond its end points before the use counts as extrapolated
CURVE_SLACK = 2.0
# z of a two-sided interval holding RATE of a normal error (1.2816 for 80 %), for calibration residuals
Z_RATE = 1.2816


@dataclass(frozen=True)
class TermProvenance:
    """Where one term's constants come from for one layout: the source it shares errors with (terms of one
    source add linearly), its provenance, the width that gives, and a few words a user can check."""

    term: str
    source: str
    provenance: str
    width: Width
    note: str

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "provenance": self.provenance, "low": self.width.low,
                "high": self.width.high, "note": self.note}


@dataclass(frozen=True)
class Interval:
    """A predicted value and the interval meant to hold the measurement at :data:`RATE` (same unit)."""

    value: float
    low: float
    high: float

    def covers(self, measured: float) -> bool:
        return self.low <= measured <= self.high

    def to_dict(self) -> dict[str, float]:
        return {"value": self.value, "low": self.low, "high": self.high}


@dataclass(frozen=True)
class EstimateInterval:
    """Step time (seconds) and memory (bytes) of one layout as intervals, with each term's provenance."""

    step_time: Interval
    memory: Interval
    terms: tuple[TermProvenance, ...]
    rate: float = RATE

    def to_dict(self) -> dict[str, Any]:
        return {"rate": self.rate, "step_time_s": self.step_time.to_dict(), "memory_bytes": self.memory.to_dict(),
                "time_provenance": {p.term: p.to_dict() for p in self.terms}}


# ---- resolving a term's constants -----------------------------------------------------------------------------
def _curve_provenance(curve: MeasuredCurve | None, sizes: tuple[float, ...]) -> str:
    """``measured`` when every size lies within the curve's measured range (with CURVE_SLACK), ``extrapolated``
    beyond it, ``datasheet`` without a curve."""
    if curve is None:
        return DATASHEET
    lo, hi = curve.points[0][0] / CURVE_SLACK, curve.points[-1][0] * CURVE_SLACK
    return MEASURED if all(lo <= s <= hi for s in sizes if s > 0) else EXTRAPOLATED


def _tokens(training: TrainingSpec, c: ParallelConfig) -> float:
    """Rows of this rank's dense GEMMs per micro-batch (tokens after the sequence-parallel gather)."""
    return c.micro_batch_size * training.seq_length / c.cp


def _gemm(model: ModelSpec, training: TrainingSpec, hw: HardwareProfile, c: ParallelConfig) -> tuple[str, str]:
    m = _tokens(training, c)
    h = model.hidden_size
    smallest = 2.0 * m * h * (model.num_attention_heads * model.head_dim) / c.tp  # the attention projection
    largest = 2.0 * m * h * model.vocab_size / c.tp  # the output layer
    prov = _curve_provenance(hw.gemm_efficiency, (smallest, largest))
    return prov, f"GEMMs of {smallest:.2g}-{largest:.2g} FLOP" + _range_note(hw.gemm_efficiency)


def _grouped(model: ModelSpec, training: TrainingSpec, hw: HardwareProfile, c: ParallelConfig) -> tuple[str, str]:
    if not model.num_experts:
        return MEASURED, "no experts"
    per_expert = (c.micro_batch_size * training.seq_length * model.moe_router_topk * c.ep * c.etp
                  / (c.tp * c.cp * model.num_experts))
    ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size
    shapes = {expert_shape(k): curve for k, curve in hw.grouped_gemm_shape_efficiency}
    curve = shapes.get((model.hidden_size, ffn))
    if curve is not None:
        prov = _curve_provenance(curve, (per_expert,))
        return prov, (f"{per_expert:.0f} tokens per expert, shape {model.hidden_size}x{ffn} measured"
                      + _range_note(curve))
    if hw.grouped_gemm_efficiency is None:
        return DATASHEET, "no grouped-GEMM curve"
    return EXTRAPOLATED, f"expert shape {model.hidden_size}x{ffn} not measured (another shape's curve)"


def _attention(model: ModelSpec, training: TrainingSpec, hw: HardwareProfile, c: ParallelConfig) -> tuple[str, str]:
    mla = attention_kind(model).name == "mla"
    curve = hw.attention_mla_fwd_efficiency if mla and hw.attention_mla_fwd_efficiency else hw.attention_fwd_efficiency
    if curve is None:
        return DATASHEET, "assumed flash-attention efficiencies"
    return _curve_provenance(curve, (float(training.seq_length),)), \
        f"key length {training.seq_length}" + _range_note(curve)


def _hbm(model: ModelSpec, training: TrainingSpec, hw: HardwareProfile, c: ParallelConfig) -> tuple[str, str]:
    if hw.memory_bound_efficiency:
        return MEASURED, "measured memory-bound ops (bandwidth and seconds per kernel, per op class)"
    if hw.hbm_efficiency:
        return MEASURED, "measured copy bandwidth"
    return DATASHEET, "datasheet HBM bandwidth x default efficiency"


def _optimizer(model: ModelSpec, training: TrainingSpec, hw: HardwareProfile, c: ParallelConfig) -> tuple[str, str]:
    if hw.optimizer_seconds_per_param:
        return MEASURED, "the executor's optimizer step measured"
    if hw.hbm_efficiency:
        return EXTRAPOLATED, "bytes per parameter at the measured copy bandwidth"
    return DATASHEET, "bytes per parameter at the datasheet HBM bandwidth"


def _range_note(curve: MeasuredCurve | None) -> str:
    if curve is None:
        return ""
    return f" (measured {curve.points[0][0]:.3g}-{curve.points[-1][0]:.3g})"


# the collective each communication term runs (the ring kind that dominates its seconds) and over which group
_COLLECTIVES = {"tp_comm": ("all_gather", "tp"), "cp_comm": ("all_gather", "cp"),  # by cp_comm_type: _cp_collective
                "etp_comm": ("all_gather", "etp"),
                "dp_grad": ("reduce_scatter", "dp_cp"), "edp_grad": ("reduce_scatter", "edp"),
                "param_gather": ("all_gather", "dp_cp"), "pp_p2p": ("p2p", "pp")}


def _cp_collective(config: ParallelConfig, places: GroupPlacements) -> tuple[str, Placement]:
    """The collective that dominates cp_comm's seconds under ``config.cp_comm_type`` and where its group sits:
    allgather's K/V all-gather over CP, p2p's ring hops, a2a's all-to-alls over CP, a2a+p2p's all-to-alls over
    its sub-group of the nearest ``a`` CP ranks (the ring across sub-groups is hidden in part by attention)."""
    kind = config.cp_comm_type
    if kind == "p2p":
        return "p2p", places.of("cp")
    if kind == "a2a":
        return "all_to_all", places.of("cp")
    if kind == HIERARCHICAL:
        a2a, _ = config.cp_split
        return "all_to_all", group_placement(places.sizes.group("cp").stride, a2a, places.gpus_per_node)
    return "all_gather", places.of("cp")


def _measured_sizes(hw: HardwareProfile, collective: str, scope: str) -> tuple[int, ...]:
    out = []
    for key, _ in hw.collective_efficiency:
        parts = key.split(":")
        if len(parts) == 3 and parts[0] == collective and parts[1] == scope and parts[2].isdigit():
            out.append(int(parts[2]))
    return tuple(sorted(out))


def collective_provenance(hw: HardwareProfile, collective: str, place: Placement) -> tuple[str, str, str]:
    """(source, provenance, note) of ``collective`` over a group placed as ``place``: across nodes the network's
    curves (``unmeasured_network`` without them), inside a node the NVLink curves, ``extrapolated`` for a group
    larger than every size calibration measured."""
    scope = "inter" if place.crosses_nodes else "intra"
    source = f"{collective}:{scope}"
    curves = dict(hw.collective_efficiency)
    if f"{collective}:{scope}:{place.size}" in curves:
        return source, MEASURED, f"{place.size} ranks measured"
    if source not in curves:
        if place.crosses_nodes:  # one fabric: every collective across it misses together
            return "network", UNMEASURED_NETWORK, f"{place.nodes} nodes, network never measured"
        return source, DATASHEET, "datasheet link bandwidth x default efficiency"
    sizes = _measured_sizes(hw, collective, scope)
    if sizes and place.size > max(sizes):
        return source, EXTRAPOLATED, f"{place.size} ranks, measured up to {max(sizes)}"
    return source, MEASURED, "measured curve"


def _component_shape(hw: HardwareProfile, model: ModelSpec, training: TrainingSpec, c: ParallelConfig) -> bool:
    """Whether the profile holds component factors of this model measured at this rank's tokens per micro-batch
    (within COMPONENT_TOKEN_RATIO): only then do they make the compute terms ``calibrated``."""
    base = model.name.split("@")[0]
    tokens = training.seq_length * c.micro_batch_size / (c.tp * c.cp)
    for key, _ in hw.component_factors:
        name, seq, mbs = parse_component_key(key)
        if name.split("@")[0] != base:
            continue
        measured = seq * (mbs or 1)
        if max(measured, tokens) / min(measured, tokens) <= COMPONENT_TOKEN_RATIO:
            return True
    return False


_COMPUTE = {"gemm": _gemm, "grouped_gemm": _grouped, "attention": _attention, "hbm": _hbm, "optimizer": _optimizer}
_COLLECTIVE_KINDS = ("collective", "dispatch", "host", "derived")
if set(OVERLAP_EXPOSED) != set(HIDDEN_TERMS):
    raise ImportError(f"costmodel.uncertainty.OVERLAP_EXPOSED must name every hidden term {HIDDEN_TERMS}")
_UNRESOLVED = [t.name for t in TERM_TABLE if t.constants not in _COMPUTE and t.constants not in _COLLECTIVE_KINDS]
if _UNRESOLVED:
    raise ImportError(f"costmodel.terms.TERM_TABLE: no provenance rule for the constants of {_UNRESOLVED}; "
                      f"add one to costmodel/uncertainty.py (known: {sorted(_COMPUTE) + list(_COLLECTIVE_KINDS)})")


def term_provenance(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, config: ParallelConfig,
                    corrections: dict[str, float] | None = None) -> tuple[TermProvenance, ...]:
    """One :class:`TermProvenance` per term of the term table, in its order, for ``config`` on ``cluster``.

    ``corrections`` are the component factors the estimate applied (``costmodel.estimate.component_corrections``):
    a term they scale, measured at this shape, is ``calibrated``; the host is ``calibrated`` when they hold the
    host probe's factor."""
    hw = cluster.hardware
    places = GroupPlacements.of_config(config, cluster.gpus_per_node)
    shape = bool(corrections) and _component_shape(hw, model, training, config)
    burst = hw.sustained_clock_factor is None and not is_cpu(hw.gpu.name)
    out = []
    for term in TERM_TABLE:
        kind = term.constants
        if kind in _COMPUTE:
            if shape and term.name in corrections:
                prov, note = CALIBRATED, "the executor's block timed at this shape"
            else:
                prov, note = _COMPUTE[kind](model, training, hw, config)
            width = WIDTHS[prov]
            if burst and kind in _CLOCKED and prov in (MEASURED, EXTRAPOLATED):
                width = Width(width.low, width.high + CLOCK_UNMEASURED)
                note += "; sustained clock not measured"
            # datasheet defaults miss together (a card below its ceilings is below them for every kernel)
            out.append(TermProvenance(term.name, "datasheet" if prov == DATASHEET else kind, prov, width, note))
        elif kind == "collective":
            collective, group = _COLLECTIVES[term.name]
            if group == "dp_cp" and not config.use_distributed_optimizer:
                collective = "all_reduce"
            place = places.of(group)
            if term.name == "cp_comm":
                collective, place = _cp_collective(config, places)
            source, prov, note = collective_provenance(hw, collective, place)
            out.append(TermProvenance(term.name, source, prov, WIDTHS[prov], note))
        elif kind == "dispatch" and config.moe_token_dispatcher_type in FLEX_DISPATCHERS:
            source, prov, note = _flex_provenance(config.moe_token_dispatcher_type, places.of("tp_ep"))
            out.append(TermProvenance(term.name, source, prov, WIDTHS[prov], note))
        elif kind == "dispatch":
            gathers = config.moe_token_dispatcher_type in GATHERING_DISPATCHERS
            collective, group = ("all_gather", "tp_ep") if gathers else ("all_to_all", "ep")
            source, prov, note = collective_provenance(hw, collective, places.of(group))
            out.append(TermProvenance(term.name, source, prov, WIDTHS[prov], note))
        elif kind == "host":
            prov, note = _host_provenance(hw, corrections)
            out.append(TermProvenance(term.name, "host", prov, HOST_WIDTHS[prov], note))
        else:  # derived: recomputation and the bubble take the widths of the layer terms they are made of
            out.append(TermProvenance(term.name, "derived", "derived", Width(0.0, 0.0),
                                      "the layer terms it repeats or waits for"))
    return tuple(out)


def _flex_provenance(dispatcher: str, place: Placement) -> tuple[str, str, str]:
    """(source, provenance, note) of the flex dispatcher's exchange (costmodel.dispatch.FlexPricing): its
    kernels' published bandwidths on other machines, never measured on this profile: a datasheet figure inside
    a node, an unmeasured network across nodes."""
    if place.crosses_nodes:
        return (f"{dispatcher}:inter", UNMEASURED_NETWORK,
                "the kernels' published RDMA bandwidth on another cluster, not measured on this network")
    return f"{dispatcher}:intra", DATASHEET, "the kernels' published NVLink bandwidth on another GPU, not measured here"


def _host_provenance(hw: HardwareProfile, corrections: dict[str, float] | None) -> tuple[str, str]:
    if corrections and (HOST_FACTOR in corrections or HOST_RECOMPUTE_FACTOR in corrections):
        return CALIBRATED, "this model's host probe"
    if hw.moe_layer_host_s:
        return MEASURED, "the executor's MoE layer on tiny shapes, measured"
    if hw.op_launch_s:
        return EXTRAPOLATED, "bare op launches measured: a lower bound"
    return DATASHEET, "rule-of-thumb launch cost, not measured"


# ---- combining ----------------------------------------------------------------------------------------------
def combine_sources(seconds: dict[tuple[str, str], float], widths: dict[tuple[str, str], Width]) -> tuple[float, float]:
    """(low, high) seconds below and above the sum of ``seconds``: the terms of one source (the dict's keys, a
    (source, provenance) pair) err together, different sources independently (quadrature)."""
    below = math.sqrt(sum((widths[k].low * s) ** 2 for k, s in seconds.items()))
    above = math.sqrt(sum((widths[k].high * s) ** 2 for k, s in seconds.items()))
    return below, above


def step_time_interval(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, config: ParallelConfig,
                       time: StepTimeBreakdown, corrections: dict[str, float] | None = None,
                       provenance: tuple[TermProvenance, ...] | None = None) -> Interval:
    """The step time of ``time`` (seconds) as an interval (module docstring: how the terms combine)."""
    provenance = provenance or term_provenance(model, training, cluster, config, corrections)
    host_exposed = time.term("host_overhead")
    return combine_step(time, provenance, _host_seconds(model, training, cluster, config, time, corrections,
                                                        host_exposed), serial_host=is_cpu(cluster.gpu.name))


def combine_step(time: StepTimeBreakdown, provenance: tuple[TermProvenance, ...], host_seconds: float,
                 serial_host: bool = False) -> Interval:
    """The interval (seconds) of a step breakdown whose terms have ``provenance``, on a rank whose host issues
    its steady state's kernels in ``host_seconds`` per step (0: not known; where the breakdown has a host floor,
    that floor is the steady state plus ``host_overhead``).

    Exposed seconds per (source, provenance) add linearly, sources in quadrature, derived terms (recomputation,
    bubble) spread over the layer terms' sources in proportion; every measured source also moves together by
    :data:`COMMON_MEASURED`; each hidden collective adds ``hidden · (OVERLAP_EXPOSED + its high width)`` to the
    pessimistic end. The host: low and high are at least the step with the host's own low / high issuing time
    in place of the steady state; with ``serial_host`` (CPU ranks: the same cores issue and compute) the
    pessimistic end adds the host's high issuing time to the device's instead."""
    prov = {p.term: p for p in provenance}
    terms = dict(time.terms)
    host_exposed = terms.get("host_overhead", 0.0)
    sources: dict[tuple[str, str], float] = {}
    widths: dict[tuple[str, str], Width] = {}
    layer_total = 0.0
    layer_parts: dict[tuple[str, str], float] = {}
    for t in TERM_TABLE:
        p = prov[t.name]
        s = terms.get(t.name, 0.0)
        if p.source in ("derived", "host") or s <= 0.0:
            continue
        key = (p.source, p.provenance)
        sources[key] = sources.get(key, 0.0) + s
        widths[key] = p.width
        if t.scope == "layer":
            layer_parts[key] = layer_parts.get(key, 0.0) + s
            layer_total += s
    derived = sum(terms.get(t.name, 0.0) for t in TERM_TABLE if prov[t.name].source == "derived")
    if derived > 0.0 and layer_total > 0.0:
        for key, s in layer_parts.items():
            sources[key] += derived * s / layer_total
    below, above = combine_sources(sources, widths)
    # the calibration run's common offset, linearly over everything it measured
    measured = sum(s for k, s in sources.items() if k[1] in (CALIBRATED, MEASURED, EXTRAPOLATED))
    below += COMMON_MEASURED.low * measured
    above += COMMON_MEASURED.high * measured
    # overlapped collectives, worst case: their own pessimistic seconds and the overlap's failure, added linearly
    for name, hidden in time.hidden:
        if hidden > 0.0:
            above += hidden * (OVERLAP_EXPOSED[name] + prov[name].width.high)
    device = time.step_time - host_exposed
    low, high = device - below, device + above
    host = _steady_seconds(time) + host_exposed if host_exposed > 0.0 else host_seconds
    if host > 0.0 and device > 0.0:
        w = prov["host_overhead"].width
        rest = device - _steady_seconds(time)  # once-per-step terms and the bubble, scaled with the device
        low = max(low, rest * low / device + host * (1.0 - w.low))
        high = high + host * (1.0 + w.high) if serial_host else max(high, rest * high / device + host * (1.0 + w.high))
    return Interval(time.step_time, max(0.0, min(low, time.step_time)), max(high, time.step_time))


def _steady_seconds(time: StepTimeBreakdown) -> float:
    """Seconds of the step's steady state: the per-micro-batch layer terms and recomputation (no once-per-step
    terms, no bubble, no host floor)."""
    by = dict(time.terms)
    return sum(by.get(t.name, 0.0) for t in TERM_TABLE
               if not t.per_step and t.name not in ("pp_bubble", "host_overhead"))


def _host_seconds(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, config: ParallelConfig,
                  time: StepTimeBreakdown, corrections: dict[str, float] | None, host_exposed: float) -> float:
    """The busiest pipeline rank's host seconds per step (its micro-batches' issuing, host factors applied)."""
    if host_exposed > 0.0:  # the model's own account (combine_step): the steady state runs at the host's pace
        return 0.0
    base, recompute = host_seconds_per_micro_batch(model, training, cluster, config)
    factor = (corrections or {}).get(HOST_FACTOR, 1.0)
    recompute_factor = (corrections or {}).get(HOST_RECOMPUTE_FACTOR, factor)
    dp = config.world_size // (config.tp * config.cp * config.pp)
    m = training.global_batch_size // (config.micro_batch_size * dp)
    return m * (base * factor + recompute * recompute_factor)


def memory_interval(memory: MemoryBreakdown, hardware: HardwareProfile) -> Interval:
    """The memory total (bytes) as an interval: each bucket of the memory model with its width
    (:data:`MEMORY_WIDTHS`), the static buckets adding linearly (one parameter count), the dynamic ones in
    quadrature, the allocator's share by whether calibration measured it."""
    static = ("weights", "grads", "optimizer")
    below = sum(MEMORY_WIDTHS[n].low * getattr(memory, n) for n in static)
    above = sum(MEMORY_WIDTHS[n].high * getattr(memory, n) for n in static)
    dynamic = ("activations", "logits", "comm_buffers")
    alloc = ALLOCATOR_WIDTHS[MEASURED if hardware.allocator_fragmentation is not None else DATASHEET]
    parts = [(MEMORY_WIDTHS[n], getattr(memory, n)) for n in dynamic] + [(alloc, memory.allocator_overhead)]
    below += math.sqrt(sum((w.low * b) ** 2 for w, b in parts))
    above += math.sqrt(sum((w.high * b) ** 2 for w, b in parts))
    return Interval(memory.total, max(0.0, memory.total - below), memory.total + above)


def estimate_interval(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, config: ParallelConfig,
                      time: StepTimeBreakdown, memory: MemoryBreakdown,
                      corrections: dict[str, float] | None = None) -> EstimateInterval:
    """Step time and memory of one layout as intervals, with every term's provenance."""
    provenance = term_provenance(model, training, cluster, config, corrections)
    return EstimateInterval(step_time_interval(model, training, cluster, config, time, corrections, provenance),
                            memory_interval(memory, cluster.hardware), provenance)


def narrowed(interval: Interval, relative_rmse: float, observations: int,
             calibrated_value: float | None = None) -> Interval:
    """``interval`` around ``calibrated_value`` (default: its own value) after a calibration fitted on
    ``observations`` measured trials with relative RMSE ``relative_rmse``: each side keeps the smaller of its
    relative width and the fit's prediction error ``Z_RATE · rmse · sqrt(1 + 1/n)``; fewer than 3 observations
    say nothing about the spread (the interval is only moved)."""
    value = interval.value if calibrated_value is None else calibrated_value
    if interval.value <= 0.0:
        return Interval(value, value, value)
    lo = (interval.value - interval.low) / interval.value
    hi = (interval.high - interval.value) / interval.value
    if observations >= 3:
        residual = Z_RATE * relative_rmse * math.sqrt(1.0 + 1.0 / observations)
        lo, hi = min(lo, residual), min(hi, residual)
    return Interval(value, value * (1.0 - lo), value * (1.0 + hi))
