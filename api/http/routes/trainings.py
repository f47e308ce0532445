"""Trainings: run one layout (a job's best or an explicit one) on real data; status, metrics, per-layer expert
load, cancel."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response

from api.service import trainings as trainings_service
from api.http.deps import Limit, Offset, OwnerDep, SessionDep, SettingsDep, location, page
from api.schemas.common import MAX_ID, Page
from api.schemas.problem import problem_responses
from api.schemas.trainings import (ExpertImbalancePage, ExpertLoadOut, MetricsPage, TrainingCreate, TrainingOut,
                                   TrainingStatus)

router = APIRouter(prefix="/v1/trainings", tags=["trainings"], responses=problem_responses(401, 422, 429))

TrainingId = Annotated[int, Path(ge=1, le=MAX_ID, description="training id")]


@router.post("", operation_id="create_training", status_code=201, response_model=TrainingOut,
             responses=problem_responses(403, 413))
def create_training(body: TrainingCreate, owner: OwnerDep, session: SessionDep, settings: SettingsDep,
                    request: Request, response: Response) -> TrainingOut:
    """Store a training as queued; a runner (`foldtune runner`) claims it and trains through Ray. Both
    paths must lie in the caller's own directory on the server (relative ones are taken relative to it)."""
    row = trainings_service.submit_training(session, owner, body, data_root=settings.data_root,
                                            quotas=settings.quotas)
    response.headers["Location"] = location(request, "get_training", training_id=row.id)
    view = trainings_service.training_views(session, [row])[0]
    session.commit()
    return view


@router.get("", operation_id="list_trainings", response_model=Page[TrainingOut])
def list_trainings(owner: OwnerDep, session: SessionDep, limit: Limit = 50, offset: Offset = 0,
                   status: Annotated[TrainingStatus | None, Query(description="only trainings in this status")] = None,
                   ) -> dict:
    """The caller's trainings, newest first, each with its latest metrics."""
    rows, total = trainings_service.list_trainings(session, owner, status=status, limit=limit, offset=offset)
    views = trainings_service.training_views(session, rows)
    session.commit()
    return page(views, total, limit, offset)


@router.get("/{training_id}", operation_id="get_training", response_model=TrainingOut,
            responses=problem_responses(404))
def get_training(training_id: TrainingId, owner: OwnerDep, session: SessionDep) -> TrainingOut:
    row = trainings_service.owned_training(session, owner, training_id)
    view = trainings_service.training_views(session, [row], measured=True)[0]
    session.commit()
    return view


@router.get("/{training_id}/metrics", operation_id="list_training_metrics", response_model=MetricsPage,
            responses=problem_responses(404))
def list_training_metrics(training_id: TrainingId, owner: OwnerDep, session: SessionDep, limit: Limit = 100,
                          after_step: Annotated[int, Query(ge=-1, le=MAX_ID,
                                                           description="only steps after this one")] = -1) -> dict:
    """The training's per-step metrics in step order; pass ``next_after_step`` back to get the next page."""
    trainings_service.owned_training(session, owner, training_id)
    items = trainings_service.metric_views(session, training_id, after_step, limit)
    session.commit()
    return {"items": items, "limit": limit, "after_step": after_step,
            "next_after_step": items[-1].step if len(items) == limit else None}


@router.get("/{training_id}/expert-load", operation_id="get_training_expert_load", response_model=ExpertLoadOut,
            responses=problem_responses(404))
def get_training_expert_load(training_id: TrainingId, owner: OwnerDep, session: SessionDep,
                             step: Annotated[int | None, Query(ge=1, le=MAX_ID, description=(
                                 "the optimizer step (1-based); the latest stored when left out"))] = None,
                             ) -> ExpertLoadOut:
    """Routed tokens of each expert in each MoE layer at one step (a layers × experts matrix, at most
    ``max_cells`` counts: a wider model's evenly spaced layers)."""
    training = trainings_service.owned_training(session, owner, training_id)
    view = trainings_service.expert_load_view(session, training, step)
    session.commit()
    return view


@router.get("/{training_id}/expert-load/imbalance", operation_id="list_training_expert_imbalance",
            response_model=ExpertImbalancePage, responses=problem_responses(404))
def list_training_expert_imbalance(training_id: TrainingId, owner: OwnerDep, session: SessionDep, limit: Limit = 100,
                                   after_step: Annotated[int, Query(ge=-1, le=MAX_ID,
                                                                    description="only steps after this one")] = -1,
                                   ) -> dict:
    """Per MoE layer and step: the busiest expert's routed tokens over the mean expert's, in step order; pass
    ``next_after_step`` back to get the next page."""
    trainings_service.owned_training(session, owner, training_id)
    items = trainings_service.expert_imbalance_views(session, training_id, after_step, limit)
    session.commit()
    return {"items": items, "limit": limit, "after_step": after_step,
            "next_after_step": items[-1].step if len(items) == limit else None}


@router.post("/{training_id}/cancel", operation_id="cancel_training", response_model=TrainingOut,
             responses=problem_responses(404, 409))
def cancel_training(training_id: TrainingId, owner: OwnerDep, session: SessionDep) -> TrainingOut:
    """Cancel a queued or running training; its runner stops at its next heartbeat."""
    row = trainings_service.cancel_training(session, trainings_service.owned_training(session, owner, training_id))
    view = trainings_service.training_views(session, [row])[0]
    session.commit()
    return view
