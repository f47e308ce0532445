"""Counts over every owner's rows for the operations endpoint (/metrics): jobs, trials and trainings by status,
the runners' latest heartbeats, and the distribution of stored training step times. Read-only, one query each."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import case, func, select, union_all
from sqlalchemy.orm import Session

from db.models import Job, Training, TrainingMetric, Trial, UTCDateTime


def count_by_status(session: Session, model) -> dict[str, int]:
    """How many rows of ``model`` (Job, Trial or Training) are in each status (a status without rows is absent)."""
    return dict(session.execute(select(model.status, func.count()).group_by(model.status)).all())


def runner_heartbeats(session: Session) -> dict[str, datetime]:
    """The latest heartbeat of each runner that holds running work (a job, a trial or a training), by runner id.

    Bounded by the runners alive now: finished work leaves no runner behind."""
    held = union_all(
        select(Job.claimed_by.label("runner"), Job.heartbeat_at.label("at")).where(Job.status == "running"),
        select(Training.claimed_by.label("runner"), Training.heartbeat_at.label("at"))
        .where(Training.status == "running"),
        select(Trial.runner_id.label("runner"), Trial.heartbeat_at.label("at")).where(Trial.status == "running"),
    ).subquery()
    latest = func.max(held.c.at, type_=UTCDateTime())
    rows = session.execute(select(held.c.runner, latest)
                           .where(held.c.runner.is_not(None), held.c.at.is_not(None))
                           .group_by(held.c.runner)).all()
    return {runner: at for runner, at in rows}


def step_time_histogram(session: Session, bounds: Sequence[float]) -> tuple[list[int], int, float]:
    """(cumulative count of stored training steps with ``step_time_s <= b`` for each of ``bounds``, the count of
    all timed steps, their sum in seconds), over every training's stored metrics."""
    step = TrainingMetric.step_time_s
    columns = [func.sum(case((step <= b, 1), else_=0)) for b in bounds]
    row = session.execute(select(*columns, func.count(step), func.coalesce(func.sum(step), 0.0))
                          .where(step.is_not(None))).one()
    return [int(v or 0) for v in row[:len(bounds)]], int(row[len(bounds)]), float(row[len(bounds) + 1])
