"""POST /plans: the cost model's ranking over HTTP, and its problems."""

PLAN = {"model": "tiny-moe", "training": {"seq_length": 64, "global_batch_size": 8},
        "cluster": {"gpu": "cpu", "num_gpus": 4}, "top": 3}


def test_plan_ranks_fitting_layouts_fastest_first(client, alice):
    r = client.post("/v1/plans", json=PLAN, headers=alice)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "tiny-moe" and body["cluster"] == {"gpu": "cpu", "num_gpus": 4}
    assert body["considered"] >= body["valid"] >= body["fitting"] > 0
    assert 1 <= len(body["ranked"]) <= 3
    times = [e["step_time_s"] for e in body["ranked"]]
    assert times == sorted(times) and all(t > 0 for t in times)
    best = body["ranked"][0]
    assert best["fits"] and best["config"]["world_size"] == 4 and best["layout"]
    assert client.get("/v1/jobs", headers=alice).json()["total"] == 0  # nothing stored


def test_plan_problems(client, alice):
    no_layout = {**PLAN, "training": {"seq_length": 64, "global_batch_size": 7}, "cluster": {"gpu": "cpu",
                                                                                            "num_gpus": 64}}
    r = client.post("/v1/plans", json=no_layout, headers=alice)
    assert r.status_code == 422 and r.json()["errors"][0]["rule"] == "has_valid_layout"
    assert "gbs_mbs_dp" in r.json()["errors"][0]["message"]
    r = client.post("/v1/plans", json={**PLAN, "model": "nope"}, headers=alice)
    assert r.json()["errors"][0]["rule"] == "known_model"
    r = client.post("/v1/plans", json={**PLAN, "top": 0}, headers=alice)
    assert r.json()["errors"][0]["loc"] == "body.top"
    assert client.post("/v1/plans", json=PLAN).status_code == 401
