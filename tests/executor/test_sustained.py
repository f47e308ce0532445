"""The sustained-load microbenchmark and how its factor reaches the hardware profile."""

from __future__ import annotations

import statistics

import pytest
import torch

from spec.catalog import get_hardware
from executor.microbench import sustained
from costmodel.calibrate.profile_builder import build_profile
from executor.microbench.runner import merge_ranks


class _SteppingClock:
    """A clock that advances ``step`` seconds per reading: the run has a fixed number of windows, however
    busy the machine is (the GEMMs themselves still run)."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 100.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_measure_sustained_reports_the_median_of_the_late_windows_against_the_burst():
    # Readings per window: its start (loop test), t0, its end: 3 x 0.01 s, so windows start at 0.01, 0.04, ...
    # 0.37 s: 13 windows, each timed 0.01 s long; the 6 starting at >= 0.2 s are the late ones.
    slept: list[float] = []
    row = sustained.measure_sustained(torch.device("cpu"), torch.float32, seconds=0.4, n=64,
                                      clock=_SteppingClock(0.01), sleep=slept.append)
    w = row["windows_flops_per_s"]
    assert slept == [1.0]  # the idle second before the burst
    assert len(w) == 13 and all(rate > 0 for rate in w)
    assert row["burst_flops_per_s"] > 0
    # the sustained figure is the median of the windows of the second half (here all equal), never the burst
    starts = [0.01 + 0.03 * i for i in range(13)]
    late = [rate for t, rate in zip(starts, w) if t >= 0.2]
    assert len(late) == 6 and row["sustained_flops_per_s"] == pytest.approx(statistics.median(late))
    # every window is a whole number of n^3 GEMMs over the 0.01 s its clock readings span
    per_window = w[0] * 0.01 / (2.0 * 64**3)
    assert round(per_window) >= 1 and per_window == pytest.approx(round(per_window)) and w == pytest.approx([w[0]] * 13)
    assert row["factor"] == pytest.approx(min(1.0, row["sustained_flops_per_s"] / row["burst_flops_per_s"]))
    assert 0 < row["factor"] <= 1.0


def test_sustained_is_the_median_of_the_second_half_and_the_factor_never_exceeds_one():
    # 4 s run: 100 units/s for the first 2 s, then 80, 82, 78, 200 (a one-window outlier): median 81.
    windows = [(0.0, 100.0), (0.5, 100.0), (1.0, 100.0), (1.5, 100.0), (2.0, 80.0), (2.5, 82.0), (3.0, 78.0),
               (3.5, 200.0)]
    row = sustained.summarize(windows, 4.0, burst=100.0)
    assert row["sustained_flops_per_s"] == 81.0 and row["factor"] == pytest.approx(0.81)
    assert sustained.summarize(windows, 4.0, burst=50.0)["factor"] == 1.0  # noise above the burst is no speed-up
    assert sustained.summarize([(0.0, 90.0)], 4.0, burst=100.0)["factor"] == pytest.approx(0.9)  # one window


def test_profile_takes_the_slowest_ranks_factor_and_keeps_the_base_when_not_measured():
    base = get_hardware("h100-sxm")
    rank = {"device_name": "gpu", "gemm": [], "grouped_gemm": [], "copy": [], "collectives": [],
            "launch": {"op_launch_s": 1e-5, "collective_launch_s": None, "moe_layer_host_s": None}}
    raw = merge_ranks([{**rank, "sustained": {"factor": 0.91}}, {**rank, "sustained": {"factor": 0.86}}])
    raw.update(precision="bf16", backend="nccl", measured_at="2026-11-26T10:00:00+00:00")
    assert raw["sustained"]["factor"] == 0.86
    assert build_profile(base, raw).sustained_clock_factor == 0.86
    raw_cpu = merge_ranks([rank, rank])
    raw_cpu.update(precision="fp32", backend="gloo", measured_at="2026-11-26T10:00:00+00:00")
    assert raw_cpu["sustained"] is None
    assert build_profile(base, raw_cpu).sustained_clock_factor is None
