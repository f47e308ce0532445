"""Read-only views the dashboard shows beside the core resources (same key and owner rules as /v1)."""

from __future__ import annotations

from fastapi import APIRouter

from api.http.deps import OwnerDep, SessionDep
from api.http.routes.jobs import JobId
from api.http.routes.trainings import TrainingId
from api.schemas.problem import problem_responses
from api.schemas.views import CheckpointsOut, MegatronArgsOut
from api.service import views as views_service

router = APIRouter(prefix="/v1", responses=problem_responses(401, 404, 422))


@router.get("/jobs/{job_id}/megatron-args", operation_id="get_job_megatron_args", response_model=MegatronArgsOut,
            tags=["jobs"])
def get_job_megatron_args(job_id: JobId, owner: OwnerDep, session: SessionDep) -> MegatronArgsOut:
    """Megatron-LM arguments of the job's fastest measured layout; 404 problem while nothing is measured."""
    out = views_service.best_megatron_args(session, owner, job_id)
    session.commit()
    return out


@router.get("/trainings/{training_id}/checkpoints", operation_id="list_training_checkpoints",
            response_model=CheckpointsOut, tags=["trainings"])
def list_training_checkpoints(training_id: TrainingId, owner: OwnerDep, session: SessionDep) -> CheckpointsOut:
    """The checkpoints written under the training's checkpoint_dir, in step order."""
    out = views_service.training_checkpoints(session, owner, training_id)
    session.commit()
    return out
