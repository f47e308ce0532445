"""The offload microbenchmarks (executor/microbench/offload.py) and their place in a calibrated profile."""

from __future__ import annotations

import math

import pytest
import torch

from costmodel.calibrate.profile_builder import build_profile
from executor.microbench.offload import measure_cpu_adam, measure_host_link
from executor.microbench.runner import _merged_offload
from spec.catalog import get_hardware
from spec.hardware import DEFAULT_CPU_ADAM_BANDWIDTH, DEFAULT_HOST_LINK_BANDWIDTH
from spec.profile_io import load_profile, save_profile

RAW = {"precision": "bf16", "copy": [], "gemm": [], "grouped_gemm": [], "collectives": [],
       "measured_at": "2026-11-27T03:00:00+00:00", "ranks": 2, "device_name": "NVIDIA H100", "backend": "nccl"}


def test_cpu_adam_steps_state_at_a_finite_rate_and_cpu_has_no_host_link():
    row = measure_cpu_adam(elements=1 << 16, repeats=2)
    assert row["elements"] == 1 << 16 and row["seconds"] > 0
    assert math.isfinite(row["cpu_adam_bytes_per_s"])
    assert row["cpu_adam_bytes_per_s"] == 12 * row["elements"] / row["seconds"]
    assert row["pinned"] is False  # no GPU: pageable buffers, as the executor's CPU ranks have
    with pytest.raises(ValueError, match="need a GPU rank"):
        measure_cpu_adam(elements=1 << 10, device=torch.device("cpu"), pinned=True)
    assert measure_host_link(torch.device("cpu")) is None


def test_ranks_merge_to_the_slowest_and_the_profile_carries_them(tmp_path):
    def rank(d2h, h2d, adam):
        return {"link": {"bytes": 1, "d2h_bytes_per_s": d2h, "h2d_bytes_per_s": h2d,
                         "host_link_bytes_per_s": min(d2h, h2d)},
                "cpu_adam": {"elements": 1, "seconds": 1.0, "cpu_adam_bytes_per_s": adam}}
    merged = _merged_offload([rank(50e9, 52e9, 8e9), rank(45e9, 53e9, 9e9), None])
    assert merged["link"]["host_link_bytes_per_s"] == 45e9 and merged["cpu_adam"]["cpu_adam_bytes_per_s"] == 8e9
    assert _merged_offload([None, None]) is None
    base = get_hardware("h100-sxm")
    profile = build_profile(base, {**RAW, "offload": merged})
    assert (profile.host_link_bandwidth, profile.cpu_adam_bandwidth) == (45e9, 8e9)
    assert profile.host_link_bytes_per_s == 45e9 and profile.cpu_adam_bytes_per_s == 8e9
    assert load_profile(save_profile(profile, tmp_path / "p.json")) == profile
    # a CPU calibration (no host link) and an older raw file keep the base's figures
    cpu_only = build_profile(base, {**RAW, "offload": {"link": None, "cpu_adam": merged["cpu_adam"]}})
    assert cpu_only.host_link_bandwidth is None and cpu_only.host_link_bytes_per_s == DEFAULT_HOST_LINK_BANDWIDTH
    older = build_profile(base, RAW)
    assert older.cpu_adam_bandwidth is None and older.cpu_adam_bytes_per_s == DEFAULT_CPU_ADAM_BANDWIDTH
