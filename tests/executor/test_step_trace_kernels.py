"""executor.microbench.step_trace's kernel tables from profiler events: record_function ranges on the device
timeline are not kernels, calls of one name add up, the largest come first and names are cut to 300 characters."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from executor.microbench.step_trace import cuda_kernels, kernel_times, top_kernels

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def _event(name, start, end, device=CUDA, annotation=False):
    return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                           time_range=SimpleNamespace(start=start, end=end))


def test_annotations_and_host_events_are_not_kernels_and_calls_add_up():
    events = [_event("gemm", 0, 1500), _event("gemm", 2000, 2500), _event("FSDP::pre_backward", 0, 9000,
                                                                           annotation=True),
              _event("aten::mm", 0, 700, device=CPU), _event("norm" + "x" * 400, 100, 300)]
    prof = SimpleNamespace(events=lambda: events)
    kernels = cuda_kernels(prof)
    assert [e.name[:4] for e in kernels] == ["gemm", "gemm", "norm"]
    times = kernel_times(kernels)
    assert times["gemm"] == [1500, 500]
    top = top_kernels(times, 5)
    assert top[0] == {"name": "gemm", "calls": 2, "ms": 2.0}
    assert top[1]["ms"] == 0.2 and len(top[1]["name"]) == 300
    assert top_kernels(times, 1) == top[:1]
