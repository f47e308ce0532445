"""The hardware-profile use cases: list, show and store profiles; stored ones win over a built-in one
of the same name, and none may take a built-in name."""

from __future__ import annotations

from sqlalchemy.orm import Session

from api.schemas.catalog import HardwareProfileIn, HardwareProfileOut
from api.service.errors import Conflict, RuleViolation, not_found
from api.service.quotas import Quotas, check_profile, profile_size
from spec.catalog import get_hardware, hardware_names, has_hardware
from spec.errors import CatalogError, FoldtuneError
from spec.hardware import HardwareProfile
from db.hardware_profiles import add_profile, stored_names_among, stored_profile, stored_profiles_page
from db.models import HardwareProfileRow, Owner


def _stored_view(row: HardwareProfileRow) -> HardwareProfileOut:
    return HardwareProfileOut(name=row.name, source=row.source, builtin=False, created_at=row.created_at,
                              profile=row.profile)


def _builtin_view(profile: HardwareProfile) -> HardwareProfileOut:
    return HardwareProfileOut(name=profile.name, source=profile.source, builtin=True, created_at=None,
                              profile=profile.to_dict())


def list_profiles(session: Session, limit: int, offset: int) -> tuple[list[HardwareProfileOut], int]:
    """One page of the list "stored profiles by name (they win over a built-in one of the same name),
    then the built-in catalog", and the length of that whole list."""
    builtin_names = list(hardware_names())
    shadowed = stored_names_among(session, builtin_names)
    builtins = [name for name in builtin_names if name not in shadowed]
    rows, n_stored = stored_profiles_page(session, limit, offset)
    session.commit()
    first_builtin = max(0, offset - n_stored)
    more = builtins[first_builtin:first_builtin + limit - len(rows)]
    return [_stored_view(r) for r in rows] + [_builtin_view(get_hardware(n)) for n in more], n_stored + len(builtins)


def get_profile(session: Session, name: str) -> HardwareProfileOut:
    """The stored profile ``name``, else the built-in one; NotFound when neither exists."""
    row = stored_profile(session, name)
    session.commit()
    if row is not None:
        return _stored_view(row)
    try:
        return _builtin_view(get_hardware(name))
    except CatalogError:
        raise not_found(f"hardware profile {name!r}") from None


def create_profile(session: Session, owner: Owner, body: HardwareProfileIn,
                   quotas: Quotas | None = None) -> HardwareProfileOut:
    """Store a profile under a new name; RuleViolation for a broken profile, Conflict for a taken name,
    QuotaExceeded past the owner's profile quotas (count, bytes of one)."""
    try:
        profile = HardwareProfile.from_dict(body.model_dump())
    except (FoldtuneError, TypeError, ValueError) as exc:
        raise RuleViolation("body", "hardware_profile_rules", str(exc)) from None
    if has_hardware(body.name):  # stored profiles are shared: none may shadow a built-in name or alias
        raise Conflict("name-taken", "Name taken", f"{body.name!r} names a built-in hardware profile")
    if quotas is not None:
        check_profile(session, owner, quotas, profile_size(profile.to_dict(), body.source))
    row = add_profile(session, body.name, profile.to_dict(), body.source, owner.id)
    if row is None:
        raise Conflict("name-taken", "Name taken", f"hardware profile {body.name!r} already exists")
    return _stored_view(row)
