"""POST /plans: rank every valid folded layout with the cost model, instantly (nothing is run or stored)."""

from __future__ import annotations

from fastapi import APIRouter

from api.service import jobs as jobs_service
from api.cli.plan_cmd import _estimate_dict  # the one JSON shape of an Estimate, shared with `foldtune plan --json`
from api.http.deps import OwnerDep, SessionDep
from api.http.problems import rule_violation
from api.schemas.jobs import ClusterOut
from api.schemas.plans import PlanCreate, PlanOut, RejectedRule
from api.schemas.problem import problem_responses

router = APIRouter(prefix="/v1", tags=["plans"], responses=problem_responses(401, 422))


@router.post("/plans", operation_id="create_plan", response_model=PlanOut)
def create_plan(body: PlanCreate, _owner: OwnerDep, session: SessionDep) -> PlanOut:
    """The ``top`` fastest layouts predicted to fit, with their memory and step-time breakdowns."""
    from planner import NoValidLayoutError, plan

    resolved = jobs_service.resolve_job(session, body)
    session.commit()
    try:
        # one process: forking planner workers inside a server would copy the whole server
        result = plan(resolved.model, resolved.training, resolved.cluster, top=body.top, workers=1)
    except NoValidLayoutError as exc:
        raise rule_violation("body", "has_valid_layout", str(exc)) from None
    enum = result.enumeration
    return PlanOut(
        model=resolved.model.name, training=resolved.training.to_dict(),
        cluster=ClusterOut(gpu=resolved.cluster.hardware.name, num_gpus=resolved.cluster.num_gpus),
        considered=enum.considered, valid=enum.valid,
        rejected={rule: RejectedRule(count=n, example=enum.examples[rule].reason) for rule, n in enum.rejected.items()},
        pruned_by_memory=result.pruned_by_memory, fitting=result.fitting,
        ranked=[_estimate_dict(e) for e in result.ranked],
        closest=_estimate_dict(result.closest) if result.closest else None,
        seconds=result.enumerate_seconds + result.rank_seconds)
