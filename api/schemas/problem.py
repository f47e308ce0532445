"""RFC 9457 problem details, the body of every error response (media type application/problem+json)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ViolatedRule(BaseModel):
    """One broken rule of a request: where (``loc``, e.g. ``body.cluster.num_gpus``), which rule, and why."""

    loc: str = Field(description="dotted path of the offending value: body.*, query.*, path.* or header.*")
    rule: str = Field(description="machine name of the violated rule, e.g. greater_than_equal, known_model")
    message: str


class Problem(BaseModel):
    type: str = Field(description="URI naming the kind of problem")
    title: str
    status: int
    detail: str | None = None
    instance: str | None = Field(None, description="path of the request that failed")
    errors: list[ViolatedRule] | None = Field(None, description="every violated rule (validation problems)")


def problem_responses(*statuses: int) -> dict[int | str, dict]:
    """OpenAPI ``responses`` entries declaring problem+json bodies for ``statuses``."""
    return {status: {"model": Problem, "content": {"application/problem+json": {}},
                     "description": _DESCRIPTIONS.get(status, "problem")} for status in statuses}


_DESCRIPTIONS = {
    401: "missing or unknown API key", 404: "no such resource (or not the caller's)",
    403: "a quota of the caller's is used up (the quota named in errors)", 409: "conflict with the current state",
    413: "the request body is larger than the service accepts",
    429: "too many requests from this API key or address; retry after the Retry-After seconds",
    422: "the request breaks a validation rule (each listed in errors)",
    503: "the service cannot do it now: the database is unreachable, or planning is busy or ran past its time "
         "limit (the detail says which)",
}
