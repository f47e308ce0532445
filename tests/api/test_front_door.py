"""The one capability check at the front door: POST /v1/jobs and POST /v1/trainings refuse a model, proxy or
layout the executor cannot run with a 422 problem naming the rule (never a queued job that fails later),
and accept a proxy, which the job and the training show."""

from __future__ import annotations

import pytest

from spec.model_spec import ModelSpec
from spec.proxy import tiny_proxy
from spec.validity import unsupported_features
from db.models import Job

DROPOUT_MOE = {"name": "drop-moe", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
               "ffn_hidden_size": 128, "vocab_size": 256, "num_experts": 4, "moe_router_topk": 2,
               "hidden_dropout": 0.1}  # dropout: a feature the executor does not build


def _violation(response):
    """The one (loc, rule) of a 422 problem, and its detail."""
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert body["detail"] and body["errors"], body
    return {(e["loc"], e["rule"]) for e in body["errors"]}, body["detail"]


def _count_jobs(app) -> int:
    with app.state.sessions() as s:
        return s.query(Job).count()


def test_a_model_with_a_feature_the_executor_lacks_is_refused_naming_it(client, alice, job_body, app):
    del job_body["model"]
    job_body["model_spec"] = DROPOUT_MOE
    rules, detail = _violation(client.post("/v1/jobs", json=job_body, headers=alice))
    assert rules == {("body.model", "executor_model")} and "dropout" in detail
    assert _count_jobs(app) == 0  # refused, not queued


def test_a_tiny_proxy_keeps_the_feature_the_executor_lacks_and_is_refused(client, alice, job_body):
    # every catalog model runs now (tests/executor/test_equivalence.py asserts it), so an inline model stands
    # for one whose features are not built: its proxy keeps the feature and is refused for it
    del job_body["model"]
    job_body.update(model_spec=DROPOUT_MOE, proxy="tiny")
    rules, detail = _violation(client.post("/v1/jobs", json=job_body, headers=alice))
    assert rules == {("body.model", "executor_model")}
    assert "dropout" in detail and "dropout" in ", ".join(unsupported_features(tiny_proxy(
        ModelSpec.from_dict(DROPOUT_MOE))))


@pytest.mark.parametrize("override, loc, rule", [
    (3, "body.num_layers_override", "proxy_layers"),  # tiny-moe has 2 layers
    (0, "body.num_layers_override", "greater_than_equal"),
    ("many", "body.num_layers_override", "int_parsing"),
])
def test_proxy_layers_out_of_range(client, alice, job_body, override, loc, rule):
    job_body["num_layers_override"] = override
    rules, detail = _violation(client.post("/v1/jobs", json=job_body, headers=alice))
    assert (loc, rule) in rules
    if rule == "proxy_layers":
        assert "[1, 2]" in detail


def test_unknown_proxy_kind(client, alice, job_body):
    job_body["proxy"] = "small"
    rules, _ = _violation(client.post("/v1/jobs", json=job_body, headers=alice))
    assert ("body.proxy", "literal_error") in rules


def test_a_model_that_fits_no_layout_of_the_cluster_is_refused(client, alice, job_body, app):
    # the example: mixtral-8x22b on one node answered "queued", then failed with an empty reason
    job_body.update(model="mixtral-8x22b", training={"seq_length": 4096, "global_batch_size": 1024},
                    cluster={"gpu": "h100", "num_gpus": 8})
    rules, detail = _violation(client.post("/v1/jobs", json=job_body, headers=alice))
    assert rules == {("body.cluster", "layout_fits")} and "fit in GPU memory" in detail
    assert _count_jobs(app) == 0
    job_body["num_layers_override"] = 4  # the proxy measures the same widths on fewer layers: it fits
    r = client.post("/v1/jobs", json=job_body, headers=alice)
    assert r.status_code == 201, r.text
    assert r.json()["proxy"] == {"of": "mixtral-8x22b", "proxy": None, "num_layers": 4}


@pytest.mark.parametrize("training, loc, rule, says", [
    ({"seq_length": 63, "global_batch_size": 8}, "body.cluster", "executor_layout", "2·cp"),  # valid for Megatron
    ({"seq_length": 64, "global_batch_size": 8, "precision": "fp8"}, "body", "has_valid_layout", "fp8"),
])
def test_no_runnable_layout_is_refused_with_the_reason(client, alice, job_body, app, training, loc, rule, says):
    job_body["training"] = training
    rules, detail = _violation(client.post("/v1/jobs", json=job_body, headers=alice))
    assert rules == {(loc, rule)} and says in detail
    assert _count_jobs(app) == 0


def test_a_proxy_job_shows_the_proxy_it_measures(client, alice, job_body):
    job_body.update(model="mixtral-8x7b", proxy="tiny", num_layers_override=1)
    r = client.post("/v1/jobs", json=job_body, headers=alice)
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["model"] == "mixtral-8x7b@tiny@1L"
    assert job["proxy"] == {"of": "mixtral-8x7b", "proxy": "tiny", "num_layers": 1}
    assert job["model_spec"]["num_layers"] == 1 and job["model_spec"]["hidden_size"] == 64
    assert client.get(f"/v1/jobs/{job['id']}", headers=alice).json() == job
    full = client.post("/v1/jobs", json={**job_body, "proxy": None, "num_layers_override": None,
                                         "model": "tiny-moe"}, headers=alice).json()
    assert full["proxy"] is None and full["signature"] != job["signature"]


@pytest.fixture
def training_body(training_body):
    """conftest's body on a layout that needs the executor's TP rules: tp2 with the experts over ep2."""
    return {**training_body, "layout": "tp2 ep2 etp1 mbs1"}


def test_training_layout_is_checked_with_the_executor_rules(client, alice, training_body):
    assert client.post("/v1/trainings", json=training_body, headers=alice).status_code == 201
    training_body["seq_length"] = 65  # Megatron runs it; the executor splits the sequence over tp
    rules, detail = _violation(client.post("/v1/trainings", json=training_body, headers=alice))
    assert rules == {("body.layout", "executor_seq_cp")} and "tp·cp" in detail  # the first rule; every one in detail
    training_body.update(seq_length=64, model=None, model_spec=DROPOUT_MOE)
    rules, detail = _violation(client.post("/v1/trainings", json=training_body, headers=alice))
    assert rules == {("body.model", "executor_model")} and "dropout" in detail


def test_a_proxy_training_shows_the_proxy(client, alice, training_body):
    training_body.update(model="mixtral-8x7b", proxy="tiny")
    r = client.post("/v1/trainings", json=training_body, headers=alice)
    assert r.status_code == 201, r.text
    t = r.json()
    assert t["model"] == "mixtral-8x7b@tiny" and t["proxy"] == {"of": "mixtral-8x7b", "proxy": "tiny", "num_layers": 2}
    assert client.get(f"/v1/trainings/{t['id']}", headers=alice).json()["proxy"] == t["proxy"]
    training_body["num_layers_override"] = 40
    rules, _ = _violation(client.post("/v1/trainings", json=training_body, headers=alice))
    assert rules == {("body.num_layers_override", "proxy_layers")}


def test_a_training_of_a_job_takes_the_jobs_proxy(client, alice, training_body):
    del training_body["layout"], training_body["model"], training_body["cluster"]
    training_body.update(job_id=1, proxy="tiny")
    rules, _ = _violation(client.post("/v1/trainings", json=training_body, headers=alice))
    assert rules == {("body", "job_fixes_workload")}
