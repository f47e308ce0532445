"""Profiler-trace readers of executor/microbench: the device timeline's idle gaps and what the host did across
them, the host ops that launched small kernels, and the sync debug mode's warnings."""

from __future__ import annotations

import os
from types import SimpleNamespace as NS

import torch

from executor.microbench.device_timeline import device_timeline, kernel_launchers
from executor.microbench.sync_debug import synchronizing_warnings


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


def test_the_sync_debug_modes_prototype_notice_is_not_a_synchronizing_call():
    def caught(text, line):
        return NS(message=UserWarning(text), filename=os.path.abspath("executor/router.py"), lineno=line)

    notice = caught("Synchronization debug mode is a prototype feature and does not yet detect all synchronizing "
                    "operations", 1)
    real = caught("called a synchronizing CUDA operation", 42)
    other = caught("some other warning", 7)
    assert synchronizing_warnings([notice, real, other]) == ["executor/router.py:42: called a synchronizing CUDA "
                                                            "operation"]
