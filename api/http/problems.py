"""Every error of the API as an RFC 9457 problem (``application/problem+json``).

The use cases raise domain errors (:mod:`api.service.errors`); this module is the one place that maps
them to problems (NotFound 404, Conflict 409, RuleViolation 422, QuotaExceeded 403, Unavailable 503). Routes raise :class:`ProblemError`
only for what is HTTP's own (a missing API key, an unready database). The handlers installed here also
turn FastAPI's validation errors (listing each violated rule by name and location) and Starlette's HTTP
errors (unknown route, wrong method) into problems, and any unexpected exception into a 500 problem that
reveals nothing internal.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from api.schemas.problem import Problem, ViolatedRule
from api.service.errors import Conflict, NotFound, RuleViolation, ServiceError, Unavailable
from api.service.quotas import QuotaExceeded

PROBLEM_MEDIA_TYPE = "application/problem+json"
TYPE_PREFIX = "urn:foldtune:problem:"

log = logging.getLogger("foldtune.api")


class ProblemError(Exception):
    """An HTTP error a route reports on purpose: ``status``, a short ``kind`` slug (the problem type), a
    ``title`` and a ``detail`` sentence, and optionally the violated rules."""

    def __init__(self, status: int, kind: str, title: str, detail: str | None = None,
                 errors: Sequence[ViolatedRule] | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail or title)
        self.status, self.kind, self.title, self.detail = status, kind, title, detail
        self.errors = list(errors) if errors else None
        self.headers = headers


def _rule_line(rule: ViolatedRule) -> str:
    return f"{rule.loc}: {rule.message} [{rule.rule}]"


_DOMAIN_STATUS: tuple[tuple[type[ServiceError], int], ...] = ((NotFound, 404), (Conflict, 409), (RuleViolation, 422),
                                                              (QuotaExceeded, 403), (Unavailable, 503))


def problem_of(error: ServiceError) -> ProblemError:
    """The problem a domain error answers as: NotFound 404, Conflict 409, RuleViolation 422 (with its rule),
    QuotaExceeded 403 (with the quota as its rule), Unavailable 503 (with ``Retry-After``)."""
    status = next((code for cls, code in _DOMAIN_STATUS if isinstance(error, cls)), 400)
    errors = None
    if isinstance(error, RuleViolation):
        errors = [ViolatedRule(loc=error.loc, rule=error.rule, message=error.message)]
    elif isinstance(error, QuotaExceeded):
        errors = [ViolatedRule(loc=error.loc, rule=error.quota, message=error.message)]
    headers = {"Retry-After": str(error.retry_after)} if isinstance(error, Unavailable) else None
    return ProblemError(status, error.kind, error.title, error.detail, errors=errors, headers=headers)


def problem_response(request: Request, status: int, kind: str, title: str, detail: str | None = None,
                     errors: list[ViolatedRule] | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = Problem(type=TYPE_PREFIX + kind, title=title, status=status, detail=detail,
                   instance=request.url.path, errors=errors)
    return JSONResponse(body.model_dump(exclude_none=True), status_code=status, media_type=PROBLEM_MEDIA_TYPE,
                        headers=headers)


def _loc(parts: Sequence[Any]) -> str:
    return ".".join(str(p) for p in parts) or "body"


def _validation_rules(errors: Sequence[dict[str, Any]]) -> list[ViolatedRule]:
    rules = []
    for err in errors:
        message = err.get("msg", "")
        if message.startswith("Value error, "):
            message = message[len("Value error, "):]
        rules.append(ViolatedRule(loc=_loc(err.get("loc", ())), rule=str(err.get("type", "invalid")), message=message))
    return rules


_STATUS_KINDS = {400: "bad-request", 401: "unauthorized", 403: "forbidden", 404: "not-found",
                 405: "method-not-allowed", 406: "not-acceptable", 409: "conflict", 413: "too-large",
                 415: "unsupported-media-type", 429: "too-many-requests", 503: "unavailable"}


_METHODS = ("DELETE", "GET", "OPTIONS", "PATCH", "POST", "PUT")  # HEAD goes with GET and is not listed


def _allowed_methods(request: Request) -> list[str]:
    """The methods some route fully matches for this path: each one asked of the router as a request of its
    own (routers included with ``include_router`` hide their routes' method sets, so they are not read)."""
    return [method for method in _METHODS
            if any(route.matches({**request.scope, "method": method})[0] == Match.FULL
                   for route in request.app.router.routes)]


def install_problem_handlers(app: FastAPI) -> None:
    """Make every error response of ``app`` a problem."""

    @app.exception_handler(ProblemError)
    async def _problem(request: Request, exc: ProblemError) -> JSONResponse:
        return problem_response(request, exc.status, exc.kind, exc.title, exc.detail, exc.errors, exc.headers)

    @app.exception_handler(ServiceError)
    async def _domain(request: Request, exc: ServiceError) -> JSONResponse:
        return await _problem(request, problem_of(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        rules = _validation_rules(exc.errors())
        detail = "; ".join(_rule_line(r) for r in rules[:5])
        return problem_response(request, 422, "validation", "Request breaks a validation rule", detail, rules)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = _STATUS_KINDS.get(exc.status_code, "http-error")
        title = kind.replace("-", " ").capitalize()
        detail = exc.detail if isinstance(exc.detail, str) and exc.detail.lower() != title.lower() else None
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            # Starlette names only the first route that matched the path; FastAPI has one route per method
            headers["Allow"] = ", ".join(_allowed_methods(request))
            detail = f"{request.method} is not allowed here; use {headers['Allow']}"
        return problem_response(request, exc.status_code, kind, title, detail, headers=headers or None)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return problem_response(request, 500, "internal", "Internal server error",
                                "the server failed to handle this request; it has been logged")
