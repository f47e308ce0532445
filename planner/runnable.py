"""The layouts of a request that the executor can run: the planner's ranked fitting layouts filtered by the
executor's capability rules (``spec.validity``: the model rule, then the layout rules).

One function answers both "can this job run at all?" at the front door (POST /v1/jobs, ``foldtune tune``)
and "which layouts does the search try?" in the runner, so a job the front door accepts is one the runner
can start, and a refusal names the same reasons in both places.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from costmodel.estimate import Estimate
from planner.enumerate import SearchSpace, enumerate_layouts
from planner.rank import NoValidLayoutError, plan
from spec.hardware import ClusterSpec, GPUSpec
from spec.errors import SpecError
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.precision_search import wanted_precisions
from spec.training_spec import TrainingSpec
from spec.validity import Rejection, Validator, executor_model_rule, executor_rules

PLAN_FACTOR = 16  # ranked layouts asked of the planner per trial of the budget
MIN_PLANNED = 64


def job_top(max_trials: int) -> int:
    """How many ranked layouts a tuning job of ``max_trials`` trials asks the planner for (the runner's
    search and the front door's check ask for the same, so they agree on whether the job can run)."""
    return max(MIN_PLANNED, PLAN_FACTOR * max_trials)


@dataclass
class RunnablePlan:
    """The planner's answer cut to what the executor runs. ``rejection`` is None when ``runnable`` is not
    empty, else the one rule that stopped the request (its reason is never empty)."""

    runnable: list[Estimate]  # fastest first
    planned: int = 0  # ranked fitting layouts the planner returned
    valid: int = 0  # valid layouts of the enumeration
    fitting: int = 0  # of which predicted to fit in memory
    not_executable: dict[str, int] = field(default_factory=dict)  # executor reason -> count
    rejection: Rejection | None = None


def _why_none(model: ModelSpec, cluster: ClusterSpec, planned: int, fitting: int,
              not_executable: dict[str, int]) -> Rejection:
    if not fitting:
        return Rejection("layout_fits", f"none of the valid layouts of {model.name} on {cluster.num_gpus} x "
                                        f"{cluster.hardware.name} is predicted to fit in GPU memory "
                                        f"(more GPUs, a shorter sequence or a proxy with fewer layers may)")
    reasons = "; ".join(f"{why} ({n})" for why, n in not_executable.items()) or "no reason recorded"
    return Rejection("executor_layout", f"none of the {planned} fitting layouts can be run by the executor: "
                                        f"{reasons}")


def runnable_plan(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, top: int,
                  keep: int | None = None, workers: int | None = 1, rank_by: str = "robust") -> RunnablePlan:
    """Rank the ``top`` best fitting layouts by ``rank_by`` (the planner; one process unless ``workers`` says
    otherwise: a server must not fork itself) and keep the first ``keep``
    (default: all) that the executor runs. A model the executor cannot build stops before planning
    (rule ``executor_model``); no valid layout is ``has_valid_layout``, none fitting ``layout_fits``, none
    runnable ``executor_layout``, each with its reason."""
    model_rule = executor_model_rule(model)
    if model_rule is not None:
        return RunnablePlan([], rejection=model_rule)
    try:
        # ranked executable first (planner.rank), so layouts only Megatron-Core runs cannot crowd the executor's
        # out of the ranked top N
        result = plan(model, training, cluster, top=top, workers=workers, rank_by=rank_by)
    except NoValidLayoutError as exc:
        return RunnablePlan([], rejection=Rejection("has_valid_layout", str(exc)))
    dropped: Counter[str] = Counter()
    kept: list[Estimate] = []
    for est in result.ranked:
        rejections = executor_rules(model, training, est.config)
        if rejections:
            dropped["; ".join(r.reason for r in rejections)] += 1
        elif keep is None or len(kept) < keep:
            kept.append(est)
    out = RunnablePlan(kept, len(result.ranked), result.enumeration.valid, result.fitting, dict(dropped))
    if not kept:
        out.rejection = _why_none(model, cluster, out.planned, out.fitting, out.not_executable)
    return out


def tuned_precisions(training: TrainingSpec, gpu: GPUSpec) -> tuple[tuple[str, ...], str | None]:
    """The precisions a job searching precision measures (the job's own, bf16, and fp8 where the GPU has an
    fp8 peak: :meth:`planner.SearchSpace.precisions_for`) and a note when fp8 is left out (None otherwise)."""
    wanted = wanted_precisions(training.precision)
    kept = SearchSpace(precisions=wanted).precisions_for(training, gpu)
    dropped = [p for p in wanted if p not in kept]
    note = None
    if dropped:
        note = (f"{', '.join(dropped)} not searched: GPU {gpu.name} has no fp8 peak in its hardware profile; "
                f"searching {', '.join(kept)}")
    return kept, note


def executable_space(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec,
                     space: SearchSpace) -> list[ParallelConfig]:
    """Every valid layout of the enumeration under ``space`` that the executor can build, in enumeration order
    (unranked: what a benchmark measures to compare the cost model with). A model the executor cannot build
    raises SpecError with the reason (rule ``executor_model``) rather than giving an empty space."""
    model_rule = executor_model_rule(model)
    if model_rule is not None:
        raise SpecError(model_rule.reason)
    validator = Validator(model, training, cluster)
    return [config for config in enumerate_layouts(model, training, cluster, space).configs()
            if not validator.executor(config)]
