"""Offload through `foldtune plan` (--optimizer-offload, --activation-offload, explained layouts) and
POST /v1/plans (optimizer_offload, activation_offload; memory_bytes.host_offloaded)."""

from __future__ import annotations

import json

import pytest

from api.cli.main import main

MIXTRAL = ["plan", "--model", "mixtral-8x7b", "--gpus", "8", "--gpu", "h100-sxm", "--seq", "4096", "--gbs", "16",
           "--json", "--top", "3"]


def run(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_finds_layouts_that_fit_only_with_optimizer_offload(capsys):
    code, out, _ = run(capsys, MIXTRAL)
    assert json.loads(out)["ranked"] == []
    code, out, _ = run(capsys, MIXTRAL + ["--optimizer-offload", "0.5,1.0", "--megatron-args"])
    data = json.loads(out)
    assert code == 0 and data["ranked"]
    for e in data["ranked"]:
        assert e["config"]["optimizer_cpu_offload_fraction"] in (0.5, 1.0) and "opt_offload=" in e["layout"]
        assert e["memory_bytes"]["host_offloaded"] > 0
    assert "--optimizer-cpu-offload" in data["megatron_args"]


def test_explain_takes_the_offload_tokens(capsys):
    code, out, _ = run(capsys, MIXTRAL + ["--explain", "tp4 ep8 mbs1 recompute=selective:layernorm+moe_act "
                                                      "opt_offload=1 act_offload=core_attn"])
    data = json.loads(out)
    assert data["valid"], data["rejections"]
    est = data["estimate"]
    assert est["config"]["activation_offload_modules"] == ["core_attn"]
    assert est["memory_bytes"]["optimizer"] < est["memory_bytes"]["host_offloaded"]


@pytest.mark.parametrize("extra,message", [
    (["--optimizer-offload", "half"], "--optimizer-offload takes comma-separated fractions"),
    (["--optimizer-offload", "1.5"], "optimizer offload fractions must be in (0, 1]"),
    (["--activation-offload", "core_attn+attn"], "unknown activation offload modules ['attn']"),
])
def test_bad_offload_options_are_one_error_line(capsys, extra, message):
    code, out, err = run(capsys, MIXTRAL + extra)
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1


PLAN = {"model": "tiny-moe", "training": {"seq_length": 64, "global_batch_size": 8},
        "cluster": {"gpu": "cpu", "num_gpus": 4}, "top": 50}


def test_http_plan_takes_the_offload_options(client, alice):
    body = {**PLAN, "optimizer_offload": [1.0], "activation_offload": [["moe"]]}
    r = client.post("/v1/plans", json=body, headers=alice)
    assert r.status_code == 200, r.text
    data = r.json()
    plain = client.post("/v1/plans", json=PLAN, headers=alice).json()
    assert data["valid"] > plain["valid"]
    assert all("host_offloaded" in e["memory_bytes"] for e in data["ranked"])
    r = client.post("/v1/plans", json={**PLAN, "activation_offload": [["attn"]]}, headers=alice)
    assert r.status_code == 422 and r.json()["errors"][0]["rule"] == "offload_options"


def test_plan_tables_name_the_bytes_offloaded_to_the_host(capsys):
    argv = [a for a in MIXTRAL if a != "--json"] + ["--optimizer-offload", "1.0"]
    code, out, _ = run(capsys, argv)
    assert code == 0 and "offloaded to the host (not on the GPU):" in out and "opt_offload=1" in out
