"""costmodel.calibrate.host_factors: the host probe's seconds against the model's host floor."""

import pytest

from costmodel.calibrate.host_factors import (DEVICE_BOUND_MARGIN, MIN_RECOMPUTE_SHARE, HostProbe, device_seconds,
                                              host_factors)
from costmodel.step_time import HOST_FACTOR, HOST_RECOMPUTE_FACTOR, host_seconds_per_micro_batch
from spec.catalog import get_hardware, get_model
from spec.hardware import ClusterSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec


def _floor(spec, hardware, recompute: str):
    training = TrainingSpec(seq_length=256, global_batch_size=1, precision="bf16")
    return host_seconds_per_micro_batch(spec, training, ClusterSpec(hardware, 1),
                                        ParallelConfig(world_size=1, recompute_granularity=recompute))


def test_factors_are_measured_over_predicted_hand_worked():
    spec, hw = get_model("deepseek-v2-lite").with_layers(2), get_hardware("h200")
    base, _ = _floor(spec, hw, "none")
    _, extra = _floor(spec, hw, "full")
    probe = HostProbe(256, 1, base_s=2.5 * base, full_s=2.5 * base + 4.0 * extra)
    f = host_factors(spec, probe, "bf16", hw)
    assert f[HOST_FACTOR] == pytest.approx(2.5)
    assert f[HOST_RECOMPUTE_FACTOR] == pytest.approx(4.0)


def test_no_recompute_factor_from_an_increment_inside_the_noise():
    spec, hw = get_model("qwen3-30b-a3b").with_layers(2), get_hardware("h200")
    floor, _ = _floor(spec, hw, "none")
    base = 2 * device_seconds(spec, HostProbe(256, 1, 1.0, 1.0), "bf16", hw)[1]  # clear of the device
    # full recomputation measured no slower (or slower by under 2 % of the base): nothing to learn from it
    for full in (0.5 * base, 1.01 * base):
        f = host_factors(spec, HostProbe(256, 1, base, full), "bf16", hw)
        assert f == {HOST_FACTOR: pytest.approx(base / floor)}


def test_a_probe_without_positive_seconds_is_refused():
    spec, hw = get_model("small-moe"), get_hardware("h200")
    with pytest.raises(ValueError, match="must be > 0"):
        host_factors(spec, HostProbe(256, 1, 0.0, 1e-3), "bf16", hw)


def test_a_device_bound_probe_gives_no_host_factor():
    """Mixtral's probe of 2026-11-27 measured 1.02x the model's device time per micro-batch: the host is hidden
    behind the device there, so nothing is learnt; just above the margin the factor is measured / floor."""
    spec, hw = get_model("mixtral-8x7b").with_layers(2), get_hardware("h200")
    probe = HostProbe(256, 1, base_s=1.0, full_s=1.0)
    device_base, device_full = device_seconds(spec, probe, "bf16", hw)
    assert device_full > device_base > 0
    base, _ = _floor(spec, hw, "none")
    _, extra = _floor(spec, hw, "full")
    hidden = HostProbe(256, 1, base_s=1.02 * device_base, full_s=1.28 * device_full)
    assert host_factors(spec, hidden, "bf16", hw) == {}
    # the base step host-bound, the recomputing one not: only the base factor
    seen = HostProbe(256, 1, base_s=1.35 * device_base, full_s=1.25 * device_full)
    assert seen.full_s > seen.base_s * (1 + MIN_RECOMPUTE_SHARE)
    assert host_factors(spec, seen, "bf16", hw) == {HOST_FACTOR: pytest.approx(1.35 * device_base / base)}
    both = HostProbe(256, 1, base_s=1.5 * device_base, full_s=1.5 * device_base + 2.0 * device_full)
    f = host_factors(spec, both, "bf16", hw)
    assert f[HOST_RECOMPUTE_FACTOR] == pytest.approx((both.full_s - both.base_s) / extra)
    assert DEVICE_BOUND_MARGIN * device_base < both.base_s
