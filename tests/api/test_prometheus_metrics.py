"""/metrics through prometheus_client: bounded labels (route templates, a fixed method set), request latency,
trials and trainings by state, runner heartbeats and training step times from the database."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from db.models import TrainingMetric
from db.queue import claim_next_job
from db.trials import start_trial


def _series(client) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted label items: value}} of one scrape."""
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_invented_methods_and_paths_create_no_new_series(client, alice):
    client.get("/v1/jobs", headers=alice)
    before = _series(client)
    for i in range(20):
        client.request(f"BREW{i}", "/v1/jobs", headers=alice)  # invented methods on a known route
        client.get(f"/v1/no-such-{i}/x{i}")  # invented paths
        client.get(f"/v1/jobs/{1000 + i}", headers=alice)  # one template, many ids
    after = _series(client)
    labels = {k for name in ("foldtune_http_requests_total", "foldtune_http_request_duration_seconds_count")
              for key in after[name] for k in key}
    methods = {v for k, v in labels if k == "method"}
    routes = {v for k, v in labels if k == "route"}
    assert methods <= {"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "other"} and "other" in methods
    assert routes <= {"/v1/jobs", "/v1/jobs/{job_id}", "/metrics", "unmatched"}, routes
    # 20 invented methods, 20 invented paths and 20 ids added at most a handful of series, not 60
    assert len(after["foldtune_http_requests_total"]) - len(before["foldtune_http_requests_total"]) <= 4
    other = sum(v for k, v in after["foldtune_http_requests_total"].items() if ("method", "other") in k)
    assert other == 20


def test_trials_trainings_heartbeats_and_step_times_come_from_the_database(client, app, alice, job_body,
                                                                           training_body):
    assert client.post("/v1/jobs", json=job_body, headers=alice).status_code == 201
    assert client.post("/v1/trainings", json=training_body, headers=alice).status_code == 201
    with app.state.sessions() as s:
        claim_next_job(s, "runner-a")
        start_trial(s, 1, 0, {"tp": 2}, runner_id="runner-a", label="tp2", predicted_step_time_s=0.2)
        s.add_all([TrainingMetric(training_id=1, step=i, step_time_s=t) for i, t in enumerate((0.02, 0.3, 7.0))])
        s.commit()
    series = _series(client)
    assert series["foldtune_trials"][(("status", "running"),)] == 1
    assert series["foldtune_trials"][(("status", "succeeded"),)] == 0
    assert series["foldtune_trainings"][(("status", "queued"),)] == 1
    assert series["foldtune_queue_depth"][(("kind", "training"),)] == 1
    assert series["foldtune_queue_depth"][(("kind", "job"),)] == 0  # claimed
    assert list(series["foldtune_runner_heartbeat_age_seconds"]) == [(("runner", "runner-a"),)]
    assert 0 <= series["foldtune_runner_heartbeat_age_seconds"][(("runner", "runner-a"),)] < 600
    buckets = series["foldtune_training_step_seconds_bucket"]
    assert buckets[(("le", "0.025"),)] == 1 and buckets[(("le", "0.5"),)] == 2 and buckets[(("le", "+Inf"),)] == 3
    assert series["foldtune_training_step_seconds_count"][()] == 3
    assert abs(series["foldtune_training_step_seconds_sum"][()] - 7.32) < 1e-9
