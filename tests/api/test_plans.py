"""POST /plans: the cost model's ranking over HTTP, and its problems."""

PLAN = {"model": "tiny-moe", "training": {"seq_length": 64, "global_batch_size": 8},
        "cluster": {"gpu": "cpu", "num_gpus": 4}, "top": 3}


def test_plan_ranks_fitting_layouts_by_the_high_end_of_their_step_time_intervals(client, alice):
    r = client.post("/v1/plans", json=PLAN, headers=alice)
    assert r.status_code == 200, r.text
    body = r.json()
    # the cpu profile's 16 GiB "memory": 1.5 GiB reserved, 5 % (0.8 GiB) kept free by default
    assert body["model"] == "tiny-moe" and body["cluster"] == {
        "gpu": "cpu", "num_gpus": 4, "min_headroom": 0.05, "min_headroom_bytes": int(0.05 * 16 * 2**30),
        "usable_hbm_bytes": 16 * 2**30 - int(1.5 * 2**30) - int(0.05 * 16 * 2**30)}
    assert body["considered"] >= body["valid"] >= body["fitting"] > 0
    assert 1 <= len(body["ranked"]) <= 3
    assert body["rank_by"] == "robust" and isinstance(body["robust_exact"], bool)
    highs = [e["step_time_interval_s"]["high"] for e in body["ranked"]]
    assert highs == sorted(highs) and all(e["step_time_s"] > 0 for e in body["ranked"])
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


def test_plan_takes_megatrons_fused_window_sink_attention_switch(client, alice):
    # a GPT-OSS-shaped model in miniature: sinks on every layer, a window on every second one
    gptoss = {"name": "mini-gptoss", "num_layers": 2, "hidden_size": 256, "num_attention_heads": 8,
              "num_query_groups": 2, "ffn_hidden_size": 256, "vocab_size": 1024, "num_experts": 8,
              "moe_router_topk": 2, "swiglu": False, "quick_geglu": True, "softmax_type": "learnable",
              "window_size": [128, 0], "window_attn_skip_freq": 2}
    body = {"model_spec": gptoss, "training": {"seq_length": 4096, "global_batch_size": 8},
            "cluster": {"gpu": "h100", "num_gpus": 8}, "top": 1}
    ours = client.post("/v1/plans", json=body, headers=alice)
    fused = {**body, "training": {**body["training"], "fused_window_sink_attention": True}}
    theirs = client.post("/v1/plans", json=fused, headers=alice)
    assert ours.status_code == theirs.status_code == 200, (ours.text, theirs.text)
    assert theirs.json()["training"]["fused_window_sink_attention"] is True
    assert ours.json()["ranked"][0]["step_time_s"] > theirs.json()["ranked"][0]["step_time_s"]


def test_plan_keeps_the_headroom_asked_for(client, alice):
    """cluster.min_headroom prunes layouts whose predicted peak leaves less free; a headroom that leaves
    nothing to plan with is a 422 naming its rule."""
    body = {"model": "mixtral-8x7b", "training": {"seq_length": 4096, "global_batch_size": 64},
            "cluster": {"gpu": "h100", "num_gpus": 16}, "top": 1}
    default = client.post("/v1/plans", json=body, headers=alice).json()
    roomy = client.post("/v1/plans", json={**body, "cluster": {**body["cluster"], "min_headroom": 16 * 2**30}},
                        headers=alice).json()
    assert roomy["cluster"]["min_headroom_bytes"] == 16 * 2**30
    assert roomy["cluster"]["usable_hbm_bytes"] == default["cluster"]["usable_hbm_bytes"] + int(0.05 * 80 * 2**30) - 16 * 2**30
    assert roomy["fitting"] < default["fitting"]
    best = roomy["ranked"][0]
    assert best["memory_bytes"]["total"] <= roomy["cluster"]["usable_hbm_bytes"]
    r = client.post("/v1/plans", json={**body, "cluster": {**body["cluster"], "min_headroom": 80 * 2**30}}, headers=alice)
    assert r.status_code == 422 and r.json()["errors"][0]["rule"] == "headroom_fits"
    assert r.json()["errors"][0]["loc"] == "body.cluster.min_headroom"
    r = client.post("/v1/plans", json={**body, "cluster": {**body["cluster"], "min_headroom": -1}}, headers=alice)
    assert r.status_code == 422


def test_plan_takes_megatrons_loss_switch(client, alice):
    body = {"model": "qwen3-30b-a3b", "num_layers_override": 2, "training": {"seq_length": 4096, "global_batch_size": 8},
            "cluster": {"gpu": "h100", "num_gpus": 8}, "top": 1}
    ours = client.post("/v1/plans", json=body, headers=alice)
    theirs = client.post("/v1/plans", json={**body, "training": {**body["training"], "megatron_cross_entropy": True}},
                         headers=alice)
    assert ours.status_code == theirs.status_code == 200, (ours.text, theirs.text)
    assert theirs.json()["training"]["megatron_cross_entropy"] is True
    details = ours.json()["ranked"][0]["memory_bytes"]["details"]
    assert "logits.loss_block" in details and "logits.loss_and_output" not in details
    assert "logits.loss_and_output" in theirs.json()["ranked"][0]["memory_bytes"]["details"]


def test_plan_labels_what_foldtunes_executor_runs_and_ranks_it_first(client, alice):
    """Every ranked layout carries executable and, when false, the executor rules it breaks; by default the
    ranking puts executable layouts first, with megatron: true it is by step time (what Megatron-Core runs)."""
    # one KV head: Megatron replicates it over TP, the executor builds tp = 1 only (rule executor_heads_tp)
    mqa = {"name": "tiny-mqa", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 1,
           "ffn_hidden_size": 128, "vocab_size": 256, "num_experts": 8, "moe_router_topk": 2,
           "moe_ffn_hidden_size": 32}
    body = {"model_spec": mqa, "training": {"seq_length": 64, "global_batch_size": 8},
            "cluster": {"gpu": "cpu", "num_gpus": 4}, "top": 20}
    # 60 deep: ranked as Megatron runs them, the flex dispatcher's layouts join the tp2 ones among the fastest
    megatron = client.post("/v1/plans", json={**body, "megatron": True, "rank_by": "point", "top": 60}, headers=alice)
    assert megatron.status_code == 200, megatron.text
    megatron = megatron.json()
    assert megatron["ranking"] == "megatron"
    times = [e["step_time_s"] for e in megatron["ranked"]]
    assert times == sorted(times)
    refused = [e for e in megatron["ranked"] if not e["executable"]]
    # tp2 layouts (one KV head) and, ranked as Megatron runs them, the flex dispatcher's
    assert any(e["executable_reason"].startswith("[executor_heads_tp]") for e in refused)
    assert all((e["config"]["tp"] == 2 and e["executable_reason"].startswith("[executor_heads_tp]"))
               or "[executor_dispatcher]" in e["executable_reason"] for e in refused)
    default = client.post("/v1/plans", json=body, headers=alice).json()
    assert default["ranking"] == "executable_first"
    assert len(default["ranked"]) == 20 and all(e["executable"] for e in default["ranked"])
    assert all(e["executable_reason"] is None for e in default["ranked"])
    # a model the executor cannot build: ranked by step time, every layout saying why
    layernorm = {**body, "model_spec": {**mqa, "name": "tiny-layernorm", "num_query_groups": 2,
                                        "normalization": "layernorm"}, "top": 3}
    ranked = client.post("/v1/plans", json=layernorm, headers=alice).json()["ranked"]
    assert ranked and all(e["executable"] is False and "[executor_model]" in e["executable_reason"] for e in ranked)
    assert client.post("/v1/plans", json={**body, "megatron": "sometimes"}, headers=alice).status_code == 422


def test_plan_estimates_carry_intervals_and_the_provenance_of_every_term(client, alice):
    """The additive fields of every estimate: step-time and memory intervals around the value, the rate they are
    meant to hold, and each term of the term table with where its constants come from."""
    from costmodel.terms import TERMS
    from costmodel.uncertainty import PROVENANCES, RATE

    body = client.post("/v1/plans", json=PLAN, headers=alice).json()
    for e in body["ranked"]:
        step, mem = e["step_time_interval_s"], e["memory_interval_bytes"]
        assert step["low"] <= e["step_time_s"] <= step["high"] and step["low"] < step["high"]
        assert mem["low"] <= e["memory_bytes"]["total"] <= mem["high"] and mem["low"] < mem["high"]
        assert e["interval_rate"] == RATE
        assert list(e["time_provenance"]) == list(TERMS)
        for p in e["time_provenance"].values():
            assert p["provenance"] in (*PROVENANCES, "derived") and p["low"] >= 0 and p["high"] >= 0 and p["note"]


def test_plan_ranks_by_the_point_estimate_when_asked(client, alice):
    r = client.post("/v1/plans", json={**PLAN, "rank_by": "point", "top": 5}, headers=alice)
    assert r.status_code == 200, r.text
    body = r.json()
    times = [e["step_time_s"] for e in body["ranked"]]
    assert body["rank_by"] == "point" and times == sorted(times) and len(times) == 5
    r = client.post("/v1/plans", json={**PLAN, "rank_by": "fastest"}, headers=alice)
    assert r.status_code == 422 and r.json()["errors"][0]["loc"] == "body.rank_by"
