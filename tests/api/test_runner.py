"""A job submitted over HTTP runs real trials through Ray (CPU ranks, gloo) and its best is served by
GET /v1/best; on SQLite and on PostgreSQL (the ``db_url`` fixture)."""

from __future__ import annotations

import copy

import optuna
import pytest
from runner_env import TINY_JOB, make_runner, session_ray, submit_and_run, wait_no_rank_actors

from db.optuna_storage import optuna_storage_url

pytestmark = pytest.mark.slow
TRIALS = 3


def test_http_job_runs_its_trials_through_ray_and_best_is_served(client, alice, db_url):
    session_ray()
    # Three trials: the first starts the rank actors, the two after it reuse them and compete for the best.
    body = copy.deepcopy(TINY_JOB)
    body["budget"]["max_trials"] = TRIALS
    job = submit_and_run(client, body, alice, db_url)
    job_id = job["id"]
    assert job["status"] == "succeeded", job["error"]
    assert job["trials"]["total"] == TRIALS and job["trials"]["running"] == 0
    trials = client.get(f"/v1/jobs/{job_id}/trials", headers=alice, params={"limit": 50}).json()["items"]
    assert sorted(t["number"] for t in trials) == list(range(TRIALS))
    assert len({t["label"] for t in trials}) == TRIALS  # no layout measured twice
    done = [t for t in trials if t["status"] == "succeeded"]
    assert done, [t["failure_reason"] for t in trials]
    for t in done:  # real measurements of the real training step, with the prediction beside them
        m = t["measurement"]
        assert m["ok"] and m["world_size"] == 2 and len(m["step_times"]) == 1 and m["losses"][0] > 0
        assert t["step_time_s"] == pytest.approx(m["step_time"]) and t["predicted"]["step_time_s"] > 0
        assert m["fixed_cost_s"] >= m["startup_s"] >= 0 and m["warmup_s"] >= 0
    # the rank actors of the first trial ran the later ones (executor.rank_pool; the first starts them)
    by_number = sorted(done, key=lambda t: t["number"])
    assert not by_number[0]["measurement"]["reused_ranks"]
    assert any(t["measurement"]["reused_ranks"] for t in by_number[1:])
    fastest = min(done, key=lambda t: t["step_time_s"])

    best = client.get("/v1/best", headers=alice, params={"signature": job["signature"]})
    assert best.status_code == 200, best.text
    assert best.json()["trial"]["id"] == fastest["id"]
    assert best.json()["trial"]["config"] == fastest["config"]
    assert job["best_trial"]["id"] == fastest["id"]

    result = job["calibration"]
    assert result["best_layout"] == fastest["label"]
    assert len(result["measured_vs_predicted"]) == TRIALS and result["num_observations"] >= len(done)
    fixed = result["fixed_cost"]
    assert fixed["trials"] >= len(done) and fixed["first_s"] > 0 and fixed["total_s"] >= fixed["first_s"]
    # The Optuna study lives apart from the service tables and holds the same trials.
    study = optuna.load_study(study_name=f"job-{job_id}", storage=optuna_storage_url(db_url))
    assert len(study.trials) == TRIALS
    assert wait_no_rank_actors() == []


@pytest.mark.parametrize("db_kind", ["sqlite"], indirect=True)
def test_cancel_stops_the_running_trial_and_the_job(client, alice, db_url):
    import threading
    import time

    session_ray()
    body = copy.deepcopy(TINY_JOB)
    job_id = client.post("/v1/jobs", json=body, headers=alice).json()["id"]
    # Many timed steps: the trial is still running when the cancel arrives, and must stop early.
    runner = make_runner(db_url, timed_steps=200, timeout_s=300.0)
    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.append(runner.run(once=True)), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 180
        while client.get(f"/v1/jobs/{job_id}", headers=alice).json()["trials"]["running"] == 0:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.2)
        time.sleep(3)  # let it measure a few steps
        cancelled_at = time.monotonic()
        assert client.post(f"/v1/jobs/{job_id}/cancel", headers=alice).status_code == 200
        thread.join(120)
        assert not thread.is_alive() and outcome == [1]
        assert time.monotonic() - cancelled_at < 60  # not the 200 steps
    finally:
        runner.stop()
        thread.join(30)
        runner.close()
    job = client.get(f"/v1/jobs/{job_id}", headers=alice).json()
    assert job["status"] == "cancelled" and job["trials"]["total"] == 1
    trial = client.get(f"/v1/jobs/{job_id}/trials", headers=alice).json()["items"][0]
    assert (trial["status"], trial["failure_kind"]) == ("failed", "cancelled")
    assert wait_no_rank_actors() == []
