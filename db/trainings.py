"""Trainings as stored rows, their per-step metrics and per-layer expert loads: record, page through, cancel.
Claims and heartbeats of trainings are the queue's (db.queue)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from db.models import Training, TrainingExpertLoad, TrainingMetric, utcnow
from spec.limits import MAX_EXPERT_LOAD_CELLS

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


def kept_layer_rows(rows: int, experts: int, max_cells: int = MAX_EXPERT_LOAD_CELLS) -> list[int]:
    """The rows (of ``rows`` MoE layers × ``experts``) a step stores: all when they fit in ``max_cells`` counts,
    else as many as fit, evenly spaced and always the first and the last (one, when a single layer is wider)."""
    keep = min(rows, max(1, max_cells // max(experts, 1)))
    if keep >= rows:
        return list(range(rows))
    if keep == 1:
        return [0]
    return [round(i * (rows - 1) / (keep - 1)) for i in range(keep)]


def record_expert_load(session: Session, training_id: int, step: int, layers: list[int],
                       tokens: list[list[int]]) -> TrainingExpertLoad | None:
    """Store step ``step``'s routed tokens per expert of each MoE layer (``tokens[i]`` belongs to decoder layer
    ``layers[i]``), thinned to :func:`kept_layer_rows`; replaces a step already stored (a resumed run). None,
    storing nothing, for a model without MoE layers. Commits."""
    if len(layers) != len(tokens) or len({len(row) for row in tokens}) > 1:
        raise ValueError(f"expert load of step {step}: {len(layers)} layer numbers for {len(tokens)} rows of "
                         f"{sorted({len(row) for row in tokens})} experts")
    if not tokens:
        return None
    rows = kept_layer_rows(len(tokens), len(tokens[0]))
    session.execute(delete(TrainingExpertLoad).where(TrainingExpertLoad.training_id == training_id,
                                                     TrainingExpertLoad.step == step))
    row = TrainingExpertLoad(training_id=training_id, step=step, moe_layers=len(layers),
                             layers=[int(layers[i]) for i in rows], tokens=[[int(c) for c in tokens[i]] for i in rows])
    session.add(row)
    session.commit()
    return row


def expert_load_at(session: Session, training_id: int, step: int | None = None) -> TrainingExpertLoad | None:
    """The stored expert load of one step of the training (None: its latest), or None."""
    query = select(TrainingExpertLoad).where(TrainingExpertLoad.training_id == training_id)
    if step is not None:
        query = query.where(TrainingExpertLoad.step == step)
    return session.scalar(query.order_by(TrainingExpertLoad.step.desc()).limit(1))


def expert_loads_after(session: Session, training_id: int, after_step: int, limit: int) -> list[TrainingExpertLoad]:
    """Up to ``limit`` stored expert loads of the training with step > ``after_step``, in step order."""
    return list(session.scalars(select(TrainingExpertLoad).where(TrainingExpertLoad.training_id == training_id,
                                                                 TrainingExpertLoad.step > after_step)
                                .order_by(TrainingExpertLoad.step).limit(limit)))


def trainings_page(session: Session, owner_id: int, *, status: str | None, limit: int,
                    offset: int) -> tuple[list[Training], int]:
    """A page of the owner's trainings, newest first, and how many match in all."""
    where = [Training.owner_id == owner_id]
    if status is not None:
        where.append(Training.status == status)
    total = session.scalar(select(func.count()).select_from(Training).where(*where))
    rows = list(session.scalars(select(Training).where(*where)
                                .order_by(Training.created_at.desc(), Training.id.desc()).limit(limit).offset(offset)))
    return rows, total


def latest_metrics(session: Session, ids: list[int]) -> dict[int, TrainingMetric]:
    """The last stored metrics row of each training in ``ids``."""
    if not ids:
        return {}
    last = (select(TrainingMetric.training_id, func.max(TrainingMetric.step).label("step"))
            .where(TrainingMetric.training_id.in_(ids)).group_by(TrainingMetric.training_id).subquery())
    rows = session.scalars(select(TrainingMetric).join(
        last, (TrainingMetric.training_id == last.c.training_id) & (TrainingMetric.step == last.c.step)))
    return {m.training_id: m for m in rows}


def metrics_after(session: Session, training_id: int, after_step: int, limit: int) -> list[TrainingMetric]:
    """Up to ``limit`` metrics rows of the training with step > ``after_step``, in step order."""
    return list(session.scalars(select(TrainingMetric).where(TrainingMetric.training_id == training_id,
                                                             TrainingMetric.step > after_step)
                                .order_by(TrainingMetric.step).limit(limit)))


def metric_of_step(session: Session, training_id: int, step: int) -> TrainingMetric | None:
    """The stored metrics row of one step (1-based) of the training, or None."""
    return session.scalar(select(TrainingMetric).where(TrainingMetric.training_id == training_id,
                                                       TrainingMetric.step == step))


def step_times(session: Session, training_id: int) -> list[float | None]:
    """Seconds per step of every stored step of the training (None where a step has none)."""
    return list(session.scalars(select(TrainingMetric.step_time_s).where(TrainingMetric.training_id == training_id)))


def predicted_step_time(session: Session, training_id: int) -> float | None:
    return session.scalar(select(Training.predicted_step_time_s).where(Training.id == training_id))


def cancel_training(session: Session, training_id: int) -> bool:
    """Cancel the training if it is queued or running (one guarded UPDATE, as db.jobs.cancel_job); whether
    it was. Commits."""
    now = utcnow()
    result = session.execute(
        update(Training).where(Training.id == training_id, Training.status.in_(("queued", "running")))
        .values(status="cancelled", finished_at=now, updated_at=now).execution_options(synchronize_session=False))
    session.commit()
    return result.rowcount == 1
