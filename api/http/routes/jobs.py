"""Tuning jobs: submit, list, show, cancel, and their trials."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Request, Response

from api.service import jobs as jobs_service
from api.http.deps import Limit, Offset, OwnerDep, SessionDep, SettingsDep, location, page
from api.schemas.common import MAX_ID, Name, Page
from api.schemas.jobs import JobCreate, JobOut, JobStatus, TrialOut
from api.schemas.problem import problem_responses

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=problem_responses(401, 422, 429))

JobId = Annotated[int, Path(ge=1, le=MAX_ID, description="job id")]


@router.post("", operation_id="create_job", status_code=201, response_model=JobOut,
             responses={200: {"model": JobOut, "description": "the job first stored under this Idempotency-Key"},
                        **problem_responses(403, 409, 413, 503)})
def create_job(body: JobCreate, owner: OwnerDep, session: SessionDep, settings: SettingsDep, request: Request,
               response: Response,
               idempotency_key: Annotated[Name | None, Header(
                   description="retries with the same key return the first job instead of storing another")] = None,
               ) -> JobOut:
    """Store a tuning job as queued; a runner (`foldtune runner`) claims and executes it."""
    job, created = jobs_service.submit_job(session, owner, body, idempotency_key, quotas=settings.quotas,
                                           gate=request.app.state.planning)
    response.status_code = 201 if created else 200
    response.headers["Location"] = location(request, "get_job", job_id=job.id)
    if created:
        request.app.state.metrics.count_job_submitted()
    view = jobs_service.job_views(session, [job])[0]
    session.commit()
    return view


@router.get("", operation_id="list_jobs", response_model=Page[JobOut])
def list_jobs(owner: OwnerDep, session: SessionDep, limit: Limit = 50, offset: Offset = 0,
              status: Annotated[JobStatus | None, Query(description="only jobs in this status")] = None,
              model: Annotated[Name | None, Query(description="only jobs of this model name")] = None) -> dict:
    """The caller's jobs, newest first."""
    jobs, total = jobs_service.list_jobs(session, owner, status=status, model=model, limit=limit, offset=offset)
    views = jobs_service.job_views(session, jobs)
    session.commit()
    return page(views, total, limit, offset)


@router.get("/{job_id}", operation_id="get_job", response_model=JobOut, responses=problem_responses(404))
def get_job(job_id: JobId, owner: OwnerDep, session: SessionDep) -> JobOut:
    view = jobs_service.job_views(session, [jobs_service.owned_job(session, owner, job_id)])[0]
    session.commit()
    return view


@router.post("/{job_id}/cancel", operation_id="cancel_job", response_model=JobOut,
             responses=problem_responses(404, 409))
def cancel_job(job_id: JobId, owner: OwnerDep, session: SessionDep) -> JobOut:
    """Cancel a queued or running job; its running trials end as failed ('cancelled')."""
    job = jobs_service.cancel_job(session, jobs_service.owned_job(session, owner, job_id))
    view = jobs_service.job_views(session, [job])[0]
    session.commit()
    return view


@router.get("/{job_id}/trials", operation_id="list_job_trials", response_model=Page[TrialOut],
            responses=problem_responses(404))
def list_job_trials(job_id: JobId, owner: OwnerDep, session: SessionDep, limit: Limit = 50,
                    offset: Offset = 0) -> dict:
    """The job's trials in Optuna number order, each with its config, prediction and measurement."""
    items, total = jobs_service.list_trials(session, owner, job_id, limit, offset)
    session.commit()
    return page(items, total, limit, offset)
