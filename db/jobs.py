"""Tuning jobs as stored rows: look them up, page through an owner's, count them, cancel one.

Claims, heartbeats and finishing are the queue's (db.queue); the trials of a job are db.trials'.
"""

from __future__ import annotations

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from db.models import Job, Trial, utcnow
from spec.failure import FailureKind


def job_by_idempotency_key(session: Session, owner_id: int, key: str) -> Job | None:
    return session.scalar(select(Job).where(Job.owner_id == owner_id, Job.idempotency_key == key))


def jobs_page(session: Session, owner_id: int, *, status: str | None, model: str | None, limit: int,
              offset: int) -> tuple[list[Job], int]:
    """A page of the owner's jobs, newest first, and how many match in all."""
    where = [Job.owner_id == owner_id]
    if status is not None:
        where.append(Job.status == status)
    if model is not None:
        where.append(Job.model_name == model)
    total = session.scalar(select(func.count()).select_from(Job).where(*where))
    jobs = list(session.scalars(select(Job).where(*where).order_by(Job.created_at.desc(), Job.id.desc())
                                .limit(limit).offset(offset)))
    return jobs, total


def trial_status_counts(session: Session, job_ids: list[int]) -> list[tuple[int, str, int]]:
    """(job id, trial status, how many) for every status the jobs' trials are in."""
    if not job_ids:
        return []
    return [tuple(row) for row in session.execute(
        select(Trial.job_id, Trial.status, func.count()).where(Trial.job_id.in_(job_ids))
        .group_by(Trial.job_id, Trial.status))]


def trials_by_id(session: Session, trial_ids: list[int]) -> dict[int, Trial]:
    if not trial_ids:
        return {}
    return {t.id: t for t in session.scalars(select(Trial).where(Trial.id.in_(trial_ids)))}


def count_by_status(session: Session) -> dict[str, int]:
    """How many jobs of all owners are in each status (a status without jobs is absent)."""
    return dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).all())


def count_of_signature(session: Session, owner_id: int, signature: str) -> int:
    """How many of the owner's jobs ask the question ``signature`` names."""
    return session.scalar(select(func.count()).select_from(Job)
                          .where(Job.owner_id == owner_id, Job.signature == signature))


def cancel_job(session: Session, job_id: int) -> bool:
    """Cancel the job if it is queued or running, failing its running trials ('cancelled'); whether it was.

    One guarded UPDATE, so a runner finishing the job at the same moment either wins (False here) or
    loses (its finish_job returns False); never both. Commits."""
    now = utcnow()
    result = session.execute(
        update(Job).where(Job.id == job_id, Job.status.in_(("queued", "running")))
        .values(status="cancelled", finished_at=now, updated_at=now).execution_options(synchronize_session=False))
    if result.rowcount == 1:
        session.execute(update(Trial).where(Trial.job_id == job_id, Trial.status == "running")
                        .values(status="failed", failure_kind=FailureKind.CANCELLED.value,
                                failure_reason="the job was cancelled", finished_at=now)
                        .execution_options(synchronize_session=False))
    session.commit()
    return result.rowcount == 1


def job_status(session: Session, job_id: int) -> str | None:
    return session.scalar(select(Job.status).where(Job.id == job_id))


def job_claim(session: Session, job_id: int) -> tuple[str | None, str | None]:
    """(status, claimed_by) of a job; (None, None) when it does not exist."""
    row = session.execute(select(Job.status, Job.claimed_by).where(Job.id == job_id)).first()
    return (row[0], row[1]) if row else (None, None)
