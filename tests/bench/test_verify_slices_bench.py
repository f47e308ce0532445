"""bench/verify_slices.py's CPU smoke mode: the top 3 of the 128-GPU Qwen3-30B-A3B plan's tiny proxy, each
sliced, written as the report and printed as the per-term table; docs/benchmarks.md is left alone."""

from __future__ import annotations

import json

import pytest

# a whole script run in a child process: the full suite's; the code it drives has fast tests in its packages
pytestmark = pytest.mark.slow

TERMS = ("gemm", "grouped_gemm", "attention_core", "memory_bound", "recompute", "extras")


def test_tiny_mode_checks_three_layouts_and_prints_the_term_table(tmp_path, script):
    out = tmp_path / "verify_slices.json"
    done = script("verify_slices", "--tiny", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["model"] == "qwen3-30b-a3b@tiny@4L" and report["num_gpus"] == 128 and report["device"] == "cpu"
    assert len(report["layouts"]) == 3 and all(lay["error"] is None for lay in report["layouts"])
    assert set(report["order"]) == {"even", "skewed"}
    for lay in report["layouts"]:
        for name in ("even", "skewed"):
            assert tuple(lay["scenarios"][name]["terms"]) == TERMS
            label = f"| {lay['plan_rank']} | `{lay['layout']}` | {name} | grouped_gemm |"
            assert label in done.stdout
    assert "ranked by checked step, even routing: " in done.stdout
