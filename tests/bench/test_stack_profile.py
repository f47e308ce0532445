"""bench/stack_profile.py at tiny shapes on CPU: one run reports every variant side by side (or why it is
refused), the top kernels, and the variants share one set of parameters."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace as NS

import torch

import bench.stack_profile as sp
from bench.device_timeline import device_timeline, kernel_launchers
from bench.sync_debug import synchronizing_warnings
from spec.catalog import get_model


def test_cpu_smoke_run_reports_variants_kernels_and_refusals(tmp_path, monkeypatch):
    out = tmp_path / "stack.json"
    monkeypatch.setattr(sys, "argv", ["stack_profile", "--device", "cpu", "--tiny", "--variants",
                                      "before,after,graphs", "--profile", "after", "--rounds", "1", "--iters", "1",
                                      "--profile-steps", "1", "--graph-seqs", "", "--out", str(out)])
    assert sp.main() == 0
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


def test_the_timeline_names_the_longest_idle_gap_and_what_the_host_did_across_it():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, start, end, device):
        return NS(name=name, device_type=device, time_range=NS(start=start, end=end))

    # two steps of device work (us): a 300 us gap after 'gemm' while the host sits in cudaStreamSynchronize
    events = [event("gemm", 0, 1000, cuda), event("copy", 900, 1100, cuda), event("add", 1400, 1500, cuda),
              event("norm", 1550, 2000, cuda),
              event("aten::nonzero", 1050, 1450, cpu), event("cudaStreamSynchronize", 1100, 1390, cpu),
              event("step", 0, 2000, cpu)]
    t = device_timeline(events, steps=2, top=2)
    assert t["span_ms"] == 1.0 and t["busy_ms"] == 0.825 and t["idle_ms"] == 0.175
    first, second = t["top_gaps"]
    assert (first["ms"], first["before"], first["after"]) == (0.3, "copy", "add")
    assert [h["name"] for h in first["host_across"]] == ["cudaStreamSynchronize", "aten::nonzero", "step"]
    assert (second["ms"], second["before"], second["after"]) == (0.05, "add", "norm")


def test_elementwise_kernels_are_traced_to_the_host_ops_that_launched_them():
    def op(name, parent=None, kernels=()):
        return NS(name=name, cpu_parent=parent, kernels=[NS(name=k, duration=d) for k, d in kernels])

    backward = op("autograd::engine::evaluate_function: AddBackward0")
    add = op("aten::add", backward, [("vectorized_elementwise_kernel<add>", 300.0)])
    mm = op("aten::mm", None, [("nvjet_gemm", 5000.0)])
    copy = op("aten::copy_", op("aten::contiguous"), [("elementwise_kernel<copy>", 100.0)] * 2)
    rows = kernel_launchers([add, mm, copy, add], steps=2)
    assert [(r["kernel"], r["calls"], r["ms"]) for r in rows] == [
        ("vectorized_elementwise_kernel<add>", 1.0, 0.3), ("elementwise_kernel<copy>", 1.0, 0.1)]
    assert rows[0]["launched_by"] == "aten::add < autograd::engine::evaluate_function: AddBackward0"
    assert rows[1]["launched_by"] == "aten::copy_ < aten::contiguous"


def test_the_gemm_loop_counts_every_product_of_its_step():
    a = torch.ones(4, 4)
    loop = sp.GemmLoop("g", a, a, reps=3)
    loop.step()
    assert loop.tflops(1e-12) == 3 * 2 * 64 / 1e-12 / 1e12  # 3 products of 2·4³ FLOPs in 1e-12 s


def test_the_sync_debug_modes_prototype_notice_is_not_a_synchronizing_call():
    def caught(text, line):
        return NS(message=UserWarning(text), filename=os.path.abspath("executor/router.py"), lineno=line)

    notice = caught("Synchronization debug mode is a prototype feature and does not yet detect all synchronizing "
                    "operations", 1)
    real = caught("called a synchronizing CUDA operation", 42)
    other = caught("some other warning", 7)
    assert synchronizing_warnings([notice, real, other]) == ["executor/router.py:42: called a synchronizing CUDA "
                                                            "operation"]
