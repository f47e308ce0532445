"""The inline ``hf_config`` of the plan, job and training bodies: mapped as `--model-dir` maps a file, bounded,
and every field it cannot map named in a 422 problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CONFIG = json.loads((Path(__file__).parents[1] / "spec" / "hf_configs" / "qwen3-30b-a3b" / "config.json").read_text())
PLAN = {"training": {"seq_length": 4096, "global_batch_size": 64}, "cluster": {"gpu": "h100", "num_gpus": 16}, "top": 2}


def test_hf_config_plans_as_the_catalog_model(client, alice):
    ours = client.post("/v1/plans", json={**PLAN, "hf_config": CONFIG, "hf_name": "qwen3-30b-a3b"}, headers=alice)
    theirs = client.post("/v1/plans", json={**PLAN, "model": "qwen3-30b-a3b"}, headers=alice)
    assert ours.status_code == theirs.status_code == 200, ours.text
    a, b = ours.json(), theirs.json()
    assert a["model"] == "qwen3-30b-a3b"
    assert [e["layout"] for e in a["ranked"]] == [e["layout"] for e in b["ranked"]]
    assert [e["step_time_s"] for e in a["ranked"]] == [e["step_time_s"] for e in b["ranked"]]


def test_hf_config_problems(client, alice):
    r = client.post("/v1/plans", json={**PLAN, "hf_config": {**CONFIG, "surprise": 1}}, headers=alice)
    assert r.status_code == 422
    error = r.json()["errors"][0]
    assert error["rule"] == "hf_config_rules" and "surprise" in error["message"]
    r = client.post("/v1/plans", json={**PLAN, "hf_config": CONFIG, "model": "tiny-moe"}, headers=alice)
    assert r.status_code == 422 and r.json()["errors"][0]["rule"] == "model_xor_model_spec"
    big = {**CONFIG, "architectures": ["x" * (70 * 1024)]}
    r = client.post("/v1/plans", json={**PLAN, "hf_config": big}, headers=alice)
    assert r.status_code == 422 and "more than" in r.json()["errors"][0]["message"]
    r = client.post("/v1/plans", json={**PLAN, "model": "tiny-moe", "hf_name": "x"}, headers=alice)
    assert r.status_code == 422 and r.json()["errors"][0]["rule"] == "hf_name_needs_hf_config"


def test_job_from_hf_config_stores_the_mapped_spec(client, alice):
    body = {"hf_config": CONFIG, "training": {"seq_length": 4096, "global_batch_size": 64},
            "cluster": {"gpu": "h100", "num_gpus": 16}, "budget": {"max_trials": 1}}
    r = client.post("/v1/jobs", json=body, headers=alice)
    assert r.status_code in (200, 201, 202), r.text
    spec = r.json()["model_spec"]
    assert spec["name"] == "hf-qwen3_moe" and spec["num_experts"] == 128 and spec["qk_layernorm"] is True


def test_cli_model_dir_becomes_the_inline_hf_config(tmp_path):
    """profile/tune/submit/train read --model-dir / --hf-config; the service gets the config, not a path."""
    import argparse

    from api.cli._model_args import add_model_arguments, model_body, model_from_args

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    directory = tmp_path / "my-qwen3"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(CONFIG))
    args = parser.parse_args(["--model-dir", str(directory), "--layers", "2"])
    assert model_body(args) == {"hf_config": CONFIG, "hf_name": "my-qwen3", "num_layers_override": 2}
    spec = model_from_args(args)
    assert spec.name == "my-qwen3@2L" and spec.num_layers == 2 and spec.qk_layernorm
    args = parser.parse_args(["--hf-config", str(directory / "config.json"), "--proxy", "tiny"])
    assert model_from_args(args).hidden_size == 64
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "tiny-moe", "--model-dir", str(directory)])
