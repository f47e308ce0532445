"""POST /v1/jobs with search_precision: the flag is accepted, stored with the training spec (so such a job has
its own signature), read back by the runner, and a bad value is a 422 naming the rule."""

from __future__ import annotations

from problem_rules import validation_rules

from api.worker.runner import job_searches_precision, job_specs, study_attributes
from db.models import Job
from db.queue import claim_next_job
from db.trials import finish_trial, start_trial
from spec.parallel_config import ParallelConfig


def test_a_job_searching_precision_is_stored_with_the_flag(client, alice, job_body, app):
    plain = client.post("/v1/jobs", json=job_body, headers=alice).json()
    r = client.post("/v1/jobs", json={**job_body, "search_precision": True}, headers=alice)
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["training"]["search_precision"] is True and "search_precision" not in plain["training"]
    assert job["signature"] != plain["signature"]  # its best may be fp8: not the answer to the plain question
    with app.state.sessions() as s:
        row, plain_row = s.get(Job, job["id"]), s.get(Job, plain["id"])
        model, training, cluster = job_specs(row)  # the flag is not a TrainingSpec field
        assert training.precision == "fp32" and job_searches_precision(row)  # cpu's default (spec/shape_defaults)
        assert not job_searches_precision(plain_row)
        assert study_attributes(row, model, training, cluster)["search_precision"] is True


def test_search_precision_must_be_a_boolean(client, alice, job_body):
    r = client.post("/v1/jobs", json={**job_body, "search_precision": "fp8"}, headers=alice)
    assert ("body.search_precision", "bool_parsing") in validation_rules(r)


def test_an_fp8_best_is_served_and_exported_at_fp8(client, alice, job_body, app):
    body = {**job_body, "cluster": {"gpu": "h100-sxm", "num_gpus": 4}, "search_precision": True,
            "moe_aux_loss_coeff": 0.02}  # router options ride in the same stored training spec
    r = client.post("/v1/jobs", json=body, headers=alice)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    config = ParallelConfig(world_size=4, ep=4)
    with app.state.sessions() as s:
        claim_next_job(s, "r")
        for number, precision, seconds in ((0, "bf16", 0.3), (1, "fp8", 0.2)):
            t = start_trial(s, job_id, number, config.to_dict(), runner_id="r",
                            label=f"{config.label()} precision={precision}", predicted={"precision": precision})
            finish_trial(s, t.id, "succeeded", measurement={"precision": precision}, step_time_s=seconds)
    job = client.get(f"/v1/jobs/{job_id}", headers=alice).json()
    assert job["best_trial"]["precision"] == "fp8" and job["best_trial"]["label"].endswith("precision=fp8")
    trials = client.get(f"/v1/jobs/{job_id}/trials", headers=alice).json()["items"]
    assert [t["precision"] for t in trials] == ["bf16", "fp8"]
    args = client.get(f"/v1/jobs/{job_id}/megatron-args", headers=alice)
    assert args.status_code == 200, args.text
    flags = [a[0] for a in args.json()["args"]]
    assert "--fp8-format" in flags and args.json()["layout"].endswith("precision=fp8")


def test_a_training_from_a_precision_search_best_is_accepted(client, alice, job_body, training_body, app):
    job_id = client.post("/v1/jobs", json={**job_body, "search_precision": True}, headers=alice).json()["id"]
    config = ParallelConfig(world_size=4, ep=4)
    with app.state.sessions() as s:
        claim_next_job(s, "r")
        t = start_trial(s, job_id, 0, config.to_dict(), runner_id="r", label=f"{config.label()} precision=bf16",
                        predicted={"precision": "bf16"})
        finish_trial(s, t.id, "succeeded", measurement={"precision": "bf16"}, step_time_s=0.3)
    from_job = {k: training_body[k] for k in ("data_path", "steps", "checkpoint_dir")}
    r = client.post("/v1/trainings", json={**from_job, "job_id": job_id}, headers=alice)
    assert r.status_code == 201, r.text  # the stored flag is not taken for a training field
    assert "search_precision" not in r.json()["training"] and r.json()["config"] == config.to_dict()
