"""Every size a user can send is bounded, and the bound is in the answer.

The fields come from the request schemas themselves (the JSON Schema of POST /v1/jobs, /v1/plans and
/v1/trainings, inline model and training specs included): every integer a body can carry must have a
bound, either the schema's ``maximum`` or ``spec.limits``'s for that spec field, and a property test
sends values past each bound and expects a 422 naming it, before any work is done (a billion layers,
a batch of 2^62). A new integer field without a bound fails here."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.schemas.jobs import JobCreate
from api.schemas.plans import PlanCreate
from api.schemas.trainings import TrainingCreate
from spec.catalog import get_model
from spec.limits import (CLUSTER_BOUNDS, MAX_GLOBAL_BATCH, MAX_LAYERS, MODEL_BOUNDS, MODEL_LENGTHS, TRAINING_BOUNDS,
                         TRAINING_LENGTHS)

# the spec classes behind schema definitions, and their bounds in spec.limits
SPEC_BOUNDS = {"ModelSpec": (MODEL_BOUNDS, MODEL_LENGTHS), "TrainingSpec": (TRAINING_BOUNDS, TRAINING_LENGTHS),
               "ClusterIn": (CLUSTER_BOUNDS, {})}
BODIES = {"/v1/jobs": JobCreate, "/v1/plans": PlanCreate, "/v1/trainings": TrainingCreate}
INLINE_MODEL = get_model("tiny-moe").to_dict()


def _resolve(schema: dict, defs: dict) -> tuple[dict, str | None]:
    """``schema`` with a top-level $ref (or a nullable anyOf of one) followed, and the definition's name."""
    for option in schema.get("anyOf", [schema]):
        if "$ref" in option:
            name = option["$ref"].rsplit("/", 1)[1]
            return defs[name], name
    return schema, None


def _kinds(schema: dict) -> set[str]:
    """'int' when the field takes an integer, 'ints' when an array of integers, 'array' any other array."""
    kinds = set()
    for option in schema.get("anyOf", [schema]):
        if option.get("type") == "integer":
            kinds.add("int")
        elif option.get("type") == "array":
            items = option.get("prefixItems") or [option.get("items", {})]
            kinds.add("ints" if all(i.get("type") == "integer" for i in items) else "array")
    return kinds


def _maximum(schema: dict) -> int | None:
    return next((o["maximum"] for o in schema.get("anyOf", [schema]) if "maximum" in o), None)


def bounded_fields(body: type) -> list[tuple[tuple[str, ...], str, int | float]]:
    """(path, kind, bound) of every integer and list field of a request body: kind 'int' (a number above the
    bound is refused), 'ints' (an array of integers, each bounded) or 'length' (an array bounded in entries).
    Fails the test for an integer field with no bound anywhere."""
    root = body.model_json_schema()
    defs = root.get("$defs", {})
    found, unbounded = [], []

    def walk(schema: dict, path: tuple[str, ...], owner: str | None) -> None:
        for name, field in schema.get("properties", {}).items():
            target, definition = _resolve(field, defs)
            if definition is not None:
                walk(target, path + (name,), definition)
                continue
            values, lengths = SPEC_BOUNDS.get(owner or "", ({}, {}))
            kinds = _kinds(field)
            if name in lengths:
                found.append((path + (name,), "length", lengths[name]))
            bound = _maximum(field) if _maximum(field) is not None else values.get(name)
            if kinds & {"int", "ints"}:
                if bound is None:
                    unbounded.append(".".join(path + (name,)))
                else:
                    found.append((path + (name,), "int" if "int" in kinds else "ints", bound))

    walk(root, (), None)
    assert unbounded == [], f"integer fields of {body.__name__} without a bound: {unbounded}"
    return found


def test_every_integer_field_of_every_body_is_bounded():
    for body in BODIES.values():
        paths = {".".join(path) for path, _, _ in bounded_fields(body)}
        assert paths  # the walk reached the fields
    job = {".".join(p) for p, _, _ in bounded_fields(JobCreate)}
    assert {"model_spec.num_layers", "model_spec.hidden_size", "model_spec.num_experts", "model_spec.vocab_size",
            "model_spec.num_attention_heads", "training.seq_length", "training.global_batch_size",
            "cluster.num_gpus", "budget.max_trials", "training.moe_expert_load"} <= job


def _body(path: str, training_body: dict) -> dict[str, Any]:
    """A valid body of the endpoint at ``path``, with an inline model spec."""
    if path == "/v1/trainings":
        body = {k: v for k, v in training_body.items() if k != "model"}
        return {**body, "model_spec": copy.deepcopy(INLINE_MODEL)}
    return {"model_spec": copy.deepcopy(INLINE_MODEL), "training": {"seq_length": 64, "global_batch_size": 8},
            "cluster": {"gpu": "cpu", "num_gpus": 4}}


def _set(body: dict, path: tuple[str, ...], value: Any) -> dict:
    node = body
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return body


CASES = [(endpoint, path, kind, bound) for endpoint, body in BODIES.items()
         for path, kind, bound in bounded_fields(body)]


def _past(kind: str, bound: int | float, excess: int) -> Any:
    """A value of a field of ``kind`` that is ``excess`` past ``bound`` (in value, or for 'length' in entries)."""
    if kind == "length":
        return [1] * (int(bound) + min(excess, 1000))
    return [int(bound) + excess] * 2 if kind == "ints" else int(bound) + excess


def _refused_naming_the_bound(client, headers, training_body, case, excess) -> None:
    endpoint, path, kind, bound = case
    body = _set(_body(endpoint, training_body), path, _past(kind, bound, excess))
    r = client.post(endpoint, json=body, headers=headers)
    assert r.status_code == 422, (endpoint, path, r.status_code, r.text[:300])
    assert f"{int(bound)}" in r.text, (endpoint, path, r.text[:300])


def test_each_bound_refuses_one_past_it(client, alice, training_body):
    for case in CASES:
        _refused_naming_the_bound(client, alice, training_body, case, 1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(CASES), excess=st.one_of(st.integers(1, 1000), st.integers(1, 2**70)))
def test_a_size_past_its_bound_is_refused_naming_the_bound(client, alice, training_body, case, excess):
    _refused_naming_the_bound(client, alice, training_body, case, excess)


@pytest.mark.parametrize("endpoint", ["/v1/jobs", "/v1/plans"])
def test_a_billion_layers_are_refused_at_once(client, alice, endpoint):
    body = _set(_body(endpoint, {}), ("model_spec", "num_layers"), 10**9)
    r = client.post(endpoint, json=body, headers=alice)
    assert r.status_code == 422 and f"num_layers must be at most {MAX_LAYERS}, got 1000000000" in r.text


def test_a_batch_of_two_to_the_62_is_refused_at_submission(client, alice, job_body):
    job_body["training"]["global_batch_size"] = 2**62
    r = client.post("/v1/jobs", json=job_body, headers=alice)
    assert r.status_code == 422 and f"global_batch_size must be at most {MAX_GLOBAL_BATCH}" in r.text
