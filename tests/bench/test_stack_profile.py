"""bench/stack_profile.py at tiny shapes on CPU: one run reports every variant side by side (or why it is
refused), the top kernels, and the variants share one set of parameters."""

from __future__ import annotations

import json
import sys

import torch

import bench.stack_profile as sp
from spec.catalog import get_model


def test_cpu_smoke_run_reports_variants_kernels_and_refusals(tmp_path, monkeypatch):
    out = tmp_path / "stack.json"
    monkeypatch.setattr(sys, "argv", ["stack_profile", "--device", "cpu", "--tiny", "--variants",
                                      "before,after,graphs", "--profile", "after", "--rounds", "1", "--iters", "1",
                                      "--profile-steps", "1", "--graph-seqs", "", "--out", str(out)])
    assert sp.main() == 0
    report = json.loads(out.read_text())
    assert report["flops"] > 0 and report["gemm"]["tflops"] > 0
    for name in ("before", "after"):
        v = report["variants"][name]
        assert v["steady_s"] > 0 and v["isolated_s"] > 0 and v["ratio"] > 0
    assert report["variants"]["before"]["grads"] == "accumulate" and report["variants"]["after"]["grads"] == "none"
    assert report["variants"]["before"]["options"]["fused_qkv"] is False
    assert report["variants"]["after"]["options"]["fused_qkv"] is True
    assert "CUDA device" in report["variants"]["graphs"]["refused"]
    kernels = report["variants"]["after"]["top_kernels"]
    assert 0 < len(kernels) <= sp.TOP and {"name", "calls", "ms", "pct"} <= set(kernels[0])
    assert kernels == sorted(kernels, key=lambda r: -r["ms"])
    assert "top_kernels" not in report["variants"]["before"]


def test_variants_share_parameters_and_set_grads_as_told():
    spec = get_model("tiny-moe").with_layers(1)
    dev = torch.device("cpu")
    before = sp.build_stack("before", spec, 16, 1, dev, torch.float32, None)
    after = sp.build_stack("after", spec, 16, 1, dev, torch.float32, before.layers)
    assert all(p is q for p, q in zip(before.layers.parameters(), after.layers.parameters()))
    before.step()
    first = before.layers[0].attention.wq.grad.clone()
    before.step()  # accumulates in place
    torch.testing.assert_close(before.layers[0].attention.wq.grad, 2 * first)
    after.step()  # starts from None: one step's gradient (the fused path computes the same)
    torch.testing.assert_close(after.layers[0].attention.wq.grad, first, rtol=1e-5, atol=1e-6)
