"""Check a plan's top layouts by one-rank slices (``foldtune verify``): measured compute, priced communication.

:func:`verify_plan` plans (:func:`planner.rank.plan`), takes the top ``K`` layouts and, for each, asks a
``measure`` callable (the executor's slice, ``executor.slices.measure_slice``, which the caller binds to its
device; the planner never imports the executor) to time one rank of it under each routing scenario. Per layout
and scenario it reports

* per term, the measured compute of the layout's slowest stage (per micro-batch) against the cost model's
  prediction of the same work on the slice's hardware (``slice_cluster``: the device the slices ran on);
* per decoder layer kind, the same per layer;
* the checked step: the measured compute run through the pipeline (:func:`costmodel.slices.compute_step`) plus
  what the slice does not run, priced by the estimate on the target cluster (communication, optimizer, host);

and re-ranks the layouts by their checked step under each scenario. A layout whose slice fails (out of
memory, a module the executor lacks) keeps its reason and ranks after every measured one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from costmodel.estimate import step_time as estimate_time
from costmodel.slices import (LAYER_COMPUTE_TERMS, STAGE_COMPUTE_TERMS, Extras, compute_step, measured_layer_terms,
                              predicted_extras, predicted_layer_terms, predicted_parts, priced_rest, stage_compute)
from planner.enumerate import SearchSpace
from planner.rank import plan
from spec.errors import FoldtuneError
from spec.hardware import ClusterSpec
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.routing_scenarios import DEFAULT_HOT_FACTOR, scenario_load
from spec.training_spec import TrainingSpec

#: measure(config, loads) -> the executor's slice measurement (executor.slices.measure_slice's dict)
Measure = Callable[[ParallelConfig, dict[str, tuple[float, ...]]], dict]


@dataclass(frozen=True)
class ScenarioCheck:
    """One layout under one routing scenario (seconds; per micro-batch unless per step)."""

    scenario: str
    stage: dict[str, Any]  # the measured slowest stage kind: index, stages, layers of each kind, first/last
    terms: dict[str, tuple[float, float]]  # STAGE_COMPUTE_TERMS -> (measured, predicted) of that stage
    layers: dict[str, dict[str, tuple[float, float]]]  # layer kind -> term -> (measured, predicted), one layer
    compute_measured: dict[str, float]  # steady, bubble, total: seconds per step
    compute_predicted: dict[str, float]
    priced: dict[str, float]  # the estimate's other exposed terms on the target, seconds per step
    predicted_step_s: float  # the estimate of the target cluster under this scenario's load
    checked_step_s: float  # measured compute + priced rest
    expert_rows: list[int] | None = None  # rows each local expert of the slice received (MoE)

    def to_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "stage": self.stage,
                "terms": {k: {"measured_s": m, "predicted_s": p, "ratio": _ratio(m, p)}
                          for k, (m, p) in self.terms.items()},
                "layers": {kind: {k: {"measured_s": m, "predicted_s": p, "ratio": _ratio(m, p)}
                                  for k, (m, p) in terms.items()} for kind, terms in self.layers.items()},
                "compute_measured_s": self.compute_measured, "compute_predicted_s": self.compute_predicted,
                "priced_s": self.priced, "predicted_step_s": self.predicted_step_s,
                "checked_step_s": self.checked_step_s, "expert_rows": self.expert_rows}


@dataclass
class LayoutCheck:
    """One of the plan's top layouts: its plan rank (1 = the plan's best), its checks per scenario, its rank
    by the checked step per scenario, the executor's raw measurement, or why it could not be measured."""

    plan_rank: int
    config: ParallelConfig
    predicted_step_s: float
    scenarios: dict[str, ScenarioCheck] = field(default_factory=dict)
    rank: dict[str, int] = field(default_factory=dict)
    measurement: dict | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"plan_rank": self.plan_rank, "layout": self.config.label(), "config": self.config.to_dict(),
                "predicted_step_s": self.predicted_step_s, "rank": self.rank, "error": self.error,
                "scenarios": {name: check.to_dict() for name, check in self.scenarios.items()},
                "measurement": self.measurement}


@dataclass
class VerifyReport:
    """Every checked layout in plan order, and per scenario the labels in checked order (fastest first)."""

    model: str
    gpu: str
    num_gpus: int
    slice_gpu: str
    device: str | None
    scenarios: dict[str, dict[str, Any]]
    layouts: list[LayoutCheck]
    order: dict[str, list[str]]

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "gpu": self.gpu, "num_gpus": self.num_gpus, "slice_gpu": self.slice_gpu,
                "device": self.device, "scenarios": self.scenarios, "order": self.order,
                "layouts": [layout.to_dict() for layout in self.layouts]}


def _ratio(measured: float, predicted: float) -> float | None:
    return measured / predicted if predicted > 0 else None


def scenario_loads(model: ModelSpec, hot_factor: float = DEFAULT_HOT_FACTOR) -> dict[str, tuple[float, ...]]:
    """The routing scenarios a slice runs: 'even', and for an MoE model 'skewed' (expert 0 at ``hot_factor``
    times the mean)."""
    if not model.is_moe:
        return {"even": ()}
    experts = model.num_experts
    return {"even": scenario_load("even", experts), "skewed": scenario_load("skewed", experts, hot_factor)}


def _with_load(training: TrainingSpec, load: tuple[float, ...]) -> TrainingSpec:
    return replace(training, moe_expert_load=load if load and len(set(load)) > 1 else None)


def check_layout(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, slice_cluster: ClusterSpec,
                 config: ParallelConfig, measurement: Mapping, scenario: str,
                 load: tuple[float, ...]) -> ScenarioCheck:
    """Compare one layout's slice ``measurement`` under ``scenario`` (expert ``load``) with the cost model and
    assemble its checked step (see the module docstring)."""
    trained = _with_load(training, load)
    device_parts = predicted_parts(model, trained, slice_cluster, config)
    target = estimate_time(model, trained, cluster, config)
    kinds = device_parts.kinds
    measured_layers = {kind: measured_layer_terms(m, scenario) for kind, m in measurement["kinds"].items()}
    predicted_layers = {kind: predicted_layer_terms(device_parts, kind) for kind in measured_layers}
    parts = measurement["parts"]
    extras_predicted = predicted_extras(device_parts)
    # the head-feature blocks (MTP) are not sliced: their predicted seconds stand in on both sides
    extras_measured = Extras(parts["embedding_s"], parts["head_s"], extras_predicted.head_blocks)
    for kind in kinds:
        for needed, n in (("dense", kind.dense_layers), ("moe", kind.moe_layers)):
            if n and needed not in measured_layers:
                raise FoldtuneError(f"the slice measured no {needed} layer, which stage {kind.stages[0]} holds")
    measured = [stage_compute(measured_layers, k, extras_measured,
                              recompute_num_layers=config.recompute_num_layers) for k in kinds]
    predicted = [stage_compute(predicted_layers, k, extras_predicted, recompute_s=k.recompute_s) for k in kinds]
    m, vpp = device_parts.micro_batches, device_parts.vpp
    step_measured = compute_step([sum(s.values()) for s in measured], kinds, m, vpp)
    step_predicted = compute_step([sum(s.values()) for s in predicted], kinds, m, vpp)
    i = step_measured.critical
    critical = kinds[i]
    rest = priced_rest(target)
    moe = measurement["kinds"].get("moe")
    return ScenarioCheck(
        scenario=scenario,
        stage={"index": i, "stages": list(critical.stages), "dense_layers": critical.dense_layers,
               "moe_layers": critical.moe_layers, "first": critical.first, "last": critical.last},
        terms={name: (measured[i][name], predicted[i][name]) for name in STAGE_COMPUTE_TERMS},
        layers={kind: {name: (measured_layers[kind][name], predicted_layers[kind][name])
                       for name in LAYER_COMPUTE_TERMS} for kind in measured_layers},
        compute_measured=_step_dict(step_measured), compute_predicted=_step_dict(step_predicted),
        priced=rest, predicted_step_s=target.step_time, checked_step_s=step_measured.total + sum(rest.values()),
        expert_rows=moe["expert_rows"][scenario] if moe and "expert_rows" in moe else None)


def _step_dict(step) -> dict[str, float]:
    return {"steady": step.steady, "bubble": step.bubble, "total": step.total}


def rank_checks(layouts: list[LayoutCheck], scenarios: list[str]) -> dict[str, list[str]]:
    """Set each layout's rank per scenario by its checked step (fastest 1; unmeasured after, in plan order) and
    return the labels in that order per scenario."""
    order = {}
    for name in scenarios:
        def key(layout: LayoutCheck) -> tuple[float, int]:
            check = layout.scenarios.get(name)
            seconds = check.checked_step_s if check is not None and math.isfinite(check.checked_step_s) else math.inf
            return seconds, layout.plan_rank

        ranked = sorted(layouts, key=key)
        for position, layout in enumerate(ranked, 1):
            layout.rank[name] = position
        order[name] = [layout.config.label() for layout in ranked]
    return order


def verify_plan(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, slice_cluster: ClusterSpec,
                measure: Measure, *, top: int = 3, space: SearchSpace | None = None,
                hot_factor: float = DEFAULT_HOT_FACTOR, device: str | None = None,
                on_layout: Callable[[LayoutCheck], None] | None = None) -> VerifyReport:
    """Plan, slice the top ``top`` layouts with ``measure`` and report (module docstring). ``on_layout`` is
    called with each layout's check as soon as it is done (progress lines)."""
    result = plan(model, training, cluster, top=top, space=space)
    loads = scenario_loads(model, hot_factor)
    scenarios = list(loads)
    layouts = []
    for plan_rank, estimate in enumerate(result.ranked, 1):
        check = LayoutCheck(plan_rank, estimate.config, estimate.time.step_time)
        try:
            check.measurement = measure(estimate.config, loads)
            for name in scenarios:
                if name in check.measurement.get("scenarios", scenarios):
                    check.scenarios[name] = check_layout(model, result.training, cluster, slice_cluster,
                                                         estimate.config, check.measurement, name, loads[name])
        except FoldtuneError as exc:
            check.error = str(exc)
        layouts.append(check)
        if on_layout is not None:
            on_layout(check)
    order = rank_checks(layouts, scenarios)
    described = {name: ({"hot_expert_factor": hot_factor} if name == "skewed" else {}) for name in scenarios}
    return VerifyReport(model=model.name, gpu=cluster.gpu.name, num_gpus=cluster.num_gpus,
                        slice_gpu=slice_cluster.gpu.name, device=device, scenarios=described, layouts=layouts,
                        order=order)
