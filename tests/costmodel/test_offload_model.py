"""Offload in the memory and time models: hand-worked bytes and seconds (costmodel/memory.py, step_time.py)."""

from __future__ import annotations

import dataclasses

import pytest

from costmodel.memory import estimate_memory, offloaded_layer_bytes, peak_memory_bytes
from costmodel.step_time import activation_offload_seconds, estimate_step_time, optimizer_offload_seconds
from spec import ClusterSpec, TrainingSpec, get_hardware
from spec.catalog import get_model
from spec.hardware import DEFAULT_CPU_ADAM_BANDWIDTH, DEFAULT_HOST_LINK_BANDWIDTH, HardwareProfile
from spec.parallel_config import ParallelConfig

TINY = get_model("tiny-moe")
MIXTRAL = get_model("mixtral-8x7b")
TRAINING = TrainingSpec(seq_length=64, global_batch_size=8)


def _cluster(world: int = 2, **profile) -> ClusterSpec:
    hardware = dataclasses.replace(get_hardware("h100-sxm"), **profile)
    return ClusterSpec(hardware, world)


@pytest.mark.parametrize("world", [1, 2])
def test_offloaded_optimizer_state_leaves_the_gpu_total_and_is_named(world):
    cluster = _cluster(world)
    base = ParallelConfig(world_size=world, ep=world)
    plain = estimate_memory(TINY, TRAINING, cluster, base)
    half = estimate_memory(TINY, TRAINING, cluster, base.replace(optimizer_cpu_offload_fraction=0.5))
    full = estimate_memory(TINY, TRAINING, cluster, base.replace(optimizer_cpu_offload_fraction=1.0))
    states = plain.detail("optimizer.dense") + plain.detail("optimizer.expert")  # 12 B per local element
    kept = plain.detail("optimizer.reduced_grad_shards")  # the reduce-scatter output stays on the GPU
    assert (kept > 0) == (world > 1)
    assert plain.optimizer == pytest.approx(states + kept)
    assert half.optimizer == pytest.approx(states / 2 + kept)
    assert full.optimizer == pytest.approx(kept)
    assert (plain.host_offloaded, half.host_offloaded, full.host_offloaded) == pytest.approx((0, states / 2, states))
    for b, f in ((half, 0.5), (full, 1.0)):
        assert b.total == pytest.approx(plain.total - f * states)
        assert sum(v for _, v in b.details) == pytest.approx(b.total, rel=1e-12)
        assert peak_memory_bytes(TINY, TRAINING, cluster, base.replace(optimizer_cpu_offload_fraction=f)) == \
            pytest.approx(b.total, rel=1e-12)


def test_offloaded_activations_are_the_modules_stored_tensors():
    training = TrainingSpec(seq_length=4096, global_batch_size=8)
    cluster = _cluster(8)
    base = ParallelConfig(world_size=8, ep=4, pp=2)
    cfg = base.replace(activation_offload_modules=("moe",))
    plain, off = estimate_memory(MIXTRAL, training, cluster, base), estimate_memory(MIXTRAL, training, cluster, cfg)
    dense, moe = offloaded_layer_bytes(MIXTRAL, training, cfg)
    assert dense == 0  # Mixtral has no dense layer; 'moe' names MoE-block tensors only
    stored = {name: v for name, v in plain.details if name.startswith("act.moe.")}
    dropped = sum(v for name, v in stored.items() if name not in dict(off.details))
    assert dropped > 0
    assert plain.activations - off.activations == pytest.approx(dropped)
    assert off.host_offloaded == pytest.approx(dropped)
    # per layer and micro-batch: 16 layers on a rank of pp 2; dp 4 gives m = 2 micro-batches, of which
    # min(pp - stage, m) are in flight
    in_flight = min(2 - off.stage, 2)
    assert dropped == pytest.approx(moe * 16 * in_flight)


def test_optimizer_offload_seconds_hand_worked():
    hw = dataclasses.replace(get_hardware("h100-sxm"), host_link_bandwidth=50e9, cpu_adam_bandwidth=6e9)
    # 1e9 elements, half on the CPU: D2H 0.5e9·4 B / 50 GB/s = 0.04 s; CPU 0.5e9·12 B / 6 GB/s = 1 s beside the
    # GPU's half of 0.2 s (0.1 s); H2D 0.5e9·2 B / 50 GB/s = 0.02 s
    assert optimizer_offload_seconds(1e9, 0.5, 0.2, 2, hw) == pytest.approx(0.04 + 1.0 + 0.02)
    # a fast CPU: the GPU's share is the longer one
    fast = dataclasses.replace(hw, cpu_adam_bandwidth=600e9)
    assert optimizer_offload_seconds(1e9, 0.5, 0.2, 2, fast) == pytest.approx(0.04 + 0.1 + 0.02)


def test_offload_prices_use_the_datasheet_and_assumed_defaults():
    hw = get_hardware("h100-sxm")
    assert hw.host_link_bandwidth is None and hw.host_link_bytes_per_s == DEFAULT_HOST_LINK_BANDWIDTH == 55e9
    assert hw.cpu_adam_bytes_per_s == DEFAULT_CPU_ADAM_BANDWIDTH
    measured = dataclasses.replace(hw, host_link_bandwidth=40e9, cpu_adam_bandwidth=9e9)
    assert HardwareProfile.from_dict(measured.to_dict()) == measured
    assert "host_link_bandwidth" not in hw.to_dict()  # unmeasured profiles keep their old form


def test_step_time_adds_the_offload_seconds_to_the_optimizer_term():
    training = TrainingSpec(seq_length=4096, global_batch_size=64)
    cluster = _cluster(64, host_link_bandwidth=50e9, cpu_adam_bandwidth=4e9)
    base = ParallelConfig(world_size=64, tp=2, ep=8, pp=4)
    plain = estimate_step_time(MIXTRAL, training, cluster, base)
    off = estimate_step_time(MIXTRAL, training, cluster, base.replace(optimizer_cpu_offload_fraction=1.0))
    before, after = dict(plain.terms), dict(off.terms)
    # F = 1: the whole device step is replaced by D2H (4 B) + CPU Adam (12 B) + H2D (2 B) per optimizer element
    # of the rank, as many as the memory model's 12-byte states hold (up to the few hundred elements of the
    # small tensors the two models count differently)
    mem = estimate_memory(MIXTRAL, training, cluster, base)
    local = (mem.detail("optimizer.dense") + mem.detail("optimizer.expert")) / 12
    assert after["optimizer"] == pytest.approx(local * (4 / 50e9 + 12 / 4e9 + 2 / 50e9), rel=1e-5)
    assert off.step_time - plain.step_time == pytest.approx(after["optimizer"] - before["optimizer"], rel=1e-9)


def test_activation_offload_seconds_hand_worked():
    cfg = ParallelConfig(world_size=8, ep=8, activation_offload_modules=("moe",))
    training = TrainingSpec(seq_length=4096, global_batch_size=8)
    cluster = _cluster(8, host_link_bandwidth=10e9)
    _, moe = offloaded_layer_bytes(MIXTRAL, training, cfg)
    copy = moe / 10e9
    # forward copy hidden behind a longer forward: only the backward reload is exposed
    assert activation_offload_seconds(MIXTRAL, training, cluster, cfg, 0, 3, 0.0, copy * 2) == pytest.approx(3 * copy)
    # a forward shorter than the copy: the rest of the copy shows too
    assert activation_offload_seconds(MIXTRAL, training, cluster, cfg, 0, 3, 0.0, copy / 4) == \
        pytest.approx(3 * (copy * 3 / 4 + copy))
    plain = estimate_step_time(MIXTRAL, training, cluster, cfg.replace(activation_offload_modules=()))
    off = estimate_step_time(MIXTRAL, training, cluster, cfg)
    assert dict(off.terms)["memory_bound"] > dict(plain.terms)["memory_bound"]
    assert dict(off.terms)["optimizer"] == dict(plain.terms)["optimizer"]
