"""The model catalog and hardware profiles (built-in datasheet ones plus those stored by users)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response
from api.http.deps import Offset, OwnerDep, SessionDep, SettingsDep, location, page
from api.schemas.catalog import HardwareProfileIn, HardwareProfileOut, ModelList, ModelOut
from api.schemas.common import Name, Page
from api.schemas.problem import problem_responses
from api.service import profiles
from spec.catalog import get_model, model_names

router = APIRouter(prefix="/v1", responses=problem_responses(401, 429))

MAX_PROFILES_PAGE = 50  # a stored profile may take FOLDTUNE_QUOTA_PROFILE_BYTES: pages stay a few MB at most
ProfileLimit = Annotated[int, Query(ge=1, le=MAX_PROFILES_PAGE, description="page size")]


@router.get("/models", operation_id="list_models", response_model=ModelList, tags=["catalog"])
def list_models(_owner: OwnerDep) -> ModelList:
    """Every model of the built-in catalog (and of FOLDTUNE_CATALOG, if the server was given one)."""
    specs = [get_model(name) for name in model_names()]
    return ModelList(items=[ModelOut(name=s.name, spec=s.to_dict(), num_experts=s.num_experts,
                                     num_layers=s.num_layers) for s in specs])


@router.get("/hardware-profiles", operation_id="list_hardware_profiles", response_model=Page[HardwareProfileOut],
            tags=["hardware"])
def list_hardware_profiles(_owner: OwnerDep, session: SessionDep, limit: ProfileLimit = 20,
                           offset: Offset = 0) -> dict:
    """Stored profiles first, by name (they win over a built-in one of the same name), then the built-in
    catalog; one page of them."""
    items, total = profiles.list_profiles(session, limit, offset)
    return page(items, total, limit, offset)


@router.get("/hardware-profiles/{name}", operation_id="get_hardware_profile", response_model=HardwareProfileOut,
            tags=["hardware"], responses=problem_responses(404))
def get_hardware_profile(name: Annotated[Name, Path()], _owner: OwnerDep, session: SessionDep) -> HardwareProfileOut:
    return profiles.get_profile(session, name)


@router.post("/hardware-profiles", operation_id="create_hardware_profile", status_code=201,
             response_model=HardwareProfileOut, tags=["hardware"], responses=problem_responses(403, 409, 413, 422))
def create_hardware_profile(body: HardwareProfileIn, owner: OwnerDep, session: SessionDep, settings: SettingsDep,
                            request: Request, response: Response) -> HardwareProfileOut:
    """Store a hardware profile (e.g. one measured by `foldtune calibrate`) under a new name; jobs may
    then name it as their cluster's gpu."""
    view = profiles.create_profile(session, owner, body, settings.quotas)
    response.headers["Location"] = location(request, "get_hardware_profile", name=view.name)
    return view
