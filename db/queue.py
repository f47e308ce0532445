"""The work queue runners pull from: claim a queued job (or training), the oldest or a given one,
heartbeat it, finish or release it, and give back work whose runner died.

Every function here is one short transaction and commits it, so a runner never holds a lock while it
computes. Claims are safe with many runners on one database: on PostgreSQL the candidate row is picked
with ``SELECT ... FOR UPDATE SKIP LOCKED`` (concurrent runners skip each other's rows instead of
waiting); on SQLite every transaction is ``BEGIN IMMEDIATE`` (see db.engine), so claims are serialised.
Either way the UPDATE is guarded by ``status = 'queued'`` and its row count checked, so one row is never
claimed twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TypeVar

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from db.engine import is_postgres
from db.models import Job, Training, Trial, utcnow
from spec.failure import FailureKind

Claimable = TypeVar("Claimable", Job, Training)

DEFAULT_MAX_ATTEMPTS = 3


def _claim(session: Session, model: type[Claimable], runner_id: str, now: datetime | None) -> Claimable | None:
    now = now or utcnow()
    # A runner restarted under the same id first takes back what it was running (it resumes it).
    own = session.scalar(select(model.id).where(model.status == "running", model.claimed_by == runner_id)
                         .order_by(model.created_at, model.id).limit(1))
    if own is not None:
        session.execute(update(model).where(model.id == own).values(heartbeat_at=now))
        session.commit()
        return session.get(model, own, populate_existing=True)
    pick = select(model.id).where(model.status == "queued").order_by(model.created_at, model.id).limit(1)
    if is_postgres(session):
        pick = pick.with_for_update(skip_locked=True)
    for _ in range(5):  # only retried if a row vanished between pick and update, which the locks prevent
        row_id = session.scalar(pick)
        if row_id is None:
            session.rollback()
            return None
        result = session.execute(
            update(model).where(model.id == row_id, model.status == "queued")
            .values(status="running", claimed_by=runner_id, heartbeat_at=now, attempts=model.attempts + 1,
                    started_at=func.coalesce(model.started_at, now), updated_at=now)
            .execution_options(synchronize_session=False))
        if result.rowcount == 1:
            session.commit()
            return session.get(model, row_id, populate_existing=True)
        session.rollback()
    return None


def claim_next_job(session: Session, runner_id: str, *, now: datetime | None = None) -> Job | None:
    """Claim the oldest queued job for ``runner_id`` (status -> running) and commit; None when none is queued.

    A job already running under the same ``runner_id`` (the runner was restarted) is returned first.
    """
    return _claim(session, Job, runner_id, now)


def claim_next_training(session: Session, runner_id: str, *, now: datetime | None = None) -> Training | None:
    """Like :func:`claim_next_job`, for trainings."""
    return _claim(session, Training, runner_id, now)


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
    """Claim the queued job ``job_id`` for ``runner_id`` (as :func:`claim_next_job` does for the oldest);
    None when it is not queued (already claimed, finished or cancelled)."""
    return _claim_id(session, Job, job_id, runner_id, now)


def claim_training(session: Session, training_id: int, runner_id: str, *,
                   now: datetime | None = None) -> Training | None:
    """Like :func:`claim_job`, for the queued training ``training_id`` (``foldtune train --job`` runs the
    one it just stored, not the oldest in the queue)."""
    return _claim_id(session, Training, training_id, runner_id, now)


def _guarded_update(session: Session, model, row_id: int, runner_id: str, **values) -> bool:
    result = session.execute(
        update(model).where(model.id == row_id, model.status == "running", model.claimed_by == runner_id)
        .values(**values).execution_options(synchronize_session=False))
    session.commit()
    return result.rowcount == 1


def heartbeat_job(session: Session, job_id: int, runner_id: str, *, now: datetime | None = None) -> bool:
    """Record that ``runner_id`` is alive on ``job_id``. False means stop: the job was cancelled, requeued
    after a missed heartbeat, or belongs to another runner now."""
    return _guarded_update(session, Job, job_id, runner_id, heartbeat_at=now or utcnow())


def heartbeat_training(session: Session, training_id: int, runner_id: str, *, now: datetime | None = None) -> bool:
    """Like :func:`heartbeat_job`, for trainings."""
    return _guarded_update(session, Training, training_id, runner_id, heartbeat_at=now or utcnow())


def finish_job(session: Session, job_id: int, runner_id: str, status: str, *, error: str | None = None,
               calibration: dict | None = None, report: dict | None = None, now: datetime | None = None) -> bool:
    """End a running job as succeeded or failed (with ``error``), with what a tuning job learned
    (``calibration``) or a verify job found (``report``); False if the runner no longer owns it."""
    if status not in ("succeeded", "failed"):
        raise ValueError(f"a runner finishes a job as 'succeeded' or 'failed', not {status!r}")
    values: dict = {"status": status, "error": error, "finished_at": now or utcnow(), "updated_at": now or utcnow()}
    if calibration is not None:
        values["calibration"] = calibration
    if report is not None:
        values["report"] = report
    return _guarded_update(session, Job, job_id, runner_id, **values)


def finish_training(session: Session, training_id: int, runner_id: str, status: str, *,
                    error: str | None = None, now: datetime | None = None) -> bool:
    """End a running training as succeeded or failed; False if the runner no longer owns it."""
    if status not in ("succeeded", "failed"):
        raise ValueError(f"a runner finishes a training as 'succeeded' or 'failed', not {status!r}")
    return _guarded_update(session, Training, training_id, runner_id, status=status, error=error,
                           finished_at=now or utcnow(), updated_at=now or utcnow())


def release_job(session: Session, job_id: int, runner_id: str) -> bool:
    """Put a job this runner holds back in the queue (graceful shutdown); its attempt is not counted."""
    return _guarded_update(session, Job, job_id, runner_id, status="queued", claimed_by=None, heartbeat_at=None,
                           attempts=Job.attempts - 1)


def release_training(session: Session, training_id: int, runner_id: str) -> bool:
    """Like :func:`release_job`, for a training (it resumes from its latest checkpoint when claimed next)."""
    return _guarded_update(session, Training, training_id, runner_id, status="queued", claimed_by=None,
                           heartbeat_at=None, attempts=Training.attempts - 1)


@dataclass
class StaleReport:
    """What :func:`requeue_stale` did: ids of jobs/trainings requeued or failed, and of trials failed."""

    jobs_requeued: list[int] = field(default_factory=list)
    jobs_failed: list[int] = field(default_factory=list)
    trainings_requeued: list[int] = field(default_factory=list)
    trainings_failed: list[int] = field(default_factory=list)
    trials_failed: list[int] = field(default_factory=list)


def _requeue_model(session: Session, model, cutoff: datetime, now: datetime, max_attempts: int
                   ) -> tuple[list[int], list[int]]:
    stale = (model.status == "running") & (model.heartbeat_at < cutoff)
    failed = session.scalars(
        update(model).where(stale, model.attempts >= max_attempts)
        .values(status="failed", finished_at=now, updated_at=now, claimed_by=None,
                error=f"its runner stopped heartbeating {max_attempts} time(s); giving up")
        .returning(model.id)).all()
    requeued = session.scalars(
        update(model).where(stale, model.attempts < max_attempts)
        .values(status="queued", claimed_by=None, heartbeat_at=None, updated_at=now)
        .returning(model.id)).all()
    return sorted(requeued), sorted(failed)


def requeue_stale(session: Session, timeout_s: float, *, max_attempts: int = DEFAULT_MAX_ATTEMPTS,
                  now: datetime | None = None) -> StaleReport:
    """Give back the work of runners that stopped heartbeating for more than ``timeout_s`` seconds.

    Running trials without a heartbeat since the cutoff, and every running trial of a job being
    given back, become failed (``failure_kind='lost'``) so the search retries them as new trials.
    Stale jobs and trainings go back to the queue, or fail once claimed ``max_attempts`` times (a job
    that kills its runner every time must not loop forever). Commits; any runner may call it.
    """
    now = now or utcnow()
    cutoff = now - timedelta(seconds=timeout_s)
    report = StaleReport()
    stale_job_ids = select(Job.id).where(Job.status == "running", Job.heartbeat_at < cutoff)
    lost = (Trial.status == "running") & or_(
        Trial.heartbeat_at < cutoff,
        Trial.heartbeat_at.is_(None) & (Trial.started_at < cutoff),
        Trial.job_id.in_(stale_job_ids),
    )
    report.trials_failed = sorted(session.scalars(
        update(Trial).where(lost)
        .values(status="failed", failure_kind=FailureKind.LOST.value, finished_at=now,
                failure_reason=f"no heartbeat from its runner for more than {timeout_s:g} s")
        .returning(Trial.id)).all())
    report.jobs_requeued, report.jobs_failed = _requeue_model(session, Job, cutoff, now, max_attempts)
    report.trainings_requeued, report.trainings_failed = _requeue_model(session, Training, cutoff, now,
                                                                        max_attempts)
    session.commit()
    return report
