"""Submitting, listing, showing and cancelling jobs; validation problems name the violated rule."""

import pytest

from db.models import Job
from db.queue import claim_next_job, finish_job
from db.trials import finish_trial, start_trial

PROBLEM = "application/problem+json"



def _rules(response):
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith(PROBLEM)
    body = response.json()
    assert body["type"].endswith(":validation") and body["status"] == 422
    return {(e["loc"], e["rule"]) for e in body["errors"]}, body


def test_submit_stores_a_queued_job(client, alice, job_body, app):
    r = client.post("/v1/jobs", json=job_body, headers=alice)
    assert r.status_code == 201, r.text
    job = r.json()
    assert r.headers["location"].endswith(f"/v1/jobs/{job['id']}")
    assert job["status"] == "queued" and job["model"] == "tiny-moe"
    assert job["cluster"] == {"gpu": "cpu", "num_gpus": 4}
    assert job["budget"] == {"max_trials": 6, "max_seconds": 600.0}
    assert job["training"]["seq_length"] == 64 and job["training"]["precision"] == "fp32"  # cpu: spec/shape_defaults
    assert job["model_spec"]["num_experts"] == 8 and len(job["signature"]) == 64
    assert job["trials"]["total"] == 0 and job["best_trial"] is None
    with app.state.sessions() as s:
        row = s.get(Job, job["id"])
        assert row.cluster["hardware"]["name"] == "cpu"  # the profile is snapshotted with the job
    assert client.get(f"/v1/jobs/{job['id']}", headers=alice).json() == job


@pytest.mark.parametrize("mutate, loc, rule", [
    (lambda b: b["cluster"].update(num_gpus=0), "body.cluster.num_gpus", "greater_than_equal"),
    (lambda b: b["cluster"].pop("gpu"), "body.cluster.gpu", "missing"),
    (lambda b: b["budget"].update(max_trials=0), "body.budget.max_trials", "greater_than_equal"),
    (lambda b: b["training"].update(seq_length=0), "body.training", "training_spec_rules"),
    (lambda b: b["training"].update(bogus=1), "body.training", "training_spec_rules"),
    (lambda b: b["training"].update(precision="fp4"), "body.training", "training_spec_rules"),
    (lambda b: b.update(model="no-such-model"), "body.model", "known_model"),
    (lambda b: b["cluster"].update(gpu="tpu-v9"), "body.cluster.gpu", "known_gpu"),
    (lambda b: b["cluster"].update(gpu="h100", num_gpus=12), "body.cluster.num_gpus", "whole_nodes"),
    (lambda b: b.pop("model"), "body", "model_xor_model_spec"),
    (lambda b: b.update(surprise=True), "body.surprise", "extra_forbidden"),
    (lambda b: b.update(model_spec={"name": "m", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 0,
                                    "ffn_hidden_size": 64, "vocab_size": 10}) or b.pop("model"),
     "body.model_spec", "model_spec_rules"),
])
def test_validation_problem_names_the_rule(refused, job_body, mutate, loc, rule):
    client, alice, _ = refused
    mutate(job_body)
    rules, body = _rules(client.post("/v1/jobs", json=job_body, headers=alice))
    assert (loc, rule) in rules, rules
    assert rule in body["detail"] or loc in body["detail"]


def test_inline_model_spec(client, alice, job_body):
    del job_body["model"]
    job_body["model_spec"] = {"name": "my-moe", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                              "ffn_hidden_size": 128, "vocab_size": 256, "num_experts": 4, "moe_router_topk": 2}
    r = client.post("/v1/jobs", json=job_body, headers=alice)
    assert r.status_code == 201, r.text
    assert r.json()["model"] == "my-moe" and r.json()["model_spec"]["num_experts"] == 4


def test_same_question_same_signature(client, alice, bob, job_body):
    a = client.post("/v1/jobs", json=job_body, headers=alice).json()
    b = client.post("/v1/jobs", json=job_body, headers=bob).json()
    job_body["training"]["global_batch_size"] = 16
    c = client.post("/v1/jobs", json=job_body, headers=alice).json()
    assert a["signature"] == b["signature"] != c["signature"]


def test_idempotency_key_returns_the_first_job(client, alice, job_body):
    headers = {**alice, "Idempotency-Key": "submit-1"}
    first = client.post("/v1/jobs", json=job_body, headers=headers)
    again = client.post("/v1/jobs", json=job_body, headers=headers)
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"]
    job_body["budget"]["max_trials"] = 7
    conflict = client.post("/v1/jobs", json=job_body, headers=headers)
    assert conflict.status_code == 409 and conflict.json()["type"].endswith(":idempotency-key-reused")
    assert client.get("/v1/jobs", headers=alice).json()["total"] == 1


def test_pagination_and_filters(client, alice, bob, job_body):
    ids = []
    for i in range(7):
        body = {**job_body, "model": "tiny-moe" if i % 2 else "small-moe"}
        ids.append(client.post("/v1/jobs", json=body, headers=alice).json()["id"])
    client.post("/v1/jobs", json=job_body, headers=bob)
    seen, offset = [], 0
    while offset is not None:
        page = client.get("/v1/jobs", params={"limit": 3, "offset": offset}, headers=alice).json()
        assert page["total"] == 7 and page["limit"] == 3 and len(page["items"]) <= 3
        seen += [j["id"] for j in page["items"]]
        offset = page["next_offset"]
    assert seen == sorted(ids, reverse=True)  # newest first, every job once
    tiny = client.get("/v1/jobs", params={"model": "tiny-moe"}, headers=alice).json()
    assert tiny["total"] == 3 and {j["model"] for j in tiny["items"]} == {"tiny-moe"}
    client.post(f"/v1/jobs/{ids[0]}/cancel", headers=alice)
    cancelled = client.get("/v1/jobs", params={"status": "cancelled"}, headers=alice).json()
    assert [j["id"] for j in cancelled["items"]] == [ids[0]]
    rules, _ = _rules(client.get("/v1/jobs", params={"limit": 0}, headers=alice))
    assert ("query.limit", "greater_than_equal") in rules
    rules, _ = _rules(client.get("/v1/jobs", params={"status": "sleeping"}, headers=alice))
    assert ("query.status", "literal_error") in rules


def test_cancel_queued_running_and_finished(client, alice, job_body, app):
    queued = client.post("/v1/jobs", json=job_body, headers=alice).json()["id"]
    r = client.post(f"/v1/jobs/{queued}/cancel", headers=alice)
    assert r.status_code == 200 and r.json()["status"] == "cancelled" and r.json()["finished_at"]
    assert client.post(f"/v1/jobs/{queued}/cancel", headers=alice).json()["status"] == "cancelled"  # idempotent

    running = client.post("/v1/jobs", json=job_body, headers=alice).json()["id"]
    with app.state.sessions() as s:
        assert claim_next_job(s, "runner-a").id == running
        trial = start_trial(s, running, 0, {"tp": 1, "ep": 4}, runner_id="runner-a")
    assert client.post(f"/v1/jobs/{running}/cancel", headers=alice).json()["status"] == "cancelled"
    trials = client.get(f"/v1/jobs/{running}/trials", headers=alice).json()["items"]
    assert [(t["id"], t["status"], t["failure_kind"]) for t in trials] == [(trial.id, "failed", "cancelled")]
    with app.state.sessions() as s:
        assert not finish_job(s, running, "runner-a", "succeeded")  # the runner learns it lost the job

    done = client.post("/v1/jobs", json=job_body, headers=alice).json()["id"]
    with app.state.sessions() as s:
        claim_next_job(s, "runner-b")
        finish_job(s, done, "runner-b", "succeeded")
    r = client.post(f"/v1/jobs/{done}/cancel", headers=alice)
    assert r.status_code == 409 and r.json()["type"].endswith(":job-finished")


def test_trials_are_listed_in_number_order_with_counts(client, alice, job_body, app):
    job_id = client.post("/v1/jobs", json=job_body, headers=alice).json()["id"]
    with app.state.sessions() as s:
        claim_next_job(s, "r")
        t = [start_trial(s, job_id, n, {"tp": 1, "ep": n + 1}, runner_id="r", label=f"ep{n + 1}",
                         predicted_step_time_s=0.1 * (n + 1)) for n in range(3)]
        finish_trial(s, t[0].id, "succeeded", measurement={"step_time_s": 0.3}, step_time_s=0.3)
        finish_trial(s, t[1].id, "failed", failure_kind="oom", failure_reason="out of memory on rank 2")
    page = client.get(f"/v1/jobs/{job_id}/trials", params={"limit": 2}, headers=alice).json()
    assert [x["number"] for x in page["items"]] == [0, 1] and page["next_offset"] == 2 and page["total"] == 3
    assert page["items"][1]["failure_reason"] == "out of memory on rank 2"
    job = client.get(f"/v1/jobs/{job_id}", headers=alice).json()
    assert job["trials"] == {"total": 3, "running": 1, "succeeded": 1, "pruned": 0, "failed": 1}
    assert job["best_trial"]["number"] == 0 and job["best_trial"]["step_time_s"] == 0.3


@pytest.mark.parametrize("method, path, status", [("GET", "/v1/nowhere", 404), ("DELETE", "/v1/jobs", 405),
                                                  ("GET", "/v1/jobs/0", 422), ("GET", "/v1/jobs/99999", 404)])
def test_http_errors_are_problems(refused, method, path, status):
    client, alice, _ = refused
    r = client.request(method, path, headers=alice)
    assert r.status_code == status
    assert r.headers["content-type"].startswith(PROBLEM)
    assert r.json()["status"] == status and r.json()["title"]


def test_malformed_json_is_a_validation_problem(refused):
    client, alice, _ = refused
    r = client.post("/v1/jobs", content=b"{not json", headers={**alice, "Content-Type": "application/json"})
    rules, _ = _rules(r)
    assert any(rule == "json_invalid" for _, rule in rules)
