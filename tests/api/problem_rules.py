"""The (loc, rule) pairs of a 422 validation problem, for the API tests."""

from __future__ import annotations

PROBLEM = "application/problem+json"


def validation_rules(response) -> set[tuple]:
    """{(loc, rule)} of a 422 problem answer; fails unless it is one (status and RFC 9457 content type)."""
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith(PROBLEM)
    return {(e["loc"], e["rule"]) for e in response.json()["errors"]}
