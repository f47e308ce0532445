"""The model catalog and hardware profiles (built-in datasheet ones plus those stored by users)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from api.http.deps import OwnerDep, SessionDep
from api.http.problems import ProblemError, not_found, rule_violation
from api.schemas.catalog import HardwareProfileIn, HardwareProfileList, HardwareProfileOut, ModelList, ModelOut
from api.schemas.common import Name
from api.schemas.problem import problem_responses
from spec.catalog import get_hardware, get_model, hardware_names, has_hardware, model_names
from spec.errors import CatalogError, FoldtuneError
from spec.hardware import HardwareProfile
from db.models import HardwareProfileRow

router = APIRouter(prefix="/v1", responses=problem_responses(401))


@router.get("/models", operation_id="list_models", response_model=ModelList, tags=["catalog"])
def list_models(_owner: OwnerDep) -> ModelList:
    """Every model of the built-in catalog (and of FOLDTUNE_CATALOG, if the server was given one)."""
    specs = [get_model(name) for name in model_names()]
    return ModelList(items=[ModelOut(name=s.name, spec=s.to_dict(), num_experts=s.num_experts,
                                     num_layers=s.num_layers) for s in specs])


def _stored_view(row: HardwareProfileRow) -> HardwareProfileOut:
    return HardwareProfileOut(name=row.name, source=row.source, builtin=False, created_at=row.created_at,
                              profile=row.profile)


def _builtin_view(profile: HardwareProfile) -> HardwareProfileOut:
    return HardwareProfileOut(name=profile.name, source=profile.source, builtin=True, created_at=None,
                              profile=profile.to_dict())


@router.get("/hardware-profiles", operation_id="list_hardware_profiles", response_model=HardwareProfileList,
            tags=["hardware"])
def list_hardware_profiles(_owner: OwnerDep, session: SessionDep) -> HardwareProfileList:
    """Stored profiles first (they win over a built-in one of the same name), then the built-in catalog."""
    rows = session.scalars(select(HardwareProfileRow).order_by(HardwareProfileRow.name)).all()
    session.commit()
    stored = {row.name for row in rows}
    return HardwareProfileList(items=[_stored_view(r) for r in rows] + [
        _builtin_view(get_hardware(name)) for name in hardware_names() if name not in stored])


@router.get("/hardware-profiles/{name}", operation_id="get_hardware_profile", response_model=HardwareProfileOut,
            tags=["hardware"], responses=problem_responses(404))
def get_hardware_profile(name: Annotated[Name, Path()], _owner: OwnerDep, session: SessionDep) -> HardwareProfileOut:
    row = session.scalar(select(HardwareProfileRow).where(HardwareProfileRow.name == name.lower()))
    session.commit()
    if row is not None:
        return _stored_view(row)
    try:
        return _builtin_view(get_hardware(name))
    except CatalogError:
        raise not_found(f"hardware profile {name!r}") from None


@router.post("/hardware-profiles", operation_id="create_hardware_profile", status_code=201,
             response_model=HardwareProfileOut, tags=["hardware"], responses=problem_responses(409, 422))
def create_hardware_profile(body: HardwareProfileIn, owner: OwnerDep, session: SessionDep, request: Request,
                            response: Response) -> HardwareProfileOut:
    """Store a hardware profile (e.g. one measured by `foldtune calibrate`) under a new name; jobs may
    then name it as their cluster's gpu."""
    try:
        profile = HardwareProfile.from_dict(body.model_dump())
    except (FoldtuneError, TypeError, ValueError) as exc:
        raise rule_violation("body", "hardware_profile_rules", str(exc)) from None
    if has_hardware(body.name):  # stored profiles are shared: none may shadow a built-in name or alias
        raise ProblemError(409, "name-taken", "Name taken", f"{body.name!r} names a built-in hardware profile")
    row = HardwareProfileRow(name=body.name, profile=profile.to_dict(), source=body.source, owner_id=owner.id)
    session.add(row)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise ProblemError(409, "name-taken", "Name taken", f"hardware profile {body.name!r} already exists") from None
    response.headers["Location"] = str(request.url_for("get_hardware_profile", name=row.name))
    return _stored_view(row)
