"""POST /plans: rank every valid folded layout with the cost model, instantly (nothing is run or stored)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api.http.deps import OwnerDep, SessionDep
from api.schemas.plans import PlanCreate, PlanOut
from api.schemas.problem import problem_responses
from api.service.plans import create_plan as plan_use_case

router = APIRouter(prefix="/v1", tags=["plans"], responses=problem_responses(401, 422, 503))


@router.post("/plans", operation_id="create_plan", response_model=PlanOut)
def create_plan(body: PlanCreate, _owner: OwnerDep, session: SessionDep, request: Request) -> PlanOut:
    """The ``top`` fastest layouts predicted to fit, with their memory and step-time breakdowns."""
    return plan_use_case(session, body, request.app.state.planning)
