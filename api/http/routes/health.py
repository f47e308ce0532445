"""Liveness/readiness: the database answers and is migrated to the head revision."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api.http.problems import ProblemError
from api.schemas.problem import problem_responses
from db.engine import ping
from db.migrate import current_revision, head_revision

router = APIRouter(tags=["operations"])


@router.get("/healthz", operation_id="get_health", responses=problem_responses(503))
def get_health(request: Request) -> dict[str, str]:
    engine = request.app.state.engine
    try:
        ping(engine)
        revision = current_revision(engine)
    except Exception as exc:  # any database failure means "not ready"
        raise ProblemError(503, "database-unavailable", "Database unavailable",
                           f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    head = head_revision()
    if revision != head:
        raise ProblemError(503, "database-not-migrated", "Database not migrated",
                           f"database at revision {revision}, code expects {head}; run `python -m db.migrate`")
    return {"status": "ok", "database": engine.dialect.name, "revision": revision}
