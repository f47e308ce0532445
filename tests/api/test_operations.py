"""/healthz and the Prometheus /metrics exposition."""

import re

from sqlalchemy import text

from db.migrate import head_revision


def test_health_reports_database_and_revision(client):
    body = client.get("/healthz").json()
    assert body["status"] == "ok" and body["revision"] == head_revision() == "0008"


def test_health_is_503_when_the_database_is_not_migrated(client, app):
    with app.state.engine.begin() as conn:
        conn.execute(text("DELETE FROM foldtune_alembic_version"))
    r = client.get("/healthz")
    assert r.status_code == 503 and r.json()["type"].endswith(":database-not-migrated")


def test_metrics_count_requests_and_jobs(client, alice, job_body):
    client.post("/v1/jobs", json=job_body, headers=alice)
    client.post("/v1/jobs", json=job_body, headers=alice)
    client.get("/v1/jobs/424242", headers=alice)
    client.get("/v1/jobs")  # 401
    r = client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    text_ = r.text
    assert 'foldtune_http_requests_total{method="POST",route="/v1/jobs",status="201"} 2.0' in text_
    assert 'foldtune_http_requests_total{method="GET",route="/v1/jobs/{job_id}",status="404"} 1.0' in text_
    assert 'foldtune_http_requests_total{method="GET",route="/v1/jobs",status="401"} 1.0' in text_
    assert 'foldtune_http_request_duration_seconds_count{method="POST",route="/v1/jobs"} 2.0' in text_
    assert "foldtune_jobs_submitted_total 2.0" in text_
    assert 'foldtune_jobs{status="queued"} 2.0' in text_ and 'foldtune_jobs{status="running"} 0.0' in text_
    assert 'foldtune_queue_depth{kind="job"} 2.0' in text_ and 'foldtune_queue_depth{kind="training"} 0.0' in text_
    sample = re.compile(r'^[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? [0-9.e+-]+$')
    for line in text_.splitlines():
        assert line.startswith("# ") or sample.match(line), line
