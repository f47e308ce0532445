"""Launch-overhead microbenchmark on CPU ranks, and its place in a calibrated HardwareProfile."""

from __future__ import annotations

import glob
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from spec.catalog import get_hardware
from spec.errors import FoldtuneError
from spec.hardware import DEFAULT_COLLECTIVE_LAUNCH_S, DEFAULT_OP_LAUNCH_S, HardwareProfile
from spec.profile_io import load_profile, save_profile
from executor.launch_local import launch
from executor.microbench.launch import (
    _forward_backward_seconds,
    layer_seconds,
    measure_collective_launch,
    measure_launch,
    measure_op_launch,
    region_seconds,
)
from executor.microbench.runner import _merged_launch
from costmodel.calibrate.profile_builder import build_profile

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def _launch_worker(rank: int, world_size: int) -> dict:
    return measure_launch(torch.device("cpu"))


def test_op_launch_on_cpu_is_a_positive_finite_time():
    seconds = measure_op_launch(torch.device("cpu"), ops=200)
    # An eager op costs at least a few hundred nanoseconds of dispatch and far less than a millisecond.
    assert math.isfinite(seconds) and 1e-7 < seconds < 1e-3


def test_collective_launch_needs_a_process_group():
    assert measure_collective_launch(torch.device("cpu")) is None


def test_launch_benchmarks_on_two_gloo_ranks():
    result = launch(_launch_worker, 2, backend="gloo", timeout_s=120, start_method="fork")
    assert result.ok, result.failure_reason
    for report in result.results:
        assert math.isfinite(report["op_launch_s"]) and report["op_launch_s"] > 0
        coll = report["collective_launch_s"]
        # A gloo all-reduce crosses processes: it costs more than one in-process op launch.
        assert coll is not None and math.isfinite(coll) and coll > report["op_launch_s"]
        # On this shared CPU two close medians may invert (then None); a value is always a real time.
        layer = report["moe_layer_host_s"]
        assert layer is None or (math.isfinite(layer) and layer > 0)
        region = report["recompute_region_s"]
        assert math.isfinite(region) and region >= 0


def test_the_layer_is_half_the_median_difference_of_adjacent_passes():
    # pair differences 5, 11 (a spike in the second pair's 3-layer pass), 3: the median 5 ignores the spike
    assert layer_seconds([7.0, 15.0, 6.0], [2.0, 4.0, 3.0]) == pytest.approx(5.0 / 2)
    assert layer_seconds([2.0], [2.5]) is None  # inverted by noise: not a measurement


def test_a_region_is_what_checkpointing_adds_beyond_its_re_run_forward():
    assert region_seconds(checkpointed=5e-4, plain=2e-4, forward=1e-4) == pytest.approx(2e-4)
    assert region_seconds(checkpointed=2e-4, plain=2e-4, forward=1e-4) == 0.0


def test_ranks_merge_to_the_median_region():
    rows = [{"op_launch_s": 1e-6, "collective_launch_s": 1e-5, "moe_layer_host_s": 2e-3, "recompute_region_s": r}
            for r in (1e-4, 3e-4, 2e-4)]
    assert _merged_launch(rows)["recompute_region_s"] == pytest.approx(2e-4)
    assert _merged_launch([{**r, "recompute_region_s": None} for r in rows])["recompute_region_s"] is None


def test_executor_forward_backward_runs_and_takes_time():
    one = _forward_backward_seconds(1, torch.device("cpu"), torch.float32)
    assert math.isfinite(one) and 0 < one < 60


def _raw(launch_row: dict | None) -> dict:
    raw = {"precision": "fp32", "copy": [], "gemm": [], "grouped_gemm": [], "collectives": [],
           "measured_at": "2026-11-26T05:00:00+00:00", "ranks": 2, "device_name": "cpu", "backend": "gloo"}
    if launch_row is not None:
        raw["launch"] = launch_row
    return raw


def test_profile_carries_the_measured_launch_costs_and_round_trips(tmp_path):
    base = get_hardware("cpu")
    profile = build_profile(base, _raw({"op_launch_s": 3e-6, "collective_launch_s": 4e-5,
                                        "moe_layer_host_s": 2e-3, "recompute_region_s": 2.5e-4}))
    assert (profile.op_launch_s, profile.collective_launch_s, profile.moe_layer_host_s) == (3e-6, 4e-5, 2e-3)
    assert profile.recompute_region_s == 2.5e-4
    assert profile.op_launch_seconds == 3e-6 and profile.collective_launch_seconds == 4e-5
    assert load_profile(save_profile(profile, tmp_path / "p.json")) == profile
    # A single-rank calibration measures no collective: the documented default answers for it.
    single = build_profile(base, _raw({"op_launch_s": 3e-6, "collective_launch_s": None}))
    assert single.collective_launch_s is None and single.collective_launch_seconds == DEFAULT_COLLECTIVE_LAUNCH_S


def test_raw_timings_from_before_the_launch_benchmark_keep_the_defaults():
    profile = build_profile(get_hardware("cpu"), _raw(None))
    assert profile.op_launch_s is None and profile.op_launch_seconds == DEFAULT_OP_LAUNCH_S
    assert profile.moe_layer_host_s is None and profile.recompute_region_s is None


@pytest.mark.parametrize("path", sorted(glob.glob(str(RESULTS / "*calibrated*.json"))))
def test_stored_profile_files_still_load(path):
    try:
        profile = load_profile(path)
    except FoldtuneError:
        pytest.skip("not a profile file (an accuracy result)")
    assert isinstance(profile, HardwareProfile)
    assert profile.op_launch_seconds > 0 and profile.collective_launch_seconds > 0


@pytest.mark.parametrize("bad", [0.0, -1e-6, float("nan"), float("inf")])
def test_launch_costs_must_be_positive_finite(bad):
    with pytest.raises(FoldtuneError):
        replace(get_hardware("cpu"), op_launch_s=bad)
