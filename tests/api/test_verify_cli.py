"""`foldtune verify` end to end on the CPU: the top 3 layouts of a 128-GPU Qwen3-30B-A3B plan (its tiny proxy,
4 layers, so that a slice takes milliseconds) each built as one rank, timed under even and skewed routing,
compared with the cost model term by term and re-ranked by the measured numbers."""

from __future__ import annotations

import json

import pytest

from api.cli.main import main

QWEN3_128 = ["verify", "--model", "qwen3-30b-a3b", "--proxy", "tiny", "--layers", "4", "--gpus", "128",
             "--gpu", "h100-sxm", "--seq", "64", "--gbs", "256", "--precision", "fp32", "--top", "3",
             "--slice-gpu", "cpu", "--slice-layers", "1"]
# three slices of milliseconds each: ~6 s on a quiet 2-core machine (35 s when it is loaded)
TERMS = {"gemm", "grouped_gemm", "attention_core", "memory_bound", "recompute", "extras"}


def test_verify_checks_the_top_3_of_a_128_gpu_qwen3_plan_and_ranks_them_by_the_measurement(capsys):
    code = main(QWEN3_128 + ["--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert (report["model"], report["gpu"], report["num_gpus"], report["slice_gpu"], report["device"]) == (
        "qwen3-30b-a3b@tiny@4L", "h100-sxm", 128, "cpu", "cpu")
    layouts = report["layouts"]
    assert [lay["plan_rank"] for lay in layouts] == [1, 2, 3] and all(lay["error"] is None for lay in layouts)
    by_label = {lay["layout"]: lay for lay in layouts}
    assert set(report["order"]) == {"even", "skewed"}
    for name, labels in report["order"].items():
        assert sorted(labels) == sorted(by_label)
        checked = [by_label[label]["scenarios"][name]["checked_step_s"] for label in labels]
        assert checked == sorted(checked)  # the order is the measured one, whatever the plan said
        assert [by_label[label]["rank"][name] for label in labels] == [1, 2, 3]
    for lay in layouts:
        for name, check in lay["scenarios"].items():
            assert set(check["terms"]) == TERMS
            compute = sum(t["measured_s"] for t in check["terms"].values())
            assert compute > 0 and check["compute_measured_s"]["total"] > 0
            # the checked step is the measured compute run through the pipeline plus the priced rest
            assert check["checked_step_s"] == pytest.approx(check["compute_measured_s"]["total"]
                                                            + sum(check["priced_s"].values()))
            assert {"tp_comm", "ep_a2a", "dp_grad", "optimizer"} <= set(check["priced_s"])
            assert sum(check["expert_rows"]) > 0
        skewed, even = lay["scenarios"]["skewed"]["expert_rows"], lay["scenarios"]["even"]["expert_rows"]
        assert skewed[0] > even[0] and sum(skewed) >= sum(even)  # the slice is the rank of the hot expert


def test_verify_refuses_bad_counts_before_planning(capsys):
    assert main(QWEN3_128[:-4] + ["--slice-layers", "0"]) == 2
    assert "--slice-layers must be >= 1, got 0" in capsys.readouterr().err
    assert main(["verify", "--model", "tiny-moe", "--gpus", "4", "--gpu", "h100-sxm", "--top", "0"]) == 2
    assert "--top must be >= 1" in capsys.readouterr().err
