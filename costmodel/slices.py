"""A one-rank slice in the cost model's terms: what ``foldtune verify`` compares and re-assembles a step from.

The executor's slice (``executor/slices.py``) times one rank's decoder layers, per layer kind, and the pieces
of a layer that belong to one term each (its dense GEMMs, its local experts' grouped GEMMs, its attention core).
Here those timings become the term table's compute terms, the way the time model splits a layer
(:func:`measured_layer_terms`): ``gemm``, ``grouped_gemm`` and ``attention_core`` as timed alone,
``memory_bound`` what is left of the layer without recomputation (norms, rope, router, permutation, SwiGLU, the
gradients' accumulation, the executor's overheads: everything not in the other three), ``recompute`` the
layer with its recomputation less the layer without. :func:`stage_compute` sums them over a stage kind as the
time model does (its layers, its recomputation's share, the embedding on the first stage and the output head on
the last), and :func:`compute_step` runs the pipeline over the stage kinds: the slowest stage's micro-batches and
the fill and drain of the others (:func:`costmodel.step_time.pipeline_bubble`).

A step checked by slices is that measured compute plus what the slice does not run, priced as the estimate
prices it (:func:`priced_rest`): the exposed communication terms and the once-per-step optimizer and host
terms. All times are seconds; per micro-batch unless named per step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from costmodel.estimate import component_corrections
from costmodel.step_time import LayoutParts, StageKind, StepTimeBreakdown, layout_parts, pipeline_bubble
from costmodel.terms import TERM_TABLE
from spec.hardware import ClusterSpec
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

#: the compute terms a slice measures per decoder layer
LAYER_COMPUTE_TERMS = ("gemm", "grouped_gemm", "attention_core", "memory_bound")
#: the terms of a stage's compute per micro-batch: the layers' terms, their recomputation, the stage's extras
STAGE_COMPUTE_TERMS = (*LAYER_COMPUTE_TERMS, "recompute", "extras")
#: communication terms, priced and never run by a slice (the term table's comm and all-to-all groups)
COMM_TERMS = tuple(t.name for t in TERM_TABLE if t.group in ("comm", "all_to_all"))
#: the step's compute terms, which a checked step replaces by the slice's measurement
STEP_COMPUTE_TERMS = (*LAYER_COMPUTE_TERMS, "recompute", "pp_bubble")


def predicted_parts(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec,
                    config: ParallelConfig) -> LayoutParts:
    """:func:`costmodel.step_time.layout_parts` with the profile's component factors applied to each part's
    terms, as the planner's estimate (:func:`costmodel.estimate.step_time`) applies them to the step's."""
    parts = layout_parts(model, training, cluster, config)
    factors = component_corrections(model, training, cluster, config) or {}
    if not factors:
        return parts

    def scaled(terms: dict[str, float]) -> dict[str, float]:
        return {name: value * factors.get(name, 1.0) for name, value in terms.items()}

    return replace(parts, dense=scaled(parts.dense), moe=scaled(parts.moe), embedding=scaled(parts.embedding),
                   head=scaled(parts.head), head_blocks=scaled(parts.head_blocks), chunk_end=scaled(parts.chunk_end))


def measured_layer_terms(kind: Mapping, scenario: str) -> dict[str, float]:
    """One decoder layer of the executor's slice measurement ``kind`` (one entry of its ``kinds``) under the
    routing ``scenario``, in the term table's compute terms plus ``recompute`` (seconds per micro-batch).
    ``memory_bound`` is the rest of the layer without recomputation, so it carries the timing noise of the
    other three (it may come out negative when the isolated pieces run slower than inside the layer)."""
    whole = kind["layer_s"][scenario]
    plain = kind["no_recompute_s"][scenario] if "no_recompute_s" in kind else whole
    grouped = kind["grouped_gemm_s"][scenario] if "grouped_gemm_s" in kind else 0.0
    gemm, core = kind["gemm_s"], kind["attention_core_s"]
    return {"gemm": gemm, "grouped_gemm": grouped, "attention_core": core,
            "memory_bound": plain - gemm - grouped - core, "recompute": whole - plain}


def predicted_layer_terms(parts: LayoutParts, kind: str) -> dict[str, float]:
    """The time model's compute terms of one decoder layer of ``kind`` ('dense' or 'moe')."""
    layer = parts.dense if kind == "dense" else parts.moe
    return {name: layer[name] for name in LAYER_COMPUTE_TERMS}


def _recompute_share(kind: StageKind, recompute_num_layers: int) -> float:
    """The share of a stage's layers full recomputation re-runs (all when ``recompute_num_layers`` is 0)."""
    if recompute_num_layers == 0:
        return 1.0
    return min(1.0, recompute_num_layers / max(1, kind.dense_layers + kind.moe_layers))


def part_compute(part: Mapping[str, float]) -> float:
    """The compute seconds of one part's term dict (its communication left out)."""
    return sum(part[name] for name in LAYER_COMPUTE_TERMS)


@dataclass(frozen=True)
class Extras:
    """Compute seconds a stage adds besides its decoder layers: the first stage's ``embedding``, the last
    stage's output ``head``, and ``head_blocks`` (MTP depths, priced even where measured compute is used)."""

    embedding: float
    head: float
    head_blocks: float

    def of(self, kind: StageKind) -> float:
        return (self.embedding if kind.first else 0.0) + (self.head + self.head_blocks if kind.last else 0.0)


def predicted_extras(parts: LayoutParts) -> Extras:
    return Extras(part_compute(parts.embedding), part_compute(parts.head), part_compute(parts.head_blocks))


def stage_compute(layers: Mapping[str, Mapping[str, float]], kind: StageKind, extras: Extras,
                  recompute_s: float | None = None, recompute_num_layers: int = 0) -> dict[str, float]:
    """One stage kind's compute per micro-batch by :data:`STAGE_COMPUTE_TERMS`: ``layers`` maps 'dense'/'moe'
    to one layer's terms (a ``recompute`` entry: what one layer's recomputation takes, its full re-run under
    full recomputation); ``recompute_s`` (the time model's own figure for the stage) replaces their sum."""
    counts = {"dense": kind.dense_layers, "moe": kind.moe_layers}
    out = {name: sum(n * layers[k][name] for k, n in counts.items() if n) for name in LAYER_COMPUTE_TERMS}
    if recompute_s is None:
        recompute_s = _recompute_share(kind, recompute_num_layers) * sum(
            n * layers[k].get("recompute", 0.0) for k, n in counts.items() if n)
    out["recompute"] = recompute_s
    out["extras"] = extras.of(kind)
    return out


@dataclass(frozen=True)
class ComputeStep:
    """The pipeline run over stage compute times: ``steady`` (the slowest stage kind's micro-batches), ``bubble``
    (the others' fill and drain), seconds per step; ``critical`` the index of the slowest stage kind."""

    steady: float
    bubble: float
    critical: int

    @property
    def total(self) -> float:
        return self.steady + self.bubble


def compute_step(stage_seconds: list[float], kinds: tuple[StageKind, ...], micro_batches: int,
                 vpp: int) -> ComputeStep:
    """Seconds per step of compute when each stage kind takes ``stage_seconds[i]`` per micro-batch."""
    critical = max(range(len(kinds)), key=lambda i: stage_seconds[i])
    every = [stage_seconds[i] for i, kind in enumerate(kinds) for _ in kind.stages]
    return ComputeStep(micro_batches * stage_seconds[critical], pipeline_bubble(every, vpp), critical)


def priced_rest(time: StepTimeBreakdown) -> dict[str, float]:
    """What a checked step keeps of the estimate: every exposed term but the compute ones (communication,
    optimizer, host floor), seconds per step."""
    return {name: value for name, value in time.terms if name not in STEP_COMPUTE_TERMS}
