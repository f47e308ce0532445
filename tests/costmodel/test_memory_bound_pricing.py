"""Memory-bound ops priced per op class from measured curves: the benchmark's rows -> curve points with the
time model's byte counts, memory_time on a curve, the profile fields, and the step terms they move."""

from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.calibrate.memory_bound import curve_point, forward_bytes, memory_bound_curves
from costmodel.calibrate.profile_builder import build_profile
from costmodel.compute import KERNEL_OVERHEAD_S, compute_rates, memory_time
from costmodel.step_time import estimate_step_time
from executor.microbench.runner import merge_ranks
from spec.catalog import get_hardware, get_model
from spec.errors import SpecError
from spec.hardware import ClusterSpec, HardwareProfile, MeasuredCurve
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

CPU = get_hardware("cpu")  # datasheet 10 GB/s


def _row(op: str, rows: int, width: int, seconds: float, copies: int = 1, elem_bytes: int = 4) -> dict:
    return {"op": op, "rows": rows, "width": width, "copies": copies, "elem_bytes": elem_bytes, "seconds": seconds}


def test_forward_bytes_are_the_time_models_per_class():
    # 256 rows x 64 wide fp32: 65,536 bytes a tensor
    assert forward_bytes(_row("norm", 256, 64, 1.0)) == 2 * 65536  # read x, write y
    assert forward_bytes(_row("elementwise", 256, 64, 1.0)) == 3 * 65536  # two inputs, one output
    assert forward_bytes(_row("activation", 256, 64, 1.0)) == 3 * 65536  # gate, up -> output of this width
    assert forward_bytes(_row("permute", 256, 64, 1.0, copies=2)) == 3 * 65536  # read once, write 2 copies
    with pytest.raises(ValueError, match="unknown memory-bound op class 'softmax'"):
        forward_bytes(_row("softmax", 256, 64, 1.0))


def test_a_curve_point_is_bytes_per_kernel_and_achieved_over_datasheet():
    # norm 256x64 fp32 in 100 us forward + backward: the model books 2 x 65,536 forward and 2x that backward,
    # 393,216 bytes in two kernels -> 196,608 a kernel at 393,216 B / 1e-4 s = 3.93 GB/s, 0.393 of 10 GB/s
    x, eff = curve_point(_row("norm", 256, 64, 1e-4), 10e9)
    assert x == 196608 and eff == pytest.approx(0.393216)


def test_memory_time_reads_the_class_curve_with_a_floor_below_the_smallest_size():
    curve = MeasuredCurve(((1e5, 0.1), (1e7, 0.5)))
    hw = replace(CPU, name="cpu-curves", memory_bound_efficiency={"norm": curve})
    rates = compute_rates(hw, "fp32")
    # 2e7 bytes in 2 kernels: 1e7 a kernel, 0.5 x 10 GB/s -> 2 ms each
    assert memory_time(rates, 2e7, 2, "norm") == pytest.approx(4e-3)
    # 1 kB in one kernel is below the smallest measured (1e5 B at 0.1 x 10 GB/s): that size's 100 us
    assert memory_time(rates, 1e3, 1, "norm") == pytest.approx(1e-4)
    # no kernel of its own: the bytes at the largest measured kernels' bandwidth
    assert memory_time(rates, 5e9, 0, "norm") == pytest.approx(1.0)
    # a class not measured takes the 'elementwise' curve, and with that missing the first measured one
    assert memory_time(rates, 2e7, 2, "activation") == pytest.approx(4e-3)


def test_without_curves_memory_time_is_the_copy_bandwidth_plus_a_fixed_overhead():
    hw = replace(CPU, name="cpu-copy", hbm_efficiency=0.8)
    rates = compute_rates(hw, "fp32")
    assert memory_time(rates, 8e6, 2, "norm") == pytest.approx(8e6 / 8e9 + 2 * KERNEL_OVERHEAD_S)


def test_the_profile_builds_one_curve_per_class_and_round_trips():
    rows = [_row("norm", 256, 64, 1e-4), _row("norm", 8192, 256, 4e-2),
            _row("permute", 256, 64, 5e-5, copies=2), _row("permute", 8192, 256, 2e-2, copies=2)]
    raw = {"precision": "fp32", "gemm": [], "grouped_gemm": [], "copy": [], "collectives": [], "ranks": 4,
           "device_name": "cpu", "backend": "gloo", "measured_at": "2026-12-02T08:00:00+00:00", "memory_bound": rows}
    profile = build_profile(CPU, raw)
    curves = dict(profile.memory_bound_efficiency)
    assert set(curves) == {"norm", "permute"}
    assert curves["norm"].points[0] == (196608.0, pytest.approx(0.393216))
    # the large norm: 2 x 8192 x 256 x 4 = 16,777,216 B forward, x3 booked = 50,331,648 in 40 ms = 0.126 of 10 GB/s
    assert curves["norm"].points[1] == (25165824.0, pytest.approx(50331648 / 4e-2 / 10e9))
    assert HardwareProfile.from_dict(profile.to_dict()) == profile
    # a raw file without the benchmark keeps the base's curves
    again = build_profile(profile, {**raw, "memory_bound": []})
    assert again.memory_bound_efficiency == profile.memory_bound_efficiency


def test_a_profile_refuses_an_unknown_op_class():
    with pytest.raises(SpecError, match="memory_bound_efficiency keys must be memory-bound op classes"):
        replace(CPU, memory_bound_efficiency={"softmax": MeasuredCurve(((1.0, 0.5),))})


def test_ranks_merge_to_the_median_seconds():
    def report(seconds: float) -> dict:
        return {"device_name": "cpu", "gemm": [], "grouped_gemm": [], "copy": [], "collectives": [],
                "launch": {"op_launch_s": 1e-6, "collective_launch_s": None, "moe_layer_host_s": None},
                "memory_bound": [_row("norm", 256, 64, seconds)]}
    merged = merge_ranks([report(1e-4), report(3e-4), report(2e-4)])
    assert merged["memory_bound"] == [_row("norm", 256, 64, 2e-4)]


def test_measured_classes_price_the_steps_memory_bound_term():
    """tiny-moe on one rank: a slower norm curve raises the memory-bound term by exactly what its norm kernels
    cost more, every one of them priced at the curve's floor (all smaller than its one measured size)."""
    model, training = get_model("tiny-moe"), TrainingSpec(seq_length=64, global_batch_size=4, precision="fp32")
    config = ParallelConfig(world_size=1, micro_batch_size=4)

    def memory_term(norm_eff: float) -> float:
        # every kernel of tiny-moe at seq 64 x mbs 4 moves less than 1e8 bytes: all at the floor's efficiency
        curves = {"elementwise": MeasuredCurve(((1e8, 1.0),)), "norm": MeasuredCurve(((1e8, norm_eff),))}
        hw = replace(CPU, name=f"cpu-norm-{norm_eff}", memory_bound_efficiency=curves)
        return dict(estimate_step_time(model, training, ClusterSpec(hw, 1), config).terms)["memory_bound"]

    # each norm kernel is priced at the floor: 1e8 B / (eff x 10 GB/s), 10 ms at eff 1, 20 ms at eff 0.5; the
    # difference is 10 ms per norm kernel: 2 layers x 2 norms + the final norm, forward and backward = 10 kernels
    assert memory_term(0.5) - memory_term(1.0) == pytest.approx(10 * 1e-2, rel=1e-9)
