"""GET /models and the hardware-profile endpoints."""

H = {"name": "my-gpu", "gpu": {"name": "my-gpu", "peak_flops": {"bf16": 5.0e14}, "hbm_bytes": 8.6e10,
                               "hbm_bandwidth": 2.0e12},
     "gpus_per_node": 4, "intra_node_bandwidth": 3.0e11, "intra_node_latency": 5.0e-6,
     "inter_node_bandwidth": 2.5e10, "inter_node_latency": 1.0e-5,
     "gemm_efficiency": [[1e9, 0.4], [1e12, 0.7]], "source": "calibrate"}


def test_models_lists_the_catalog(client, alice):
    items = {m["name"]: m for m in client.get("/v1/models", headers=alice).json()["items"]}
    assert {"tiny-moe", "mixtral-8x7b", "deepseek-v3"} <= set(items)
    assert items["tiny-moe"]["num_experts"] == 8 and items["tiny-moe"]["spec"]["hidden_size"] == 64


def test_builtin_profiles_are_listed_and_fetchable(client, alice):
    names = [p["name"] for p in client.get("/v1/hardware-profiles", headers=alice).json()["items"]]
    assert {"h100-sxm", "cpu"} <= set(names)
    h100 = client.get("/v1/hardware-profiles/h100", headers=alice).json()  # aliases resolve
    assert h100["name"] == "h100-sxm" and h100["builtin"] and h100["profile"]["gpus_per_node"] == 8
    missing = client.get("/v1/hardware-profiles/nope", headers=alice)
    assert missing.status_code == 404 and missing.headers["content-type"].startswith("application/problem+json")


def test_store_a_profile_then_submit_a_job_on_it(client, alice, bob, job_body):
    r = client.post("/v1/hardware-profiles", json=H, headers=alice)
    assert r.status_code == 201, r.text
    assert r.headers["location"].endswith("/v1/hardware-profiles/my-gpu")
    got = client.get("/v1/hardware-profiles/my-gpu", headers=bob).json()  # profiles describe hardware: shared
    assert got["source"] == "calibrate" and not got["builtin"]
    assert got["profile"]["gemm_efficiency"] == [[1e9, 0.4], [1e12, 0.7]]
    assert client.post("/v1/hardware-profiles", json=H, headers=alice).status_code == 409
    assert client.post("/v1/hardware-profiles", json={**H, "name": "cpu"}, headers=alice).status_code == 409
    assert client.post("/v1/hardware-profiles", json={**H, "name": "h100"}, headers=alice).status_code == 409  # alias
    job_body["cluster"] = {"gpu": "my-gpu", "num_gpus": 8}
    job = client.post("/v1/jobs", json=job_body, headers=alice)
    assert job.status_code == 201 and job.json()["cluster"]["gpu"] == "my-gpu"
    job_body["cluster"]["num_gpus"] = 6  # 4 GPUs per node: 6 is not whole nodes
    assert client.post("/v1/jobs", json=job_body, headers=alice).json()["errors"][0]["rule"] == "whole_nodes"


def test_invalid_profile_names_the_rule(client, alice):
    bad_curve = {**H, "gemm_efficiency": [[1e9, -0.5]]}
    r = client.post("/v1/hardware-profiles", json=bad_curve, headers=alice)
    assert r.status_code == 422 and r.json()["errors"][0]["rule"] == "hardware_profile_rules"
    r = client.post("/v1/hardware-profiles", json={**H, "name": "Bad Name"}, headers=alice)
    assert r.status_code == 422 and r.json()["errors"][0]["loc"] == "body.name"
    r = client.post("/v1/hardware-profiles", json={**H, "gpus_per_node": 0}, headers=alice)
    assert r.json()["errors"][0]["rule"] == "greater_than_equal"


def test_a_profile_written_by_foldtune_calibrate_round_trips(client, alice):
    """The file `foldtune calibrate` writes (launch costs, component factors) is accepted as is and used."""
    import json
    from pathlib import Path

    stored = json.loads((Path(__file__).parents[2] / "bench" / "results" /
                         "h200-x4-components-mbs-2026-11-26-4xH200.json").read_text())["profile"]
    body = {**stored, "name": "h200-x4-measured"}
    r = client.post("/v1/hardware-profiles", json=body, headers=alice)
    assert r.status_code == 201, r.text
    got = client.get("/v1/hardware-profiles/h200-x4-measured", headers=alice).json()["profile"]
    assert got["op_launch_s"] == stored["op_launch_s"] and got["moe_layer_host_s"] == stored["moe_layer_host_s"]
    assert got["component_factors"] == stored["component_factors"]
    bad = {**body, "name": "bad-factors", "component_factors": {"mixtral-8x7b@seq4096": {"gemm": -1.0}}}
    r = client.post("/v1/hardware-profiles", json=bad, headers=alice)
    assert r.status_code == 422 and "component_factors" in r.json()["errors"][0]["loc"]


def test_a_profile_with_attention_curves_and_sustained_clock_round_trips(client, alice):
    """Session 4's calibrate output (attention curves, sustained clock) is accepted and kept; older files too."""
    import json
    from pathlib import Path

    stored = json.loads((Path(__file__).parents[2] / "bench" / "results" / "gpu-2026-11-26-4xH200-s4" /
                         "h200-x4-components.json").read_text())["profile"]
    assert stored["sustained_clock_factor"] and stored["attention_fwd_efficiency"]
    r = client.post("/v1/hardware-profiles", json={**stored, "name": "h200-x4-s4"}, headers=alice)
    assert r.status_code == 201, r.text
    got = client.get("/v1/hardware-profiles/h200-x4-s4", headers=alice).json()["profile"]
    assert got["sustained_clock_factor"] == stored["sustained_clock_factor"]
    for key in ("attention_fwd_efficiency", "attention_bwd_efficiency"):
        assert got[key] == stored[key]
    r = client.post("/v1/hardware-profiles", json={**stored, "name": "bad-clock", "sustained_clock_factor": 1.5},
                    headers=alice)
    assert r.status_code == 422 and "sustained_clock_factor" in r.json()["errors"][0]["loc"]


def test_a_profile_with_a_gemm_backward_curve_round_trips_and_a_malformed_one_is_422(client, alice):
    """``gemm_bwd_efficiency`` (``foldtune calibrate`` since it times each GEMM's backward) is kept as sent; a
    curve the time model cannot price with (wrong shape, efficiency <= 0, non-finite) is refused with a 422."""
    import json

    curve = [[1e9, 0.3], [1e12, 0.6]]
    r = client.post("/v1/hardware-profiles", json={**H, "name": "bwd-curve", "gemm_bwd_efficiency": curve},
                    headers=alice)
    assert r.status_code == 201, r.text
    assert client.get("/v1/hardware-profiles/bwd-curve", headers=alice).json()["profile"]["gemm_bwd_efficiency"] \
        == curve
    # 1e999 is JSON's way to an infinite float (Python's json writes it as Infinity, which pydantic also reads)
    for bad in ("[]", "[[1e9]]", "[[1e9, 0.5, 1]]", '"fast"', "[[0, 0.5]]", "[[1e9, -0.5]]", "[[1e9, 0]]",
                "[[1e999, 0.5]]", "[[1e9, 1e999]]"):
        body = json.dumps({**H, "name": "bad-bwd"})[:-1] + f', "gemm_bwd_efficiency": {bad}}}'
        r = client.post("/v1/hardware-profiles", content=body,
                        headers={**alice, "content-type": "application/json"})
        assert r.status_code == 422, (bad, r.status_code, r.text)
        assert "gemm_bwd_efficiency" in r.json()["errors"][0]["loc"] or \
            r.json()["errors"][0]["rule"] == "hardware_profile_rules", (bad, r.text)
    assert client.get("/v1/hardware-profiles/bad-bwd", headers=alice).status_code == 404


def test_grouped_gemm_curves_per_expert_shape_round_trip_and_a_bad_shape_key_is_422(client, alice):
    curves = {"4096x14336": [[256.0, 0.5], [4096.0, 0.75]], "2048x768": [[256.0, 0.2], [4096.0, 0.45]]}
    r = client.post("/v1/hardware-profiles", json={**H, "name": "shapes", "grouped_gemm_shape_efficiency": curves},
                    headers=alice)
    assert r.status_code == 201, r.text
    got = client.get("/v1/hardware-profiles/shapes", headers=alice).json()["profile"]
    assert got["grouped_gemm_shape_efficiency"] == curves
    r = client.post("/v1/hardware-profiles", headers=alice,
                    json={**H, "name": "bad-shape", "grouped_gemm_shape_efficiency": {"4096 by 14336": [[256.0, 0.5]]}})
    assert r.status_code == 422 and "grouped_gemm_shape_efficiency" in r.text, r.text


def test_a_profile_with_exchange_per_call_costs_round_trips_and_a_negative_one_is_422(client, alice):
    """The per-call fields ``foldtune calibrate`` fills on two or more ranks are kept as sent; a negative
    cost is refused."""
    fields = {"cp_exchange_fixed_s": 5.4e-4, "cp_chunk_floor_s": 5.8e-4,
              "dispatcher_fixed_s": {"alltoall": 2.2e-3, "allgather": 1.8e-3}}
    r = client.post("/v1/hardware-profiles", json={**H, "name": "per-call", **fields}, headers=alice)
    assert r.status_code == 201, r.text
    got = client.get("/v1/hardware-profiles/per-call", headers=alice).json()["profile"]
    assert {k: got[k] for k in fields} == fields
    r = client.post("/v1/hardware-profiles", json={**H, "name": "neg", "dispatcher_fixed_s": {"alltoall": -1e-3}},
                    headers=alice)
    assert r.status_code == 422 and "dispatcher_fixed_s" in r.json()["errors"][0]["loc"]


def test_a_profile_with_memory_bound_curves_round_trips_and_an_unknown_class_names_the_rule(client, alice):
    """The per-class curves ``foldtune calibrate`` writes are kept as sent; a class the cost model has no
    pricing for is refused with the classes it knows, not a 500."""
    curves = {"norm": [[9.8e4, 0.005], [1.6e9, 0.86]], "permute": [[1.5e5, 0.024], [2.4e9, 1.26]]}
    r = client.post("/v1/hardware-profiles", json={**H, "name": "mem-curves", "memory_bound_efficiency": curves},
                    headers=alice)
    assert r.status_code == 201, r.text
    got = client.get("/v1/hardware-profiles/mem-curves", headers=alice).json()["profile"]
    assert got["memory_bound_efficiency"] == curves
    r = client.post("/v1/hardware-profiles", json={**H, "name": "bad-class",
                                                   "memory_bound_efficiency": {"softmax": [[1e5, 0.5]]}},
                    headers=alice)
    assert r.status_code in (400, 422), r.text
    assert "memory_bound_efficiency keys must be memory-bound op classes" in r.text and "permute" in r.text
