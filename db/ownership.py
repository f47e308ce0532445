"""Owner isolation for single-row lookups (the one place that decides whether a caller may see a row), and
the per-owner counts the quotas check."""

from __future__ import annotations

from typing import TypeVar

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from db.models import Job, Training

Owned = TypeVar("Owned", Job, Training)


def owned_row(session: Session, model: type[Owned], row_id: int, owner_id: int) -> Owned | None:
    """The ``model`` row ``row_id`` when ``owner_id`` owns it, else None: another owner's row and a missing
    one are indistinguishable, so a caller cannot probe which ids exist."""
    row = session.get(model, row_id)
    return row if row is not None and row.owner_id == owner_id else None


def count_owned(session: Session, model: type, owner_id: int, statuses: tuple[str, ...] | None = None) -> int:
    """How many ``model`` rows (jobs, trainings, hardware profiles) ``owner_id`` owns, only those in
    ``statuses`` when given: what the per-owner quotas count."""
    where = [model.owner_id == owner_id]
    if statuses is not None:
        where.append(model.status.in_(statuses))
    return session.scalar(select(func.count()).select_from(model).where(*where)) or 0
