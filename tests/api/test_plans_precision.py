"""POST /plans with search_precision: bf16 and fp8 planned (fp8 only on GPUs with an fp8 peak), the faster returned."""

BODY = {"model": "tiny-moe", "training": {"seq_length": 64, "global_batch_size": 8},
        "cluster": {"gpu": "h100-sxm", "num_gpus": 2}, "top": 2, "vpp_max": 1}


def test_plan_searches_precision_when_asked(client, alice):
    plain = client.post("/v1/plans", json=BODY, headers=alice).json()
    assert plain["precision_search"] is None and plain["training"]["precision"] == "bf16"
    r = client.post("/v1/plans", json={**BODY, "search_precision": True}, headers=alice)
    assert r.status_code == 200, r.text
    out = r.json()
    searched = out["precision_search"]
    assert set(searched) == {"bf16", "fp8"}
    faster = min(searched, key=searched.get)
    assert out["training"]["precision"] == faster
    assert out["ranked"][0]["step_time_s"] == searched[faster]


def test_plan_search_precision_keeps_bf16_without_an_fp8_peak(client, alice):
    body = {**BODY, "cluster": {"gpu": "a100-80gb", "num_gpus": 2}, "search_precision": True}
    out = client.post("/v1/plans", json=body, headers=alice).json()
    assert list(out["precision_search"]) == ["bf16"] and out["training"]["precision"] == "bf16"
