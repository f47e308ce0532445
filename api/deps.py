"""FastAPI dependencies: settings, a database session per request, and the owner behind the API key.

The key travels as ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from api.problems import ProblemError
from api.settings import ApiSettings
from db.keys import owner_for_token
from db.models import Owner

_bearer = HTTPBearer(auto_error=False, description="the API key from `foldtune keys create`")
_api_key = APIKeyHeader(name="X-API-Key", auto_error=False, description="the API key, as an alternative header")


def get_settings(request: Request) -> ApiSettings:
    return request.app.state.settings


def get_session(request: Request) -> Iterator[Session]:
    """A session for one request; whatever the route did not commit is rolled back."""
    with request.app.state.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


def current_owner(session: SessionDep,
                  bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
                  api_key: Annotated[str | None, Depends(_api_key)]) -> Owner:
    """The owner of the presented API key, else a 401 problem."""
    token = bearer.credentials if bearer is not None else api_key
    challenge = {"WWW-Authenticate": 'Bearer realm="foldtune"'}
    if not token:
        raise ProblemError(401, "unauthorized", "API key required",
                           "send the key as 'Authorization: Bearer <key>' or 'X-API-Key: <key>'", headers=challenge)
    owner = owner_for_token(session, token)
    if owner is None:
        raise ProblemError(401, "unauthorized", "Unknown API key", "the API key is unknown or revoked",
                           headers=challenge)
    return owner


OwnerDep = Annotated[Owner, Depends(current_owner)]
SettingsDep = Annotated[ApiSettings, Depends(get_settings)]
