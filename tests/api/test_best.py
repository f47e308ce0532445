"""GET /best: the fastest succeeded trial of a signature over the caller's jobs, else a 404 problem."""

from db.queue import claim_next_job
from db.trials import finish_trial, start_trial

QUERY = {"model": "tiny-moe", "gpu": "cpu", "num_gpus": 4, "seq_length": 64, "global_batch_size": 8}


def _run(app, job_id, runner, results):
    """Record trials as a runner would: results are step times (s), or None for an OOM."""
    with app.state.sessions() as s:
        assert claim_next_job(s, runner).id == job_id
        for n, step_time in enumerate(results):
            t = start_trial(s, job_id, n, {"tp": 1, "ep": 2 ** n}, runner_id=runner, label=f"ep{2 ** n}")
            if step_time is None:
                finish_trial(s, t.id, "failed", failure_kind="oom", failure_reason="out of memory")
            else:
                finish_trial(s, t.id, "succeeded", measurement={"step_time_s": step_time}, step_time_s=step_time)


def test_best_is_404_until_a_trial_succeeds(client, alice, job_body, app):
    r = client.get("/v1/best", params=QUERY, headers=alice)
    assert r.status_code == 404 and r.json()["type"].endswith(":no-best")
    job_id = client.post("/v1/jobs", json=job_body, headers=alice).json()["id"]
    _run(app, job_id, "r1", [None])
    assert client.get("/v1/best", params=QUERY, headers=alice).status_code == 404


def test_best_across_jobs_by_spec_and_by_signature(client, alice, bob, job_body, app):
    first = client.post("/v1/jobs", json=job_body, headers=alice).json()
    second = client.post("/v1/jobs", json=job_body, headers=alice).json()
    job_body["training"]["global_batch_size"] = 16  # another question: must not count
    other = client.post("/v1/jobs", json=job_body, headers=alice).json()
    _run(app, first["id"], "r1", [0.5, 0.4])
    _run(app, second["id"], "r2", [0.45, 0.25, None])
    _run(app, other["id"], "r3", [0.01])
    best = client.get("/v1/best", params=QUERY, headers=alice).json()
    assert best["job_id"] == second["id"] and best["trial"]["number"] == 1
    assert best["trial"]["step_time_s"] == 0.25 and best["trial"]["label"] == "ep2"
    assert best["jobs_considered"] == 2 and best["signature"] == first["signature"]
    by_signature = client.get("/v1/best", params={"signature": first["signature"]}, headers=alice).json()
    assert by_signature == best
    assert client.get("/v1/best", params=QUERY, headers=bob).status_code == 404  # alice's results stay hers


def test_best_needs_a_signature_or_every_spec_field(client, alice):
    r = client.get("/v1/best", params={"model": "tiny-moe", "gpu": "cpu"}, headers=alice)
    assert r.status_code == 422
    (error,) = r.json()["errors"]
    assert error["rule"] == "signature_or_spec" and "num_gpus" in error["message"]
    r = client.get("/v1/best", params={**QUERY, "model": "nope"}, headers=alice)
    assert r.json()["errors"][0]["rule"] == "known_model"
    r = client.get("/v1/best", params={"signature": "xyz"}, headers=alice)
    assert r.json()["errors"][0]["rule"] == "string_pattern_mismatch"
