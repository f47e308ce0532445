"""The model catalog and hardware profiles (built-in datasheet ones plus those stored by users)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response
from api.http.deps import OwnerDep, SessionDep
from api.schemas.catalog import HardwareProfileIn, HardwareProfileList, HardwareProfileOut, ModelList, ModelOut
from api.schemas.common import Name
from api.schemas.problem import problem_responses
from api.service import profiles
from spec.catalog import get_model, model_names

router = APIRouter(prefix="/v1", responses=problem_responses(401))


@router.get("/models", operation_id="list_models", response_model=ModelList, tags=["catalog"])
def list_models(_owner: OwnerDep) -> ModelList:
    """Every model of the built-in catalog (and of FOLDTUNE_CATALOG, if the server was given one)."""
    specs = [get_model(name) for name in model_names()]
    return ModelList(items=[ModelOut(name=s.name, spec=s.to_dict(), num_experts=s.num_experts,
                                     num_layers=s.num_layers) for s in specs])


@router.get("/hardware-profiles", operation_id="list_hardware_profiles", response_model=HardwareProfileList,
            tags=["hardware"])
def list_hardware_profiles(_owner: OwnerDep, session: SessionDep) -> HardwareProfileList:
    """Stored profiles first (they win over a built-in one of the same name), then the built-in catalog."""
    return HardwareProfileList(items=profiles.list_profiles(session))


@router.get("/hardware-profiles/{name}", operation_id="get_hardware_profile", response_model=HardwareProfileOut,
            tags=["hardware"], responses=problem_responses(404))
def get_hardware_profile(name: Annotated[Name, Path()], _owner: OwnerDep, session: SessionDep) -> HardwareProfileOut:
    return profiles.get_profile(session, name)


@router.post("/hardware-profiles", operation_id="create_hardware_profile", status_code=201,
             response_model=HardwareProfileOut, tags=["hardware"], responses=problem_responses(409, 422))
def create_hardware_profile(body: HardwareProfileIn, owner: OwnerDep, session: SessionDep, request: Request,
                            response: Response) -> HardwareProfileOut:
    """Store a hardware profile (e.g. one measured by `foldtune calibrate`) under a new name; jobs may
    then name it as their cluster's gpu."""
    view = profiles.create_profile(session, owner, body)
    response.headers["Location"] = str(request.url_for("get_hardware_profile", name=view.name))
    return view
