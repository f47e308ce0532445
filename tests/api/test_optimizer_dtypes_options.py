"""The precision-aware optimizer through `foldtune plan` (--optimizer-dtypes, explained layouts) and POST /v1/plans
(optimizer_dtypes)."""

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


def test_plan_finds_layouts_that_fit_only_with_narrower_optimizer_state(capsys):
    code, out, _ = run(capsys, MIXTRAL + ["--optimizer-dtypes", "bf16+bf16+fp32,bf16+bf16+fp16", "--megatron-args"])
    data = json.loads(out)
    assert code == 0 and data["ranked"]
    for e in data["ranked"]:
        assert e["config"]["exp_avg_dtype"] == "bf16" and "exp_avg=bf16" in e["layout"]
    args = data["megatron_args"]
    assert "--use-precision-aware-optimizer" in args and args[args.index("--exp-avg-dtype") + 1] == "bf16"


def test_explain_takes_the_dtype_tokens_and_names_the_rules(capsys):
    code, out, _ = run(capsys, MIXTRAL + ["--explain", "tp4 ep8 mbs1 exp_avg=bf16 exp_avg_sq=bf16 main_params=fp16"])
    data = json.loads(out)
    assert data["valid"], data["rejections"]
    assert data["estimate"]["config"]["main_params_dtype"] == "fp16"
    code, out, _ = run(capsys, MIXTRAL + ["--explain", "tp4 ep8 mbs1 distopt=off exp_avg=bf16"])
    rules = [r["rule"] for r in json.loads(out)["rejections"]]
    assert "precision_aware_distopt" in rules


@pytest.mark.parametrize("extra,message", [
    (["--optimizer-dtypes", "bf16+bf16"], "--optimizer-dtypes: optimizer dtypes are EXP_AVG+EXP_AVG_SQ+MAIN_PARAMS"),
    (["--optimizer-dtypes", "bf16+bf16+bf16"], "main_params_dtype 'bf16'"),
])
def test_bad_dtype_options_are_one_error_line(capsys, extra, message):
    code, out, err = run(capsys, MIXTRAL + extra)
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1


PLAN = {"model": "tiny-moe", "training": {"seq_length": 64, "global_batch_size": 8},
        "cluster": {"gpu": "cpu", "num_gpus": 4}, "top": 50}


def test_http_plan_takes_the_optimizer_dtypes(client, alice):
    r = client.post("/v1/plans", json={**PLAN, "optimizer_dtypes": ["bf16+bf16+fp32"]}, headers=alice)
    assert r.status_code == 200, r.text
    plain = client.post("/v1/plans", json=PLAN, headers=alice).json()
    assert r.json()["valid"] > plain["valid"]
    r = client.post("/v1/plans", json={**PLAN, "optimizer_dtypes": ["bf16+bf16+int4"]}, headers=alice)
    assert r.status_code == 422 and r.json()["errors"][0]["rule"] == "optimizer_dtypes"
