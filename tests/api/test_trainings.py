"""Trainings API contracts: auth, owner scoping, validation rules by name, creating from a job's best trial,
metrics pagination by step, per-layer expert load, cancel."""


import pytest
from service_env import auth

from spec.parallel_config import ParallelConfig
from db.queue import claim_next_job, claim_next_training, finish_training
from db.trainings import record_expert_load, record_training_metrics
from spec.limits import MAX_EXPERT_LOAD_CELLS
from db.trials import finish_trial, start_trial
from problem_rules import validation_rules


@pytest.fixture
def body(training_body):
    return training_body



@pytest.fixture
def refused_body(refused):
    """A valid POST /v1/trainings body for alice on the ``refused`` API (as ``training_body``, its data root)."""
    root = refused[2]
    data = root / "alice" / "data"
    data.mkdir(parents=True, exist_ok=True)
    return {"layout": "tp1 ep2 dp2 mbs1", "model": "tiny-moe", "cluster": {"gpu": "cpu", "num_gpus": 2},
            "seq_length": 64, "global_batch_size": 8, "data_path": str(data), "steps": 20,
            "checkpoint_dir": str(root / "alice" / "ckpt")}


def test_needs_an_api_key(refused, refused_body):
    client, _, _ = refused
    body = refused_body
    for r in (client.post("/v1/trainings", json=body), client.get("/v1/trainings"),
              client.get("/v1/trainings/1"), client.get("/v1/trainings/1/metrics"),
              client.post("/v1/trainings/1/cancel")):
        assert r.status_code == 401


def test_create_explicit_layout_and_show(client, alice, body):
    r = client.post("/v1/trainings", json=body, headers=alice)
    assert r.status_code == 201, r.text
    t = r.json()
    assert r.headers["Location"].endswith(f"/v1/trainings/{t['id']}")
    assert (t["status"], t["model"], t["steps"], t["job_id"]) == ("queued", "tiny-moe", 20, None)
    assert (t["config"]["ep"], t["config"]["world_size"], t["training"]["seq_length"]) == (2, 2, 64)
    assert t["recipe"]["lr"] == 3e-3 and t["latest_metrics"] is None
    assert client.get(f"/v1/trainings/{t['id']}", headers=alice).json() == t
    page = client.get("/v1/trainings", headers=alice).json()
    assert (page["total"], page["items"][0]["id"]) == (1, t["id"])


@pytest.mark.parametrize("mutate, loc, rule", [
    (lambda b: b.update(data_path="no-such-data"), "body.data_path", "data_path_exists"),
    (lambda b: b.update(data_path="/nonexistent/foldtune-data"), "body.data_path", "path_in_owner_root"),
    (lambda b: b.update(layout="tp2 zz3"), "body.layout", "layout_parses"),
    (lambda b: b.update(layout="tp4 mbs1"), "body.layout", "world_dense"),
    (lambda b: b.update(layout="recompute=full:x"), "body.layout", "layout_parses"),
    (lambda b: b.update(layout="pp2 vpp2 mbs1"), "body.layout", "layers_pp"),
    (lambda b: b.update(global_batch_size=7), "body.global_batch_size", "batch_divides"),
    (lambda b: b.update(job_id=1), "body", "job_id_xor_layout"),
    (lambda b: b.pop("cluster"), "body", "layout_needs_workload"),
    (lambda b: b.update(model="no-such-model"), "body.model", "known_model"),
    (lambda b: b.update(lr=1e-4, min_lr=1e-3), "body", "min_lr_le_lr"),
    (lambda b: b.update(steps=0), "body.steps", "greater_than_equal"),
])
def test_validation_rules_are_named(refused, refused_body, mutate, loc, rule):
    client, alice, _ = refused
    body = refused_body
    mutate(body)
    assert (loc, rule) in validation_rules(client.post("/v1/trainings", json=body, headers=alice))


def _give_best(app, job_id):
    config = ParallelConfig.parse("tp1 ep2 mbs1", world_size=4)
    with app.state.sessions() as s:
        assert claim_next_job(s, "r1").id == job_id
        t = start_trial(s, job_id, 0, config.to_dict(), runner_id="r1", label=config.label(),
                        predicted_step_time_s=0.25)
        finish_trial(s, t.id, "succeeded", measurement={"step_time_s": 0.3}, step_time_s=0.3)
    return config


def test_create_from_a_jobs_best(client, app, alice, bob, body, job_body):
    job_id = client.post("/v1/jobs", json=job_body, headers=alice).json()["id"]
    from_job = {k: body[k] for k in ("data_path", "steps", "checkpoint_dir")}
    assert ("body.job_id", "job_has_best") in validation_rules(
        client.post("/v1/trainings", json={**from_job, "job_id": job_id}, headers=alice))
    config = _give_best(app, job_id)
    assert ("body.job_id", "known_job") in validation_rules(
        client.post("/v1/trainings", json={**from_job, "job_id": job_id}, headers=bob))
    assert ("body", "job_fixes_workload") in validation_rules(
        client.post("/v1/trainings", json={**from_job, "job_id": job_id, "model": "tiny-moe"}, headers=alice))
    assert ("body.global_batch_size", "batch_divides") in validation_rules(
        client.post("/v1/trainings", json={**from_job, "job_id": job_id, "global_batch_size": 3}, headers=alice))
    r = client.post("/v1/trainings", json={**from_job, "job_id": job_id, "lr": 1e-3}, headers=alice)
    assert r.status_code == 201, r.text
    t = r.json()
    assert (t["job_id"], t["config"], t["label"]) == (job_id, config.to_dict(), config.label())
    assert (t["training"]["global_batch_size"], t["cluster"]["num_gpus"], t["recipe"]["lr"]) == (8, 4, 1e-3)
    assert t["predicted_step_time_s"] == pytest.approx(0.25)


def test_a_layout_the_executor_does_not_build_is_refused_at_submission(client, app, alice, body, job_body):
    """The executor keeps no fp8 Adam moments (Megatron does): the rule book's executor_optimizer_dtypes refuses
    a job's best layout with them at POST /v1/trainings, not when the ranks are built."""
    r = client.post("/v1/jobs", json=job_body, headers=alice)
    assert r.status_code == 201, r.text
    config = ParallelConfig.parse("cp2 ep2 mbs1 exp_avg=fp8", world_size=4)
    with app.state.sessions() as s:
        claim_next_job(s, "r1")
        t = start_trial(s, r.json()["id"], 0, config.to_dict(), runner_id="r1", label=config.label())
        finish_trial(s, t.id, "succeeded", measurement={"step_time_s": 0.3}, step_time_s=0.3)
    from_job = {k: body[k] for k in ("data_path", "steps", "checkpoint_dir")}
    refused = client.post("/v1/trainings", json={**from_job, "job_id": r.json()["id"]}, headers=alice)
    assert refused.status_code == 422 and ("body.job_id", "executor_optimizer_dtypes") in validation_rules(refused)
    assert "the executor keeps its state in" in refused.text


def test_another_owners_training_is_not_found(client, alice, bob, body):
    tid = client.post("/v1/trainings", json=body, headers=alice).json()["id"]
    for r in (client.get(f"/v1/trainings/{tid}", headers=bob),
              client.get(f"/v1/trainings/{tid}/metrics", headers=bob),
              client.post(f"/v1/trainings/{tid}/cancel", headers=bob)):
        assert r.status_code == 404 and r.json()["type"].endswith(":not-found")
    assert client.get("/v1/trainings", headers=bob).json()["total"] == 0
    assert client.get(f"/v1/trainings/{tid}", headers=alice).json()["status"] == "queued"


def test_metrics_paginate_by_step_and_latest_is_shown(client, app, alice, body):
    tid = client.post("/v1/trainings", json=body, headers=alice).json()["id"]
    with app.state.sessions() as s:
        record_training_metrics(s, tid, [{"step": n, "loss": 10.0 - n, "lr": 1e-3} for n in range(1, 8)])
    seen, after = [], -1
    while after is not None:
        page = client.get(f"/v1/trainings/{tid}/metrics", params={"limit": 3, "after_step": after},
                          headers=alice).json()
        seen += [m["step"] for m in page["items"]]
        after = page["next_after_step"]
    assert seen == list(range(1, 8))
    latest = client.get(f"/v1/trainings/{tid}", headers=alice).json()["latest_metrics"]
    assert (latest["step"], latest["loss"]) == (7, 3.0)


def test_expert_load_of_a_step_and_its_imbalance_per_layer_over_steps(client, app, alice, bob, body):
    tid = client.post("/v1/trainings", json=body, headers=alice).json()["id"]
    missing = client.get(f"/v1/trainings/{tid}/expert-load", headers=alice)
    assert missing.status_code == 404 and missing.json()["type"].endswith(":no-expert-load")  # none stored yet
    per_layer = 64 * 8 * 2  # seq × global batch × top-k of tiny-moe: what each row sums to
    balanced = [per_layer // 8] * 8
    skewed = [per_layer // 2, per_layer // 4] + [per_layer // 24] * 6  # 512 + 256 + 6 × 42 (row sum 1020)
    with app.state.sessions() as s:
        for step in range(1, 6):
            record_expert_load(s, tid, step, [0, 1], [balanced, skewed if step % 2 else balanced])
    latest = client.get(f"/v1/trainings/{tid}/expert-load", headers=alice).json()
    assert (latest["step"], latest["layers"], latest["moe_layers"], latest["num_experts"]) == (5, [0, 1], 2, 8)
    assert latest["tokens"] == [balanced, skewed] and latest["tokens_per_layer"] == per_layer
    assert latest["max_cells"] == MAX_EXPERT_LOAD_CELLS
    assert latest["max_over_mean"] == [1.0, pytest.approx(512 * 8 / sum(skewed))]
    second = client.get(f"/v1/trainings/{tid}/expert-load", params={"step": 2}, headers=alice).json()
    assert second["step"] == 2 and second["tokens"] == [balanced, balanced]
    assert client.get(f"/v1/trainings/{tid}/expert-load", params={"step": 9}, headers=alice).status_code == 404
    assert client.get(f"/v1/trainings/{tid}/expert-load", params={"step": 0}, headers=alice).status_code == 422
    seen, after = [], -1
    while after is not None:
        page = client.get(f"/v1/trainings/{tid}/expert-load/imbalance", params={"limit": 2, "after_step": after},
                          headers=alice).json()
        seen += page["items"]
        after = page["next_after_step"]
    assert [i["step"] for i in seen] == [1, 2, 3, 4, 5] and all(i["layers"] == [0, 1] for i in seen)
    assert [i["max_over_mean"][1] > 1.5 for i in seen] == [True, False, True, False, True]
    assert all(i["max_over_mean"][0] == 1.0 for i in seen)
    for path in (f"/v1/trainings/{tid}/expert-load", f"/v1/trainings/{tid}/expert-load/imbalance"):
        other = client.get(path, headers=bob)  # another owner's reads as missing
        assert other.status_code == 404 and other.json()["type"].endswith(":not-found")
        assert client.get(path).status_code == 401


def test_cancel_queued_then_finished_is_409(client, app, alice, body):
    tid = client.post("/v1/trainings", json=body, headers=alice).json()["id"]
    r = client.post(f"/v1/trainings/{tid}/cancel", headers=alice)
    assert r.status_code == 200 and r.json()["status"] == "cancelled" and r.json()["finished_at"]
    assert client.post(f"/v1/trainings/{tid}/cancel", headers=alice).json()["status"] == "cancelled"
    other = client.post("/v1/trainings", json=body, headers=alice).json()["id"]
    with app.state.sessions() as s:
        assert claim_next_training(s, "r1").id == other
        assert finish_training(s, other, "r1", "succeeded")
    r = client.post(f"/v1/trainings/{other}/cancel", headers=alice)
    assert r.status_code == 409 and r.json()["type"].endswith(":training-finished")
