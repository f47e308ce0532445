"""The multi-user limits of the HTTP service, each with its setting (docs/service.md, "Limits"): request body
size (413, also for a chunked body, answered before the body ends), request rate per API key and per
client address (429 with Retry-After), per-owner quotas (403 naming the quota), the paged hardware-profile
list, ``Location`` from the configured public URL, 405 answers with their ``Allow`` header, and the planning
each request may do (503 past its time limit or with every planning slot busy)."""

import copy
import socket

import pytest
from service_env import UNLIMITED_RATE, auth, live_server
from fastapi.testclient import TestClient

from api.http.app import create_app
from api.http.settings import ApiSettings
from api.service.quotas import Quotas
from db.keys import create_api_key
from spec.errors import SpecError
from test_catalog import H


@pytest.fixture
def make_client(db_url, data_root):
    """make_client(**settings) -> (TestClient, {'alice': headers, 'bob': headers}) of an app with those settings."""
    made = []

    def make(**settings):
        app = create_app(ApiSettings(database_url=db_url, data_root=data_root, **{**UNLIMITED_RATE, **settings}))
        client = TestClient(app)
        client.__enter__()
        made.append((app, client))
        with app.state.sessions() as session:
            heads = {name: auth(create_api_key(session, name)[1]) for name in ("alice", "bob")}
        return client, heads

    yield make
    for app, client in made:
        client.__exit__(None, None, None)
        app.state.engine.dispose()


def test_a_body_over_the_limit_is_refused_by_its_declared_length(make_client, job_body):
    client, heads = make_client(max_body_bytes=2000)
    assert client.post("/v1/jobs", json=job_body, headers=heads["alice"]).status_code == 201
    big = {**job_body, "budget": {**job_body["budget"], "padding": "x" * 3000}}
    r = client.post("/v1/jobs", json=big, headers=heads["alice"])
    assert r.status_code == 413 and r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["type"].endswith(":too-large") and "2000" in r.json()["detail"]


def test_a_chunked_body_over_the_limit_is_refused_before_it_ends(db_url, data_root):
    """Over a real socket: chunks without Content-Length; the 413 comes while the body is still open."""
    app = create_app(ApiSettings(database_url=db_url, data_root=data_root, max_body_bytes=1000, **UNLIMITED_RATE))
    try:
        with live_server(app) as url:
            host, port = url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=20) as sock:
                sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                chunk = b"[" + b"1," * 400 + b"1"  # 802 bytes, then 802 more: over the limit, never terminated
                for _ in range(2):
                    sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                answer = b""
                while b"\r\n\r\n" not in answer:
                    data = sock.recv(4096)
                    assert data, "the server closed the connection without answering"
                    answer += data
            assert answer.startswith(b"HTTP/1.1 413")
    finally:
        app.state.engine.dispose()


def test_rate_limit_per_key_and_per_address(make_client):
    client, heads = make_client(rate_per_s=0.001, rate_burst=3)  # 3 at once, then one per 1000 s
    for _ in range(3):
        assert client.get("/v1/jobs", headers=heads["alice"]).status_code == 200
    r = client.get("/v1/jobs", headers=heads["alice"])
    assert r.status_code == 429 and r.json()["type"].endswith(":too-many-requests")
    assert 900 <= int(r.headers["Retry-After"]) <= 1000
    assert client.get("/v1/jobs", headers=heads["bob"]).status_code == 200  # another key has its own bucket
    # missing and unknown keys share one bucket per client address
    answers = [client.get("/v1/jobs", headers=h).status_code for h in ({}, auth("ft_wrong"), {}, auth("ft_x"))]
    assert answers == [401, 401, 401, 429]
    assert client.get("/v1/jobs", headers=heads["bob"]).status_code == 200  # a good key from there still works


def test_quotas_per_owner(make_client, job_body, training_body):
    client, heads = make_client(quotas=Quotas(active_jobs=1, active_trainings=1, trials_per_job=6, profiles=1,
                                              profile_bytes=2000))
    alice, bob = heads["alice"], heads["bob"]

    def quota(r):
        assert r.status_code == 403, r.text
        return {(e["loc"], e["rule"]) for e in r.json()["errors"]}

    many = copy.deepcopy(job_body)
    many["budget"]["max_trials"] = 7
    assert quota(client.post("/v1/jobs", json=many, headers=alice)) == {("body.budget.max_trials",
                                                                         "quota_trials_per_job")}
    first = client.post("/v1/jobs", json=job_body, headers={**alice, "Idempotency-Key": "k1"})
    assert first.status_code == 201
    assert quota(client.post("/v1/jobs", json=job_body, headers=alice)) == {("body", "quota_active_jobs")}
    assert client.post("/v1/jobs", json=job_body, headers={**alice, "Idempotency-Key": "k1"}).status_code == 200
    assert client.post("/v1/jobs", json=job_body, headers=bob).status_code == 201  # per owner
    client.post(f"/v1/jobs/{first.json()['id']}/cancel", headers=alice)
    assert client.post("/v1/jobs", json=job_body, headers=alice).status_code == 201  # a place came free

    assert client.post("/v1/trainings", json=training_body, headers=alice).status_code == 201
    assert quota(client.post("/v1/trainings", json=training_body, headers=alice)) == {("body",
                                                                                       "quota_active_trainings")}

    assert quota(client.post("/v1/hardware-profiles", json={**H, "gemm_efficiency": [[1e9, 0.5]] * 200},
                             headers=alice)) == {("body", "quota_profile_bytes")}
    assert client.post("/v1/hardware-profiles", json=H, headers=alice).status_code == 201
    assert quota(client.post("/v1/hardware-profiles", json={**H, "name": "other"}, headers=alice)) == {
        ("body", "quota_profiles")}


def test_the_profile_list_is_paged(make_client):
    client, heads = make_client()
    for name in ("p-a", "p-b", "p-c"):
        assert client.post("/v1/hardware-profiles", json={**H, "name": name}, headers=heads["alice"]).status_code == 201
    everything = client.get("/v1/hardware-profiles", params={"limit": 50}, headers=heads["bob"]).json()
    total = everything["total"]
    assert [p["name"] for p in everything["items"][:3]] == ["p-a", "p-b", "p-c"] and total == len(everything["items"])
    seen, offset = [], 0
    while offset is not None:
        page = client.get("/v1/hardware-profiles", params={"limit": 2, "offset": offset}, headers=heads["bob"]).json()
        assert len(page["items"]) <= 2 and page["total"] == total
        seen += [p["name"] for p in page["items"]]
        offset = page["next_offset"]
    assert seen == [p["name"] for p in everything["items"]]
    assert client.get("/v1/hardware-profiles", params={"limit": 51}, headers=heads["bob"]).status_code == 422


def test_location_comes_from_the_public_url_not_the_host_header(make_client, job_body, training_body):
    client, heads = make_client(public_url="https://foldtune.example.org/api/")
    evil = {**heads["alice"], "Host": "evil.example"}
    job = client.post("/v1/jobs", json=job_body, headers=evil)
    assert job.headers["Location"] == f"https://foldtune.example.org/api/v1/jobs/{job.json()['id']}"
    profile = client.post("/v1/hardware-profiles", json=H, headers=evil)
    assert profile.headers["Location"] == "https://foldtune.example.org/api/v1/hardware-profiles/my-gpu"
    training = client.post("/v1/trainings", json=training_body, headers=evil)
    assert training.headers["Location"] == f"https://foldtune.example.org/api/v1/trainings/{training.json()['id']}"


def test_settings_come_from_the_environment():
    s = ApiSettings.from_env("sqlite://", {"FOLDTUNE_DATA_ROOT": "/srv/ft", "FOLDTUNE_PUBLIC_URL": "https://x.org",
                                           "FOLDTUNE_MAX_BODY_BYTES": "5", "FOLDTUNE_RATE_LIMIT_PER_S": "2",
                                           "FOLDTUNE_RATE_LIMIT_BURST": "4", "FOLDTUNE_QUOTA_PROFILES": "3"})
    assert (str(s.data_root), s.base_url, s.max_body_bytes, s.rate_per_s, s.rate_burst) == (
        "/srv/ft", "https://x.org", 5, 2.0, 4)
    assert s.quotas == Quotas(profiles=3)
    s = ApiSettings.from_env("sqlite://", {"FOLDTUNE_PLAN_SECONDS": "7.5", "FOLDTUNE_PLAN_CONCURRENCY": "3",
                                           "FOLDTUNE_TRUSTED_PROXIES": "10.0.0.5, 172.18.0.0/16",
                                           "FOLDTUNE_SHUTDOWN_SECONDS": "4"})
    assert (s.plan_seconds, s.plan_concurrency, s.trusted_proxies, s.shutdown_seconds) == (
        7.5, 3, ("10.0.0.5", "172.18.0.0/16"), 4.0)
    assert ApiSettings.from_env("sqlite://", {}).trusted_proxies == ()  # none trusted by default
    for bad in ({"FOLDTUNE_TRUSTED_PROXIES": "proxy.example"}, {"FOLDTUNE_PLAN_SECONDS": "0"},
                {"FOLDTUNE_PLAN_CONCURRENCY": "0"}, {"FOLDTUNE_SHUTDOWN_SECONDS": "-1"}):
        with pytest.raises(SpecError):
            ApiSettings.from_env("sqlite://", bad)
    default = ApiSettings.from_env("sqlite://", {"FOLDTUNE_DATA_DIR": "/var/ft", "FOLDTUNE_PORT": "9000"})
    assert (str(default.data_root), default.base_url) == ("/var/ft/users", "http://127.0.0.1:9000")


def test_405_names_the_allowed_methods(client, alice):
    for method, path, allow in [("DELETE", "/v1/jobs", "GET, POST"), ("PUT", "/v1/jobs/1", "GET"),
                                ("GET", "/v1/jobs/1/cancel", "POST"), ("POST", "/v1/hardware-profiles/x", "GET"),
                                ("POST", "/healthz", "GET"), ("PATCH", "/v1/trainings", "GET, POST")]:
        r = client.request(method, path, headers=alice)
        assert r.status_code == 405 and r.headers["Allow"] == allow, (method, path, r.headers.get("Allow"))
        assert allow in r.json()["detail"]


PLAN = {"model": "tiny-moe", "training": {"seq_length": 64, "global_batch_size": 8}, "cluster": {"gpu": "cpu",
                                                                                                 "num_gpus": 4}}


def test_planning_past_its_time_limit_is_answered_503_with_the_reason(make_client, job_body):
    client, heads = make_client(plan_seconds=1e-9)  # spent before the planner looks at its first layout
    for path, body in (("/v1/plans", PLAN), ("/v1/jobs", job_body)):
        r = client.post(path, json=body, headers=heads["alice"])
        assert r.status_code == 503 and r.json()["type"].endswith(":planning-timeout"), r.text
        assert "1e-09 s limit" in r.json()["detail"] and "FOLDTUNE_PLAN_SECONDS" in r.json()["detail"]
        assert int(r.headers["Retry-After"]) >= 1
    assert client.get("/v1/jobs", headers=heads["alice"]).json()["total"] == 0  # nothing stored


def test_planning_with_every_slot_busy_is_answered_503(make_client):
    client, heads = make_client(plan_concurrency=1, plan_seconds=0.5)  # a request waits 0.5 s for a slot
    gate = client.app.state.planning
    with gate():  # another request holds the only slot
        r = client.post("/v1/plans", json=PLAN, headers=heads["alice"])
    assert r.status_code == 503 and r.json()["type"].endswith(":planner-busy") and "Retry-After" in r.headers
    with gate():  # the slot came free again
        pass
