"""A verify job over HTTP (kind 'verify'): stored with its request, run by a runner (each layout's slice in a
child process on this machine's CPU, no Ray), its report served with the job; on SQLite, and on PostgreSQL in
the whole suite (the ``db_url`` fixture)."""

from __future__ import annotations


import pytest
from problem_rules import validation_rules
from runner_env import submit_and_run

from api.cli.main import main

VERIFY_JOB = {"model": "tiny-moe", "training": {"seq_length": 64, "global_batch_size": 16, "precision": "fp32"},
              "cluster": {"gpu": "cpu", "num_gpus": 4}, "kind": "verify",
              "verify": {"top": 2, "slice_layers": 1, "hot_expert_factor": 2.0}}


def test_a_verify_job_is_stored_queued_with_its_request(client, alice):
    response = client.post("/v1/jobs", json=VERIFY_JOB, headers=alice)
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["status"] == "queued" and job["kind"] == "verify" and job["report"] is None
    assert job["verify"] == {"top": 2, "slice_gpu": "cpu", "slice_layers": 1, "hot_expert_factor": 2.0}
    assert job["budget"]["max_trials"] == 2 and job["trials"]["total"] == 0
    listed = client.get("/v1/jobs", headers=alice).json()["items"]
    assert [(j["id"], j["kind"]) for j in listed] == [(job["id"], "verify")]
    tune = client.post("/v1/jobs", json={k: v for k, v in VERIFY_JOB.items() if k not in ("kind", "verify")},
                       headers=alice).json()
    assert tune["kind"] == "tune" and tune["verify"] is None



@pytest.mark.parametrize("change, loc, rule", [
    ({"kind": "tune"}, "body", "verify_needs_kind"),
    ({"verify": {"top": 0}}, "body.verify.top", "greater_than_equal"),
    ({"verify": {"slice_gpu": "no-such-gpu"}}, "body.verify.slice_gpu", "known_gpu"),
    ({"search_precision": True}, "body", "verify_one_precision"),
])
def test_a_bad_verify_request_is_refused_naming_the_rule(refused, change, loc, rule):
    client, alice, _ = refused
    response = client.post("/v1/jobs", json={**VERIFY_JOB, **change}, headers=alice)
    assert (loc, rule) in validation_rules(response)
    assert client.get("/v1/jobs", headers=alice).json()["total"] == 0  # nothing stored


# the plan, then two slices, each in a child process that imports torch: ~8 s on a quiet 2-core machine
def test_a_runner_runs_a_verify_job_and_the_report_is_served(client, alice, keys, db_url, server_url, capsys):
    job = submit_and_run(client, VERIFY_JOB, alice, db_url)
    assert job["status"] == "succeeded", job["error"]
    report = job["report"]
    assert (report["model"], report["num_gpus"], report["slice_gpu"], report["device"]) == ("tiny-moe", 4, "cpu",
                                                                                          "cpu")
    assert [lay["plan_rank"] for lay in report["layouts"]] == [1, 2]
    for lay in report["layouts"]:
        assert lay["error"] is None and set(lay["scenarios"]) == {"even", "skewed"}
        for check in lay["scenarios"].values():
            assert check["terms"]["gemm"]["measured_s"] > 0 and check["terms"]["gemm"]["predicted_s"] > 0
            assert check["checked_step_s"] > 0
        assert lay["measurement"]["layout"] == lay["layout"]
    for name, labels in report["order"].items():
        steps = [next(lay for lay in report["layouts"] if lay["layout"] == label)["scenarios"][name]["checked_step_s"]
                 for label in labels]
        assert steps == sorted(steps)
    assert job["trials"]["total"] == 0 and job["best_trial"] is None  # a verify job has no trials
    # `foldtune jobs ID` answers with the re-ranking
    assert main(["jobs", str(job["id"]), "--url", server_url, "--api-key", keys["alice"]]) == 0
    out = capsys.readouterr().out
    assert "ranked by checked step, even routing (slices on cpu):" in out
    assert all(label in out for label in report["order"]["skewed"])
