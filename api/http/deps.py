"""FastAPI dependencies: settings, a database session per request, and the owner behind the API key.

The key travels as ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Query, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from api.http.problems import ProblemError
from api.schemas.common import MAX_ID, MAX_PAGE_SIZE
from api.http.settings import ApiSettings
from db.keys import owner_for_token
from db.models import Owner

_bearer = HTTPBearer(auto_error=False, description="the API key from `foldtune keys create`")
_api_key = APIKeyHeader(name="X-API-Key", auto_error=False, description="the API key, as an alternative header")


def get_settings(request: Request) -> ApiSettings:
    return request.app.state.settings


async def get_session(request: Request) -> AsyncIterator[Session]:
    """A session for one request; whatever the route did not commit is rolled back.

    Routes end their own transactions (commit) before returning. The cleanup here is async on purpose:
    it then runs on the event loop instead of waiting for a worker thread, which matters on SQLite,
    where an open transaction holds the database lock and every worker thread may be busy waiting for it.
    """
    session = request.app.state.sessions()
    try:
        yield session
    finally:
        session.close()


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
    session.commit()  # hold no transaction (on SQLite: no lock) while the route waits for a worker thread
    if owner is None:
        raise ProblemError(401, "unauthorized", "Unknown API key", "the API key is unknown or revoked",
                           headers=challenge)
    return owner


OwnerDep = Annotated[Owner, Depends(current_owner)]
SettingsDep = Annotated[ApiSettings, Depends(get_settings)]


# list endpoints: one page of ``limit`` items from ``offset`` (api.schemas.common.Page)
Limit = Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE, description="page size")]
Offset = Annotated[int, Query(ge=0, le=MAX_ID, description="items to skip")]


def page(items: list, total: int, limit: int, offset: int) -> dict:
    """A ``Page`` body: ``next_offset`` is null once ``offset + len(items)`` reaches ``total``."""
    return {"items": items, "total": total, "limit": limit, "offset": offset,
            "next_offset": offset + len(items) if offset + len(items) < total else None}
