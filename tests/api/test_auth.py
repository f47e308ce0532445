"""API keys: none or unknown -> 401 problem; an owner never sees another owner's jobs."""

import pytest

PROBLEM = "application/problem+json"


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/jobs/1", "/v1/models", "/v1/hardware-profiles", "/v1/best"])
def test_no_key_is_a_401_problem(client, path):
    r = client.get(path)
    assert r.status_code == 401
    assert r.headers["content-type"].startswith(PROBLEM)
    assert r.headers["www-authenticate"].startswith("Bearer")
    body = r.json()
    assert body["status"] == 401 and body["type"].endswith(":unauthorized") and body["instance"] == path


def test_unknown_key_is_401_and_both_headers_work(client, keys):
    assert client.get("/v1/jobs", headers={"Authorization": "Bearer ft_nope"}).status_code == 401
    assert client.get("/v1/jobs", headers={"X-API-Key": "ft_nope"}).status_code == 401
    assert client.get("/v1/jobs", headers={"X-API-Key": keys["alice"]}).status_code == 200
    assert client.get("/v1/jobs", headers={"Authorization": f"Bearer {keys['alice']}"}).status_code == 200


def test_another_owners_job_is_404_everywhere(client, alice, bob, job_body):
    job_id = client.post("/v1/jobs", json=job_body, headers=alice).json()["id"]
    for method, path in [("GET", f"/v1/jobs/{job_id}"), ("POST", f"/v1/jobs/{job_id}/cancel"),
                         ("GET", f"/v1/jobs/{job_id}/trials"), ("GET", f"/v1/jobs/{job_id}/megatron-args")]:
        r = client.request(method, path, headers=bob)
        assert r.status_code == 404, (method, path)
        assert r.headers["content-type"].startswith(PROBLEM)
        assert r.json()["detail"] == f"job {job_id} does not exist"  # same words as a missing job
    assert client.get("/v1/jobs", headers=bob).json()["total"] == 0
    assert client.get(f"/v1/jobs/{job_id}", headers=alice).json()["status"] == "queued"  # not cancelled by bob


def test_health_and_metrics_need_no_key(client):
    assert client.get("/healthz").json()["status"] == "ok"
    assert client.get("/metrics").status_code == 200
