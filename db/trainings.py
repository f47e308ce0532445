"""Per-step metrics of a training run. Claims and heartbeats of trainings are in db.queue."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import delete
from sqlalchemy.orm import Session

from db.models import TrainingMetric

METRIC_FIELDS = ("loss", "eval_loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu",
                 "peak_memory_bytes", "expert_load_max", "expert_load_mean")


def record_training_metrics(session: Session, training_id: int, rows: Iterable[dict[str, Any]]) -> int:
    """Store metrics rows (each with ``step`` and any of METRIC_FIELDS); a step already stored is replaced,
    so a run resumed from a checkpoint rewrites the steps it repeats. Commits; returns the rows written."""
    rows = list(rows)
    unknown = sorted({k for row in rows for k in row} - set(METRIC_FIELDS) - {"step"})
    if unknown:
        raise ValueError(f"unknown training metric field(s): {', '.join(unknown)}")
    steps = [int(row["step"]) for row in rows]
    if steps:
        session.execute(delete(TrainingMetric).where(TrainingMetric.training_id == training_id,
                                                     TrainingMetric.step.in_(steps)))
        session.add_all(TrainingMetric(training_id=training_id, **row) for row in rows)
    session.commit()
    return len(rows)
