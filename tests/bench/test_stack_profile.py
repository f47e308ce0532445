"""bench/stack_profile.py at tiny shapes on CPU (a child process): one run reports every variant side by side
(or why it is refused) and the top kernels."""

from __future__ import annotations

import json

import pytest

# a whole script run in a child process: the full suite's; the code it drives has fast tests in its package
pytestmark = pytest.mark.slow

TOP = 15  # kernels the bench keeps a variant


def test_cpu_smoke_run_reports_variants_kernels_and_refusals(tmp_path, script):
    out = tmp_path / "stack.json"
    done = script("stack_profile", "--device", "cpu", "--tiny", "--variants", "before,after,graphs", "--profile",
                  "after", "--rounds", "1", "--iters", "1", "--profile-steps", "1", "--graph-seqs", "", "--out",
                  str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["flops"] > 0 and report["gemm"]["tflops"] > 0
    assert report["gemm_steady"]["reps"] == 2 and report["gemm_steady"]["tflops"] > 0
    assert "dense_gemm_steady" not in report["variants"]  # timed beside the variants, not one of them
    for name in ("before", "after"):
        v = report["variants"][name]
        assert v["steady_s"] > 0 and v["isolated_s"] > 0 and v["ratio"] > 0
        assert v["ratio_steady_gemm"] == v["tflops"] / report["gemm_steady"]["tflops"]
    assert report["variants"]["before"]["grads"] == "accumulate" and report["variants"]["after"]["grads"] == "none"
    assert report["variants"]["before"]["options"]["fused_qkv"] is False
    assert report["variants"]["after"]["options"]["fused_qkv"] is True
    assert "CUDA device" in report["variants"]["graphs"]["refused"]
    kernels = report["variants"]["after"]["top_kernels"]
    assert 0 < len(kernels) <= TOP and {"name", "calls", "ms", "pct"} <= set(kernels[0])
    assert kernels == sorted(kernels, key=lambda r: -r["ms"])
    assert "top_kernels" not in report["variants"]["before"]
