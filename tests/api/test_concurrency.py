"""50 clients submitting at once through a real uvicorn server: each job stored exactly once."""

import threading

import httpx
from sqlalchemy import func, select

from db.models import Job

N = 50


def _hammer(server_url, headers, bodies, idempotency_keys):
    """POST every body from its own thread, all released together; returns (status, id) per thread."""
    results = [None] * len(bodies)
    barrier = threading.Barrier(len(bodies))

    def submit(i):
        with httpx.Client(base_url=server_url, timeout=60) as http:
            h = dict(headers)
            if idempotency_keys[i]:
                h["Idempotency-Key"] = idempotency_keys[i]
            barrier.wait()
            r = http.post("/v1/jobs", json=bodies[i], headers=h)
            results[i] = (r.status_code, r.json().get("id"))

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def test_concurrent_submissions_are_each_stored_once(server_url, alice, job_body, app):
    bodies = []
    for i in range(N):
        body = {**job_body, "budget": {"max_trials": i + 1, "max_seconds": 600}}
        bodies.append(body)
    results = _hammer(server_url, alice, bodies, [None] * N)
    assert all(status == 201 for status, _ in results), results
    ids = [job_id for _, job_id in results]
    assert len(set(ids)) == N
    with app.state.sessions() as s:
        rows = s.execute(select(Job.id, Job.max_trials)).all()
    assert len(rows) == N
    # each stored row is the one its request asked for (no lost or crossed writes)
    assert {job_id: i + 1 for i, job_id in enumerate(ids)} == dict(rows)


def test_concurrent_retries_with_one_idempotency_key_store_one_job(server_url, alice, job_body, app):
    keys = ["same-key"] * 20 + [f"key-{i}" for i in range(10)]
    results = _hammer(server_url, alice, [job_body] * len(keys), keys)
    same = {job_id for (_, job_id), key in zip(results, keys) if key == "same-key"}
    assert len(same) == 1, results
    assert sorted(status for status, _ in results).count(201) == 11  # one per distinct key
    with app.state.sessions() as s:
        assert s.scalar(select(func.count()).select_from(Job)) == 11
