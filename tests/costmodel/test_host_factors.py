"""costmodel.calibrate.host_factors: the host probe's seconds against the model's host floor."""

import pytest

from costmodel.calibrate.host_factors import HostProbe, host_factors
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
    base, _ = _floor(spec, hw, "none")
    # full recomputation measured no slower (or slower by under 2 % of the base): nothing to learn from it
    for full in (0.5 * base, 1.01 * base):
        f = host_factors(spec, HostProbe(256, 1, base, full), "bf16", hw)
        assert f == {HOST_FACTOR: pytest.approx(1.0)}


def test_a_probe_without_positive_seconds_is_refused():
    spec, hw = get_model("small-moe"), get_hardware("h200")
    with pytest.raises(ValueError, match="must be > 0"):
        host_factors(spec, HostProbe(256, 1, 0.0, 1e-3), "bf16", hw)
