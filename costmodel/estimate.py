"""The combined prediction for one layout: its memory and step-time breakdowns, whether it fits, what limits it.

``explanation`` is one line a user can act on: the limiting term, its share of the step, and the fact of
the layout behind it (which group crosses nodes, how many micro-batches fill the pipeline, which memory
term is the largest).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from costmodel.comm import GroupPlacements
from costmodel.dispatch import dispatcher_pricing
from costmodel.host import seconds_per_op
from costmodel.memory import MemoryBreakdown, estimate_memory
from costmodel.step_time import StepTimeBreakdown, estimate_step_time, steady_state_floor as _floor
from costmodel.terms import BOTTLENECK_TERMS
from costmodel.uncertainty import EstimateInterval, estimate_interval, step_time_interval
from spec.hardware import GIB, ClusterSpec
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

HEADROOM_FRACTION = 0.05  # below this share of usable HBM free, memory is called the limiter
MEMORY_TERMS = ("weights", "grads", "optimizer", "activations", "logits", "comm_buffers", "allocator_overhead")

@dataclass(frozen=True)
class Estimate:
    """Predicted memory and step time of one layout; ``memory_headroom_bytes`` = usable HBM - memory.total.
    ``executable``: whether foldtune's executor runs the layout (None: not judged; the planner judges every
    layout it ranks by the rule book's executor rules), ``executable_reason`` the rules it breaks when not
    (a layout only Megatron-Core runs)."""

    config: ParallelConfig
    memory: MemoryBreakdown
    time: StepTimeBreakdown
    fits: bool
    memory_headroom_bytes: float
    limiter: str  # 'memory' when it does not fit or has < 5 % headroom, else time.bottleneck
    explanation: str
    executable: bool | None = None
    executable_reason: str | None = None
    # step time (s) and memory (bytes) as intervals, with each term's provenance (costmodel.uncertainty); None
    # where the estimate was combined without its model (an injected cost model's breakdowns)
    interval: EstimateInterval | None = None

    @property
    def rank_time(self) -> float:
        """The step time the planner ranks by default: the interval's pessimistic end (seconds), the point
        estimate without an interval."""
        return self.interval.step_time.high if self.interval is not None else self.time.step_time

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``foldtune plan --json`` and POST /v1/plans): seconds, tokens/s/GPU, TFLOP/s per
        GPU, bytes; ``time_terms_s`` / ``time_hidden_s`` are the exposed / overlapped seconds per term;
        ``executable`` / ``executable_reason`` whether foldtune's executor runs it and why not;
        ``step_time_interval_s`` / ``memory_interval_bytes`` the intervals meant to hold the measurement at
        ``interval_rate`` of layouts ({"low", "high"}), ``time_provenance`` where each term's constants come from."""
        mem = self.memory
        t = self.time
        out = {
            "layout": self.config.label(),
            "config": self.config.to_dict(),
            "step_time_s": t.step_time,
            "tokens_per_s_per_gpu": t.tokens_per_s_per_gpu,
            "tflops_per_gpu": t.tflops_per_gpu,
            "mfu": t.mfu,
            "fits": self.fits,
            "memory_headroom_bytes": self.memory_headroom_bytes,
            "limiter": self.limiter,
            "explanation": self.explanation,
            "executable": self.executable,
            "executable_reason": self.executable_reason,
            "bottleneck": t.bottleneck,
            "time_terms_s": dict(t.terms),
            "time_hidden_s": dict(t.hidden),
            "memory_bytes": {"total": mem.total, "stage": mem.stage, **{n: getattr(mem, n) for n in MEMORY_TERMS},
                             "details": dict(mem.details), "host_offloaded": mem.host_offloaded},
        }
        if self.interval is not None:
            iv = self.interval
            out.update(step_time_interval_s={"low": iv.step_time.low, "high": iv.step_time.high},
                       memory_interval_bytes={"low": iv.memory.low, "high": iv.memory.high},
                       interval_rate=iv.rate, time_provenance={p.term: p.to_dict() for p in iv.terms})
        return out


def largest_memory_term(memory: MemoryBreakdown) -> tuple[str, float]:
    """(name, bytes) of the largest term of a memory breakdown."""
    return max(((name, getattr(memory, name)) for name in MEMORY_TERMS), key=lambda kv: kv[1])


def _time_context(bottleneck: str, c: ParallelConfig, training: TrainingSpec, cluster: ClusterSpec,
                  time: StepTimeBreakdown) -> str:
    """The fact of the layout behind a time bottleneck, e.g. 'EP16 group spans 2 nodes'."""
    gpn = cluster.gpus_per_node
    places = GroupPlacements.of_config(c, gpn)
    if bottleneck == "all-to-all":
        return dispatcher_pricing(c.moe_token_dispatcher_type).describe(c, gpn)
    if bottleneck == "tp-comm":
        return f"TP{c.tp} group {places.span_text('tp')}"
    if bottleneck == "cp-comm":
        return f"CP{c.cp} {c.cp_comm_text()} group {places.span_text('cp')}"
    if bottleneck == "dp-comm":
        return (f"DP{c.dp} {places.span_text('dp')}, EDP{c.edp} {places.span_text('edp')}"
                + ("" if c.use_distributed_optimizer else ", no distributed optimizer"))
    if bottleneck in ("pp-bubble", "pp-comm"):
        m = c.num_micro_batches(training.global_batch_size)
        return f"PP{c.pp}" + (f" VPP{c.vpp}" if c.vpp > 1 else "") + f" with {m} micro-batches"
    if bottleneck == "compute":
        extra = "" if c.recompute_granularity == "none" else f", recompute {c.recompute_granularity}"
        return f"MFU {time.mfu:.0%}{extra}"
    if bottleneck == "host-overhead":
        return (f"the host issues kernels slower than the GPU runs them ({seconds_per_op(cluster.hardware) * 1e6:.1f} "
                f"us per op), mbs {c.micro_batch_size}")
    if bottleneck == "optimizer":
        return "distributed optimizer" if c.use_distributed_optimizer else "no distributed optimizer"
    return (f"norms, activations, permutation and loss at {cluster.gpu.hbm_bandwidth / 1e12:.2f} TB/s HBM, "
            f"mbs {c.micro_batch_size}")


def explain(config: ParallelConfig, training: TrainingSpec, cluster: ClusterSpec, memory: MemoryBreakdown,
            time: StepTimeBreakdown) -> tuple[str, str]:
    """(limiter, one-line explanation) of a layout from its two breakdowns."""
    usable = cluster.usable_hbm_bytes
    headroom = usable - memory.total
    if headroom < HEADROOM_FRACTION * usable:
        name, size = largest_memory_term(memory)
        state = (f"needs {memory.total / GIB:.1f} GiB > {usable / GIB:.1f} GiB usable" if headroom < 0
                 else f"only {headroom / GIB:.1f} GiB ({headroom / usable:.0%}) headroom")
        return "memory", f"{state}; largest term {name} {size / GIB:.1f} GiB (stage {memory.stage})"
    bottleneck = time.bottleneck
    terms = dict(time.terms)
    seconds = sum(terms.get(t, 0.0) for t in BOTTLENECK_TERMS.get(bottleneck, ()))
    share = seconds / time.step_time if time.step_time > 0 else 0.0
    context = _time_context(bottleneck, config, training, cluster, time)
    if config.cp > 1 and bottleneck != "cp-comm":  # the CP type shapes the attention whatever limits the step
        hidden = dict(time.hidden).get("cp_comm", 0.0)
        context += f"; CP{config.cp} {config.cp_comm_text()}" + (
            f" hides {hidden:.3g} s of its exchange" if hidden > 0 else "")
    return bottleneck, f"{bottleneck} {share:.0%} of step: {context}"


def combine(config: ParallelConfig, training: TrainingSpec, cluster: ClusterSpec, memory: MemoryBreakdown,
            time: StepTimeBreakdown, model: ModelSpec | None = None) -> Estimate:
    """An Estimate from breakdowns already computed (the planner computes memory first, time only if it fits);
    with ``model`` (the breakdowns' own), its intervals too."""
    limiter, explanation = explain(config, training, cluster, memory, time)
    headroom = cluster.usable_hbm_bytes - memory.total
    interval = None
    if model is not None:
        interval = estimate_interval(model, training, cluster, config, time, memory,
                                     component_corrections(model, training, cluster, config))
    return Estimate(config=config, memory=memory, time=time, fits=headroom >= 0, memory_headroom_bytes=headroom,
                    limiter=limiter, explanation=explanation, interval=interval)


def estimate(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, config: ParallelConfig) -> Estimate:
    """Memory (bytes per GPU, most-loaded stage) and step time (seconds) of ``config``, with its limiter.

    The step time carries the profile's component factors for this model shape, when it has some.
    """
    memory = estimate_memory(model, training, cluster, config)
    time = estimate_step_time(model, training, cluster, config,
                              corrections=component_corrections(model, training, cluster, config))
    return combine(config, training, cluster, memory, time, model)


def step_time(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, config: ParallelConfig) -> StepTimeBreakdown:
    """``estimate_step_time`` with the profile's component factors for this model shape (the planner's time
    function: same signature, picklable)."""
    return estimate_step_time(model, training, cluster, config,
                              corrections=component_corrections(model, training, cluster, config))


def pessimistic_step_time(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, config: ParallelConfig,
                          time: StepTimeBreakdown) -> float:
    """The pessimistic end (seconds) of the step-time interval of ``time``, :func:`step_time`'s breakdown of
    ``config``: what the planner ranks by by default (``Estimate.rank_time`` of the same layout)."""
    return step_time_interval(model, training, cluster, config, time,
                              component_corrections(model, training, cluster, config)).high


def steady_state_floor(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec,
                       config: ParallelConfig) -> float:
    """:func:`costmodel.step_time.steady_state_floor` (seconds) with the corrections :func:`step_time` applies:
    a cheap lower bound on ``step_time``'s step time less its once-per-step terms, bubble and ep_a2a."""
    return _floor(model, training, cluster, config,
                  corrections=component_corrections(model, training, cluster, config))


def component_corrections(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec,
                          config: ParallelConfig | None = None) -> dict[str, float] | None:
    """Per-term factors (measured / predicted) the profile holds for this model's executor components at
    the tokens per micro-batch one rank of ``config`` works on (seq x mbs / (tp x cp)), or the nearest ones
    measured (``foldtune calibrate --model``); None without. No config: the nearest sequence length."""
    if config is None:
        return cluster.hardware.component_corrections(model.name, training.seq_length)
    return cluster.hardware.component_corrections(model.name, training.seq_length, config.micro_batch_size,
                                                  config.tp * config.cp)
