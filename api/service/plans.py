"""The plan use case: rank every valid folded layout of a request with the cost model (nothing is run
or stored)."""

from __future__ import annotations

from sqlalchemy.orm import Session

from api.schemas.jobs import PlanClusterOut
from api.schemas.plans import PlanCreate, PlanOut, RejectedRule
from api.service.errors import RuleViolation
from api.service.planning import PlanningGate, no_gate
from api.service.jobs import resolve_job
from costmodel.training_run import training_run
from planner import NoValidLayoutError, SearchSpace, plan_precisions
from spec.errors import InvalidConfigError
from spec.optimizer_dtypes import read_dtypes
from spec.precision_search import SEARCHED_PRECISIONS  # what search_precision plans


def create_plan(session: Session, request: PlanCreate, gate: PlanningGate | None = None) -> PlanOut:
    """The ``top`` best layouts predicted to fit (by ``request.rank_by``; those foldtune's executor runs first
    unless ``request.megatron``), with their memory and step-time breakdowns and intervals;
    RuleViolation when no layout is valid. Ends the session's transaction before the planner runs; ``gate``
    (the HTTP service's) bounds the planning's slots and time (Unavailable beyond)."""
    resolved = resolve_job(session, request)
    session.commit()
    try:
        offload = dict(optimizer_offload=tuple(request.optimizer_offload),
                       activation_offload=tuple(tuple(m) for m in request.activation_offload))
        SearchSpace(**offload)
    except InvalidConfigError as exc:
        raise RuleViolation("body", "offload_options", str(exc)) from None
    try:
        offload["optimizer_dtypes"] = tuple(read_dtypes(text) for text in request.optimizer_dtypes)
        SearchSpace(**offload)
    except (ValueError, InvalidConfigError) as exc:
        raise RuleViolation("body.optimizer_dtypes", "optimizer_dtypes", str(exc)) from None
    try:
        space = SearchSpace(vpp_max=request.vpp_max, **offload,
                            precisions=SEARCHED_PRECISIONS if request.search_precision else None,
                            **({"pipeline": request.pipeline.split()} if request.pipeline is not None else {}))
    except InvalidConfigError as exc:
        raise RuleViolation("body.pipeline", "pipeline_options", str(exc)) from None
    try:
        # one process: forking planner workers inside a server would copy the whole server
        # (the training's precision alone unless search_precision: then bf16 and fp8, the faster first)
        with (gate or no_gate)():
            results = plan_precisions(resolved.model, resolved.training, resolved.cluster, top=request.top,
                                      workers=1, space=space, rank_by=request.rank_by,
                                      megatron=request.megatron)
    except NoValidLayoutError as exc:
        raise RuleViolation("body", "has_valid_layout", str(exc)) from None
    result = results[0]
    searched = ({r.training.precision: (r.best.time.step_time if r.best else None) for r in results}
                if request.search_precision else None)
    enum = result.enumeration
    runs = None
    if request.tokens is not None:
        t, n = result.training, resolved.cluster.num_gpus
        runs = [{"layout": e.config.label(),
                 **training_run(request.tokens, e.time.step_time, t.seq_length, t.global_batch_size, n,
                                request.price_per_gpu_hour).to_dict()}
                for e in result.ranked]
    return PlanOut(
        model=resolved.model.name, training=result.training.to_dict(), precision_search=searched,
        cluster=PlanClusterOut(gpu=resolved.cluster.hardware.name, num_gpus=resolved.cluster.num_gpus,
                               min_headroom=resolved.cluster.min_headroom,
                               min_headroom_bytes=resolved.cluster.min_headroom_bytes,
                               usable_hbm_bytes=resolved.cluster.usable_hbm_bytes),
        considered=enum.considered, valid=enum.valid,
        rejected={rule: RejectedRule(count=n, example=enum.examples[rule].reason) for rule, n in enum.rejected.items()},
        pruned_by_memory=result.pruned_by_memory, fitting=result.fitting,
        ranking="megatron" if result.megatron else "executable_first", rank_by=result.rank_by,
        robust_exact=result.robust_exact, robust_shortlist=result.robust_shortlist,
        ranked=[e.to_dict() for e in result.ranked],
        closest=result.closest.to_dict() if result.closest else None,
        seconds=result.enumerate_seconds + result.rank_seconds, training_runs=runs)
