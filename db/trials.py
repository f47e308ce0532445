"""Trials of a job as the search runs them: start, heartbeat, finish, the best one, and a page of them.

Each writing function is one short transaction and commits it. A trial's ``number`` is its Optuna
trial number and the key the runner records it under; (job_id, number) is unique, so :func:`start_trial`
raises ``sqlalchemy.exc.IntegrityError`` for a trial stored twice, and :func:`record_trial_start` (the
runner's, which may replay a trial after a restart) returns the stored one instead.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from db.models import Job, Trial, utcnow
from spec.failure import FailureKind

FINISHED_TRIAL_STATUSES = ("succeeded", "pruned", "failed")


def start_trial(session: Session, job_id: int, number: int, config: dict[str, Any], *, runner_id: str,
                label: str | None = None, predicted: dict[str, Any] | None = None,
                predicted_step_time_s: float | None = None, now: datetime | None = None) -> Trial:
    """Record that trial ``number`` of ``job_id`` started running ``config`` (a ParallelConfig dict)."""
    now = now or utcnow()
    trial = Trial(job_id=job_id, number=number, status="running", config=config, label=label,
                  predicted=predicted, predicted_step_time_s=predicted_step_time_s, runner_id=runner_id,
                  started_at=now, heartbeat_at=now)
    session.add(trial)
    session.commit()
    return trial


def finish_trial(session: Session, trial_id: int, status: str, *, measurement: dict[str, Any] | None = None,
                 step_time_s: float | None = None, failure_kind: str | None = None,
                 failure_reason: str | None = None, now: datetime | None = None) -> bool:
    """End a running trial.

    ``succeeded`` needs ``measurement`` (the executor's Measurement as a dict) and ``step_time_s``
    (measured seconds per optimizer step); ``pruned`` may carry a partial measurement; ``failed`` needs
    ``failure_kind`` (oom, crash, timeout, ...) and a readable ``failure_reason``. Returns False if the
    trial was not running any more (e.g. declared lost by :func:`db.queue.requeue_stale`). A succeeded
    trial also refreshes its job's ``best_trial_id``.
    """
    if status not in FINISHED_TRIAL_STATUSES:
        raise ValueError(f"trial status must be one of {FINISHED_TRIAL_STATUSES}, got {status!r}")
    if status == "succeeded" and (measurement is None or step_time_s is None or step_time_s <= 0):
        raise ValueError("a succeeded trial needs its measurement and a positive step_time_s (seconds)")
    if status == "failed" and not (failure_kind and failure_reason):
        raise ValueError("a failed trial needs failure_kind and failure_reason")
    result = session.execute(
        update(Trial).where(Trial.id == trial_id, Trial.status == "running")
        .values(status=status, measurement=measurement, step_time_s=step_time_s, failure_kind=failure_kind,
                failure_reason=failure_reason, finished_at=now or utcnow())
        .execution_options(synchronize_session=False))
    if result.rowcount == 1 and status == "succeeded":
        job_id = session.scalar(select(Trial.job_id).where(Trial.id == trial_id))
        _refresh_best(session, job_id)
    session.commit()
    return result.rowcount == 1


def _refresh_best(session: Session, job_id: int) -> None:
    best = session.scalar(select(Trial.id).where(Trial.job_id == job_id, Trial.status == "succeeded")
                          .order_by(Trial.step_time_s, Trial.number).limit(1))
    session.execute(update(Job).where(Job.id == job_id).values(best_trial_id=best)
                    .execution_options(synchronize_session=False))


def best_trial(session: Session, *, owner_id: int, signature: str) -> Trial | None:
    """The succeeded trial with the shortest measured step time over the owner's jobs of ``signature``."""
    return session.scalar(
        select(Trial).join(Job, Job.id == Trial.job_id)
        .where(Job.owner_id == owner_id, Job.signature == signature, Trial.status == "succeeded")
        .order_by(Trial.step_time_s, Trial.id).limit(1))


def trials_of_job(session: Session, job_id: int) -> list[Trial]:
    """Every trial of a job in Optuna number order."""
    return list(session.scalars(select(Trial).where(Trial.job_id == job_id).order_by(Trial.number)))


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
    try:
        return start_trial(session, job_id, number, config, runner_id=runner_id, label=label, predicted=predicted,
                           predicted_step_time_s=predicted_step_time_s).id
    except IntegrityError:
        session.rollback()
        return trial_by_number(session, job_id, number).id


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
        if trial.failure_kind != FailureKind.LOST.value:
            return False
        session.execute(update(Trial).where(Trial.id == trial.id, Trial.failure_kind == FailureKind.LOST.value)
                        .values(status="running", failure_kind=None, failure_reason=None, finished_at=None)
                        .execution_options(synchronize_session=False))
        session.commit()
    return finish_trial(session, trial.id, status, measurement=measurement, step_time_s=step_time_s,
                        failure_kind=failure_kind, failure_reason=failure_reason)


def fail_running_trials(session: Session, job_id: int, reason: str,
                        kind: FailureKind = FailureKind.LOST) -> list[int]:
    """Mark the job's still-running trials failed as ``kind`` (lost: their runner stopped; cancelled: the job
    was); returns their numbers."""
    numbers = list(session.scalars(select(Trial.number).where(Trial.job_id == job_id, Trial.status == "running")))
    session.execute(update(Trial).where(Trial.job_id == job_id, Trial.status == "running")
                    .values(status="failed", failure_kind=kind.value, failure_reason=reason, finished_at=utcnow())
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


def trials_page(session: Session, job_id: int, limit: int, offset: int) -> tuple[list[Trial], int]:
    """A page of the job's trials in Optuna number order, and how many it has in all."""
    total = session.scalar(select(func.count()).select_from(Trial).where(Trial.job_id == job_id))
    trials = list(session.scalars(select(Trial).where(Trial.job_id == job_id).order_by(Trial.number)
                                  .limit(limit).offset(offset)))
    return trials, total
