"""`foldtune plan --search-precision`: bf16 and fp8 planned, the faster reported (fp8 only with an fp8 peak)."""

from __future__ import annotations

import json

from api.cli.main import main


def _plan_json(capsys, gpu: str) -> dict:
    code = main(["plan", "--model", "tiny-moe", "--gpus", "2", "--gpu", gpu, "--seq", "64", "--gbs", "8",
                 "--mbs-max", "2", "--vpp-max", "1", "--top", "2", "--json", "--search-precision"])
    assert code == 0
    return json.loads(capsys.readouterr().out)


def test_search_precision_plans_both_on_an_h100_and_keeps_the_faster(capsys):
    out = _plan_json(capsys, "h100-sxm")
    searched = out["precision_search"]
    assert set(searched) == {"bf16", "fp8"}
    faster = min(searched, key=searched.get)
    assert out["training"]["precision"] == faster
    assert out["ranked"][0]["step_time_s"] == searched[faster]


def test_search_precision_keeps_bf16_on_a_gpu_without_fp8(capsys):
    out = _plan_json(capsys, "a100-80gb")
    assert list(out["precision_search"]) == ["bf16"]
    assert out["training"]["precision"] == "bf16"
