"""Hardware profiles stored by users (built-in ones live in spec.catalog). Names are stored lower-case."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from db.models import HardwareProfileRow


def stored_profile(session: Session, name: str) -> HardwareProfileRow | None:
    """The stored profile called ``name`` (compared lower-case), or None."""
    return session.scalar(select(HardwareProfileRow).where(HardwareProfileRow.name == name.lower()))


def stored_profiles(session: Session) -> list[HardwareProfileRow]:
    """Every stored profile, by name."""
    return list(session.scalars(select(HardwareProfileRow).order_by(HardwareProfileRow.name)))


def stored_profiles_page(session: Session, limit: int, offset: int) -> tuple[list[HardwareProfileRow], int]:
    """``limit`` stored profiles by name from ``offset``, and how many are stored in all."""
    total = session.scalar(select(func.count()).select_from(HardwareProfileRow)) or 0
    rows = list(session.scalars(select(HardwareProfileRow).order_by(HardwareProfileRow.name)
                                .limit(limit).offset(offset)))
    return rows, total


def stored_names_among(session: Session, names: list[str]) -> set[str]:
    """Which of ``names`` (lower-case) are stored."""
    return set(session.scalars(select(HardwareProfileRow.name).where(HardwareProfileRow.name.in_(names))))


def add_profile(session: Session, name: str, profile: dict[str, Any], source: str,
                owner_id: int) -> HardwareProfileRow | None:
    """Store a profile (a HardwareProfile dict); None when the name is taken. Commits."""
    row = HardwareProfileRow(name=name, profile=profile, source=source, owner_id=owner_id)
    session.add(row)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        return None
    return row


def store_calibrated_profile(session: Session, name: str, profile: dict[str, Any]) -> bool:
    """Store or replace the profile ``foldtune calibrate --store`` measured under ``name``; False (nothing
    written) when a profile of that name exists that calibrate did not write. Commits."""
    row = session.scalar(select(HardwareProfileRow).where(HardwareProfileRow.name == name))
    if row is None:
        session.add(HardwareProfileRow(name=name, profile=profile, source="calibrate"))
    elif row.source != "calibrate":
        return False
    else:  # a re-calibration of the same machine replaces the previous measurement
        row.profile = profile
    session.commit()
    return True
