"""The FastAPI application: ``create_app()`` wires settings, the database, problem handlers, metrics, the
request limits (body size: api.http.bodylimit; rate: api.http.ratelimit) and the routers. Migrations are applied by ``foldtune serve`` before it starts the app (or here, with
``migrate=True``); request handlers never run a job, a runner process does."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from sqlalchemy import Engine

from api.http.bodylimit import BodyLimit
from api.http.problems import install_problem_handlers
from api.http.ratelimit import RateLimiter
from api.schemas.problem import Problem
from api.http.routes import best, catalog, health, jobs, metrics, plans, trainings, views
from api.http.routes.dashboard import install_dashboard
from api.http.settings import ApiSettings
from api.service.planning import PlanningGate
from db.engine import make_engine, make_sessionmaker
from db.migrate import upgrade

API_VERSION = "1"


def create_app(settings: ApiSettings | None = None, *, engine: Engine | None = None,
               migrate: bool = False) -> FastAPI:
    """The API app for ``settings`` (default: from the environment). ``engine`` lets a caller share one;
    otherwise the app owns its engine and disposes of it at shutdown."""
    settings = settings or ApiSettings.from_env()
    if migrate:
        upgrade(settings.database_url)
    owns_engine = engine is None
    engine = engine or make_engine(settings.database_url)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        if owns_engine:
            engine.dispose()

    app = FastAPI(
        title="foldtune", version=API_VERSION, lifespan=lifespan, docs_url=None, redoc_url=None,
        description="Finds, proves and runs the fastest folded parallel layout for training a Mixture-of-Experts "
                    "transformer. Every error is an RFC 9457 problem (application/problem+json).")
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessions = make_sessionmaker(engine)
    app.state.metrics = metrics.Metrics(app.state.sessions)
    app.state.rate_limiter = RateLimiter(settings.rate_per_s, settings.rate_burst)
    app.state.planning = PlanningGate(settings.plan_concurrency, settings.plan_seconds)
    install_problem_handlers(app)

    @app.middleware("http")
    async def _count_requests(request: Request, call_next):
        start = time.perf_counter()
        try:
            response = await call_next(request)
        except Exception:
            app.state.metrics.count_request(request.method, _route_of(request), 500, time.perf_counter() - start)
            raise
        app.state.metrics.count_request(request.method, _route_of(request), response.status_code,
                                        time.perf_counter() - start)
        return response

    for module in (jobs, best, plans, catalog, health, metrics, trainings, views):
        app.include_router(module.router)
    install_dashboard(app)  # GET / and the offline /docs (Swagger UI vendored in api/http/static)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)  # outermost: before anything reads the body
    _problems_in_openapi(app)
    return app


def _problems_in_openapi(app: FastAPI) -> None:
    """Declare every error response of the spec as application/problem+json (FastAPI's default 422 says
    application/json), and a 400 problem on operations with a body (an undecodable body answers 400)."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        spec = generate()
        problem = {"$ref": "#/components/schemas/Problem"}
        schemas = spec["components"]["schemas"]
        schemas.setdefault("Problem", Problem.model_json_schema(ref_template="#/components/schemas/{model}"))
        for operations in spec["paths"].values():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                if "requestBody" in operation:
                    responses.setdefault("400", {"description": "the body could not be decoded"})
                for status, response in responses.items():
                    if status[0] in "45":
                        response["content"] = {"application/problem+json": {"schema": problem}}
        for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 body, replaced above
            schemas.pop(unused, None)
        app.openapi_schema = spec
        return spec

    app.openapi = openapi


def _route_of(request: Request) -> str:
    route = request.scope.get("route")
    return getattr(route, "path", None) or "unmatched"
