"""FastAPI dependencies: settings, a database session per request, and the owner behind the API key
(rate-limited: api.http.ratelimit), and the ``Location`` of a created resource.

The key travels as ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Query, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from api.http.problems import ProblemError
from api.http.ratelimit import retry_after
from api.schemas.common import MAX_ID, MAX_PAGE_SIZE
from api.http.settings import ApiSettings
from db.keys import hash_token, owner_for_token
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


def _limit(request: Request, bucket: str, who: str) -> None:
    """A 429 problem with ``Retry-After`` when ``bucket`` has no request left."""
    wait = request.app.state.rate_limiter.take(bucket)
    if wait is not None:
        raise ProblemError(429, "too-many-requests", "Too many requests",
                           f"{who} sent more than {request.app.state.settings.rate_per_s:g} requests per second "
                           f"on average; retry in {retry_after(wait)} s", headers={"Retry-After": retry_after(wait)})


def current_owner(request: Request, session: SessionDep,
                  bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
                  api_key: Annotated[str | None, Depends(_api_key)]) -> Owner:
    """The owner of the presented API key, else a 401 problem; a 429 problem past the key's request rate
    (or, for a missing or unknown key, past the rate of the client's address)."""
    token = bearer.credentials if bearer is not None else api_key
    challenge = {"WWW-Authenticate": 'Bearer realm="foldtune"'}
    address = f"addr:{request.client.host if request.client else '-'}"
    if not token:
        _limit(request, address, "this address")
        raise ProblemError(401, "unauthorized", "API key required",
                           "send the key as 'Authorization: Bearer <key>' or 'X-API-Key: <key>'", headers=challenge)
    owner = owner_for_token(session, token)
    session.commit()  # hold no transaction (on SQLite: no lock) while the route waits for a worker thread
    if owner is None:
        _limit(request, address, "this address")
        raise ProblemError(401, "unauthorized", "Unknown API key", "the API key is unknown or revoked",
                           headers=challenge)
    _limit(request, f"key:{hash_token(token)}", "this API key")
    return owner


OwnerDep = Annotated[Owner, Depends(current_owner)]
SettingsDep = Annotated[ApiSettings, Depends(get_settings)]


def location(request: Request, route_name: str, **params: object) -> str:
    """The absolute URL of a route for a ``Location`` header: the configured public URL (never the
    client's ``Host``, which anyone can set) followed by the route's path."""
    path = request.app.url_path_for(route_name, **{k: str(v) for k, v in params.items()})
    return request.app.state.settings.base_url + path


# list endpoints: one page of ``limit`` items from ``offset`` (api.schemas.common.Page)
Limit = Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE, description="page size")]
Offset = Annotated[int, Query(ge=0, le=MAX_ID, description="items to skip")]


def page(items: list, total: int, limit: int, offset: int) -> dict:
    """A ``Page`` body: ``next_offset`` is null once ``offset + len(items)`` reaches ``total``."""
    return {"items": items, "total": total, "limit": limit, "offset": offset,
            "next_offset": offset + len(items) if offset + len(items) < total else None}
