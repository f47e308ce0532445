"""Shared-expert overlap through `foldtune plan` (--explain with the label token shared_overlap=on, the ranked
layouts, Megatron's flag) and POST /v1/plans."""

from __future__ import annotations

import json

from api.cli.main import main

DSV2 = ["plan", "--model", "deepseek-v2-lite", "--gpus", "16", "--gpu", "h100-sxm", "--seq", "4096", "--gbs", "64",
        "--json", "--top", "3"]


def run(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_explain_takes_the_token_and_names_the_rule(capsys):
    code, out, _ = run(capsys, DSV2 + ["--explain", "ep8 mbs2 shared_overlap=on"])
    data = json.loads(out)
    assert code == 0 and data["valid"], data["rejections"]
    assert data["estimate"]["config"]["moe_shared_expert_overlap"] is True
    assert "shared_overlap=on" in data["estimate"]["layout"]
    code, out, _ = run(capsys, DSV2 + ["--explain", "ep1 mbs2 shared_overlap=on"])
    data = json.loads(out)
    assert not data["valid"] and [r["rule"] for r in data["rejections"]] == ["shared_overlap"]


def test_explained_layout_exports_megatrons_flag(capsys):
    code, out, _ = run(capsys, DSV2 + ["--explain", "ep8 mbs2 shared_overlap=on", "--megatron-args"])
    assert code == 0 and "--moe-shared-expert-overlap" in json.loads(out)["megatron_args"]
    code, out, _ = run(capsys, DSV2 + ["--explain", "ep8 mbs2", "--megatron-args"])
    assert code == 0 and "--moe-shared-expert-overlap" not in json.loads(out)["megatron_args"]


PLAN = {"model": "tiny-moe-shared", "training": {"seq_length": 64, "global_batch_size": 8},
        "cluster": {"gpu": "cpu", "num_gpus": 4}, "top": 100}


def test_http_plan_ranks_shared_overlap_layouts(client, alice):
    r = client.post("/v1/plans", json=PLAN, headers=alice)
    assert r.status_code == 200, r.text
    ranked = r.json()["ranked"]
    on = [e for e in ranked if e["config"]["moe_shared_expert_overlap"]]
    assert on and all("shared_overlap=on" in e["layout"] and e["config"]["ep"] > 1 for e in on)
    assert all(e["executable"] for e in on)
