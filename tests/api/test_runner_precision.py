"""A job searching precision on CPU ranks (the 'cpu' profile has no fp8 peak) runs real trials through Ray
at the job's precision and bf16 only, says that fp8 was left out, and names each trial's precision."""

from __future__ import annotations

import copy

import pytest
from runner_env import TINY_JOB, session_ray, submit_and_run, wait_no_rank_actors

pytestmark = pytest.mark.slow


def test_a_cpu_job_searches_its_precision_and_bf16_and_says_fp8_was_dropped(client, alice, db_url):
    session_ray()
    body = {**copy.deepcopy(TINY_JOB), "search_precision": True}
    # two trials: after the first, the other searched precision's best is measured next (planner.search)
    body["budget"]["max_trials"] = 2
    job = submit_and_run(client, body, alice, db_url)
    job_id = job["id"]
    assert job["status"] == "succeeded", job["error"]
    result = job["calibration"]
    assert result["precisions"] == ["fp32", "bf16"] and result["candidates"]["precisions"] == ["fp32", "bf16"]
    assert "fp8 not searched" in result["precision_note"]
    trials = client.get(f"/v1/jobs/{job_id}/trials", headers=alice, params={"limit": 50}).json()["items"]
    assert len(trials) == 2
    for t in trials:
        assert t["precision"] in ("fp32", "bf16") and t["label"].endswith(f" precision={t['precision']}")
        assert t["predicted"]["step_time_s"] > 0  # the estimate found by (layout, precision)
        if t["status"] == "succeeded":  # the executor ran it at that precision
            assert t["measurement"]["precision"] == t["precision"]
    rows = {r["number"]: r for r in result["measured_vs_predicted"]}
    assert all(rows[t["number"]]["precision"] == t["precision"] for t in trials)
    best = job["best_trial"]
    assert result["best_precision"] == best["precision"] and result["best_layout"] == best["label"]
    assert set(result["calibration_by_precision"]) <= {"fp32", "bf16"}
    # each searched precision measured (its best candidate at least), and the gain over bf16 reported, measured
    measured = {t["precision"] for t in trials if t["status"] == "succeeded"}
    assert measured == {"fp32", "bf16"}
    assert set(result["best_by_precision"]) == measured
    bests = result["best_by_precision"]
    assert result["gain_over_bf16"] == {
        "fp32": pytest.approx(bests["bf16"]["step_time_s"] / bests["fp32"]["step_time_s"])}
    assert wait_no_rank_actors() == []
