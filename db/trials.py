"""Trials of a job as the search runs them: start, heartbeat, finish, and the best one.

Each function is one short transaction and commits it. A trial's ``number`` is its Optuna trial
number; (job_id, number) is unique, so a trial recorded twice raises ``sqlalchemy.exc.IntegrityError``
instead of appearing twice.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from db.models import Job, Trial, utcnow

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


def heartbeat_trial(session: Session, trial_id: int, *, now: datetime | None = None) -> bool:
    """Keep a running trial alive; False when it is no longer running (declared lost, or its job cancelled)."""
    result = session.execute(update(Trial).where(Trial.id == trial_id, Trial.status == "running")
                             .values(heartbeat_at=now or utcnow()).execution_options(synchronize_session=False))
    session.commit()
    return result.rowcount == 1


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
    """Every trial of a job in Optuna number order (what a resumed runner replays into its study)."""
    return list(session.scalars(select(Trial).where(Trial.job_id == job_id).order_by(Trial.number)))
