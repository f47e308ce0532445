"""Allocator fragmentation: the measurement (CUDA only), how it reaches the hardware profile and the memory
model that prices with it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from costmodel.calibrate.profile_builder import build_profile
from costmodel.memory import FRAGMENTATION, estimate_memory, peak_memory_bytes
from executor.microbench import fragmentation
from executor.microbench.runner import merge_ranks
from spec import ClusterSpec, ParallelConfig, TrainingSpec, get_hardware, get_model
from spec.errors import SpecError
from spec.hardware import HardwareProfile


def test_fragmentation_is_reserved_over_allocated_minus_one():
    assert fragmentation.fragmentation_from_peaks(1000, 1100) == pytest.approx(0.1)
    assert fragmentation.fragmentation_from_peaks(1000, 1000) == 0.0
    assert fragmentation.fragmentation_from_peaks(0, 10) == 0.0
    assert fragmentation.fragmentation_from_peaks(1000, 900) == 0.0  # never negative
    assert fragmentation.measure_fragmentation(torch.device("cpu")) is None  # no caching allocator on CPU


def test_profile_takes_the_worst_ranks_fragmentation_and_keeps_the_base_when_not_measured():
    base = get_hardware("h100-sxm")
    rank = {"device_name": "gpu", "gemm": [], "grouped_gemm": [], "copy": [], "collectives": [],
            "launch": {"op_launch_s": 1e-5, "collective_launch_s": None, "moe_layer_host_s": None}}
    raw = merge_ranks([{**rank, "fragmentation": {"fragmentation": 0.031}},
                       {**rank, "fragmentation": {"fragmentation": 0.072}}])
    raw.update(precision="bf16", backend="nccl", measured_at="2026-11-26T10:00:00+00:00")
    profile = build_profile(base, raw)
    assert profile.allocator_fragmentation == 0.072
    assert HardwareProfile.from_dict(profile.to_dict()) == profile  # serialised and read back
    raw_cpu = merge_ranks([rank, rank])
    raw_cpu.update(precision="fp32", backend="gloo", measured_at="2026-11-26T10:00:00+00:00")
    assert build_profile(base, raw_cpu).allocator_fragmentation is None
    assert "allocator_fragmentation" not in base.to_dict()  # profiles written before it stay as they were
    with pytest.raises(SpecError, match="allocator_fragmentation"):
        replace(base, allocator_fragmentation=1.5)


def test_memory_model_prices_with_the_measured_fragmentation_hand_worked():
    model, training = get_model("mixtral-8x7b"), TrainingSpec(seq_length=4096, global_batch_size=64)
    cfg = ParallelConfig(world_size=64, tp=2, pp=4, ep=8)
    prior = ClusterSpec(get_hardware("h100-sxm"), 64)
    measured = ClusterSpec(replace(prior.hardware, allocator_fragmentation=0.12), 64)
    a, b = estimate_memory(model, training, prior, cfg), estimate_memory(model, training, measured, cfg)
    dynamic = a.detail("allocator.fragmentation") / FRAGMENTATION
    assert b.detail("allocator.fragmentation") == pytest.approx(0.12 * dynamic, rel=1e-12)
    assert b.total - a.total == pytest.approx((0.12 - FRAGMENTATION) * dynamic, rel=1e-9)
    assert peak_memory_bytes(model, training, measured, cfg) == pytest.approx(b.total, rel=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the caching allocator's peaks need a GPU")
def test_measure_fragmentation_on_a_gpu():
    row = fragmentation.measure_fragmentation(torch.device("cuda", 0), "bf16", seq_length=1024, steps=2)
    assert row["reserved_peak_bytes"] >= row["allocated_peak_bytes"] > 0
    assert 0.0 <= row["fragmentation"] < 1.0
