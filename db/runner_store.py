"""What the job runner writes beyond db.queue and db.trials: claim one given job, record trials exactly
once across runner restarts (keyed by (job_id, Optuna trial number)), keep running trials alive.

Every function is one short transaction and commits it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from db.models import Job, Training, Trial, utcnow
from db.trials import finish_trial

LOST = "lost"


def _claim_id(session: Session, model, row_id: int, runner_id: str, now: datetime | None):
    now = now or utcnow()
    result = session.execute(
        update(model).where(model.id == row_id, model.status == "queued")
        .values(status="running", claimed_by=runner_id, heartbeat_at=now, attempts=model.attempts + 1,
                started_at=func.coalesce(model.started_at, now), updated_at=now)
        .execution_options(synchronize_session=False))
    session.commit()
    return session.get(model, row_id, populate_existing=True) if result.rowcount == 1 else None


def claim_job(session: Session, job_id: int, runner_id: str, *, now: datetime | None = None) -> Job | None:
    """Claim the queued job ``job_id`` for ``runner_id`` (as db.queue.claim_next_job does for the oldest);
    None when it is not queued (already claimed, finished or cancelled)."""
    return _claim_id(session, Job, job_id, runner_id, now)


def claim_training(session: Session, training_id: int, runner_id: str, *,
                   now: datetime | None = None) -> Training | None:
    """Like :func:`claim_job`, for the queued training ``training_id`` (``foldtune train --job`` runs the
    one it just stored, not the oldest in the queue)."""
    return _claim_id(session, Training, training_id, runner_id, now)


def trial_by_number(session: Session, job_id: int, number: int) -> Trial | None:
    return session.scalar(select(Trial).where(Trial.job_id == job_id, Trial.number == number))


def record_trial_start(session: Session, job_id: int, number: int, config: dict[str, Any], *, runner_id: str,
                       label: str | None, predicted: dict[str, Any] | None,
                       predicted_step_time_s: float | None) -> int:
    """Insert trial ``number`` of ``job_id`` as running, or return the existing row's id (a replay after a
    restart, or a concurrent insert): a trial is stored once whatever happens."""
    existing = trial_by_number(session, job_id, number)
    if existing is not None:
        return existing.id
    now = utcnow()
    trial = Trial(job_id=job_id, number=number, status="running", config=config, label=label, predicted=predicted,
                  predicted_step_time_s=predicted_step_time_s, runner_id=runner_id, started_at=now,
                  heartbeat_at=now)
    session.add(trial)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        return trial_by_number(session, job_id, number).id
    return trial.id


def record_trial_finish(session: Session, job_id: int, number: int, status: str, *,
                        measurement: dict[str, Any] | None = None, step_time_s: float | None = None,
                        failure_kind: str | None = None, failure_reason: str | None = None) -> bool:
    """Finish trial ``number`` with what the search decided. A row that was declared lost meanwhile (its
    runner missed heartbeats) is overwritten: the search's verdict is the truth. A cancelled or already
    finished row is left alone. Returns whether the row changed."""
    trial = trial_by_number(session, job_id, number)
    if trial is None:
        return False
    if trial.status != "running":
        if trial.failure_kind != LOST:
            return False
        session.execute(update(Trial).where(Trial.id == trial.id, Trial.failure_kind == LOST)
                        .values(status="running", failure_kind=None, failure_reason=None, finished_at=None)
                        .execution_options(synchronize_session=False))
        session.commit()
    return finish_trial(session, trial.id, status, measurement=measurement, step_time_s=step_time_s,
                        failure_kind=failure_kind, failure_reason=failure_reason)


def fail_running_trials(session: Session, job_id: int, reason: str) -> list[int]:
    """Mark the job's still-running trials failed as lost (their runner stopped); returns their numbers."""
    numbers = list(session.scalars(select(Trial.number).where(Trial.job_id == job_id, Trial.status == "running")))
    session.execute(update(Trial).where(Trial.job_id == job_id, Trial.status == "running")
                    .values(status="failed", failure_kind=LOST, failure_reason=reason, finished_at=utcnow())
                    .execution_options(synchronize_session=False))
    session.commit()
    return numbers


def heartbeat_running_trials(session: Session, job_id: int, runner_id: str) -> int:
    """Refresh the heartbeat of the job's trials this runner is running; returns how many."""
    result = session.execute(update(Trial).where(Trial.job_id == job_id, Trial.status == "running",
                                                 Trial.runner_id == runner_id)
                             .values(heartbeat_at=utcnow()).execution_options(synchronize_session=False))
    session.commit()
    return result.rowcount


def job_status(session: Session, job_id: int) -> str | None:
    return session.scalar(select(Job.status).where(Job.id == job_id))


def job_claim(session: Session, job_id: int) -> tuple[str | None, str | None]:
    """(status, claimed_by) of a job; (None, None) when it does not exist."""
    row = session.execute(select(Job.status, Job.claimed_by).where(Job.id == job_id)).first()
    return (row[0], row[1]) if row else (None, None)
