"""Predicted vs measured step time of a training: a job-derived training carries its best trial's prediction,
an explicit layout the cost model's on the cluster's profile; GET /v1/trainings/{id} adds the median measured
step and the error, every metrics row carries the prediction and its error, and `foldtune trainings ID`
(and `--wait`) print them."""

import pytest
from test_trainings import _give_best, body  # noqa: F401 (body is a fixture used here)

from api.cli.main import main
from spec.catalog import get_hardware, get_model
from spec.hardware import ClusterSpec
from spec.parallel_config import ParallelConfig
from costmodel.step_time import estimate_step_time
from spec.training_spec import TrainingSpec
from db.queue import claim_next_training, finish_training
from db.trainings import record_training_metrics

STEP_TIMES = [0.9, 0.5, 0.4, 0.5, 0.6]  # seconds; median 0.5 (the slow first step does not move it)
PREDICTED = 0.25  # the best trial's prediction (_give_best)


def test_explicit_layout_is_predicted_by_the_cost_model(client, alice, body):  # noqa: F811
    t = client.post("/v1/trainings", json=body, headers=alice).json()
    config = ParallelConfig.parse(body["layout"], world_size=2)
    expected = estimate_step_time(get_model("tiny-moe"), TrainingSpec.from_dict(t["training"]),
                                  ClusterSpec(hardware=get_hardware("cpu"), num_gpus=2), config).step_time
    assert expected > 0 and t["predicted_step_time_s"] == pytest.approx(expected)
    shown = client.get(f"/v1/trainings/{t['id']}", headers=alice).json()
    assert (shown["measured_step_time_s"], shown["step_time_error"]) == (None, None)  # no step stored yet


def test_job_training_shows_predicted_vs_measured(client, app, alice, keys, server_url, body, job_body,  # noqa: F811
                                                  capsys):
    job_id = client.post("/v1/jobs", json=job_body, headers=alice).json()["id"]
    _give_best(app, job_id)
    from_job = {k: body[k] for k in ("data_path", "steps", "checkpoint_dir")}
    tid = client.post("/v1/trainings", json={**from_job, "job_id": job_id}, headers=alice).json()["id"]
    with app.state.sessions() as s:
        assert claim_next_training(s, "r1").id == tid
        record_training_metrics(s, tid, [{"step": n, "loss": 5.0 - 0.1 * n, "step_time_s": st}
                                         for n, st in enumerate(STEP_TIMES, 1)])
        assert finish_training(s, tid, "r1", "succeeded")

    t = client.get(f"/v1/trainings/{tid}", headers=alice).json()
    assert t["predicted_step_time_s"] == pytest.approx(PREDICTED)
    assert t["measured_step_time_s"] == pytest.approx(0.5)
    assert t["step_time_error"] == pytest.approx((PREDICTED - 0.5) / 0.5)
    assert t["latest_metrics"]["predicted_step_time_s"] == pytest.approx(PREDICTED)
    assert t["latest_metrics"]["step_time_error"] == pytest.approx((PREDICTED - 0.6) / 0.6)
    items = client.get(f"/v1/trainings/{tid}/metrics", headers=alice).json()["items"]
    assert [m["step_time_error"] for m in items] == pytest.approx([(PREDICTED - st) / st for st in STEP_TIMES])
    assert all(m["predicted_step_time_s"] == pytest.approx(PREDICTED) for m in items)
    listed = client.get("/v1/trainings", headers=alice).json()["items"][0]
    assert listed["id"] == tid and listed["measured_step_time_s"] is None  # only the single view scans the series

    cli = ["--url", server_url, "--api-key", keys["alice"]]
    capsys.readouterr()
    assert main(["trainings", str(tid), *cli]) == 0
    out = capsys.readouterr().out
    assert f"best layout of tuning job {job_id}" in out
    assert "step time: predicted 0.25 s, measured 0.5 s (median of stored steps), error -50%" in out
    assert main(["trainings", str(tid), "--wait", *cli]) == 0
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(steps) == len(STEP_TIMES)
    assert steps[0].endswith("0.9 s  predicted 0.25 s (-72%)") and steps[2].endswith("predicted 0.25 s (-38%)")
