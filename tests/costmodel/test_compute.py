"""Compute-time primitives against hand-worked figures."""

import math
from dataclasses import replace

import pytest

from spec import MeasuredCurve, get_hardware
from spec.errors import FoldtuneError
from spec.hardware import HardwareProfile
from costmodel.compute import (
    GEMM_EFFICIENCY,
    HBM_EFFICIENCY,
    KERNEL_OVERHEAD_S,
    attention_time,
    compute_rates,
    gemm_fwd_bwd,
    gemm_time,
    grouped_gemm_fwd_bwd,
    grouped_gemm_time,
    memory_time,
    sink_attention_time,
)

H100 = get_hardware("h100-sxm")


def test_default_efficiencies_are_the_microbenchmark_ratios():
    assert GEMM_EFFICIENCY["bf16"] == pytest.approx(783 / 989.4)
    assert GEMM_EFFICIENCY["fp8"] == pytest.approx(1421 / 1978.9)
    assert HBM_EFFICIENCY == pytest.approx(0.875)


def test_single_large_bf16_gemm_is_compute_bound_at_the_ceiling():
    rates = compute_rates(H100, "bf16")
    n = 8192
    # 2·n³ FLOPs at 0.7914 x 989.4 TFLOP/s (= 783 TFLOP/s) plus one kernel's fixed cost
    expected = 2 * n**3 / 783e12 + KERNEL_OVERHEAD_S
    assert gemm_time(rates, n, n, n) == pytest.approx(expected, rel=1e-3)
    fwd, bwd = gemm_fwd_bwd(rates, n, n, n)
    assert bwd == pytest.approx(2 * fwd)


def test_fp8_gemm_uses_the_fp8_peak_and_its_own_efficiency():
    bf16, fp8 = compute_rates(H100, "bf16"), compute_rates(H100, "fp8")
    n = 16384
    ratio = gemm_time(bf16, n, n, n) / gemm_time(fp8, n, n, n)
    assert ratio == pytest.approx(1421 / 783, rel=1e-2)
    # a GEMM kept in 16 bits under fp8 training (the logits) runs at the bf16 rate
    assert gemm_time(fp8, n, n, n, low_precision=False) == pytest.approx(gemm_time(bf16, n, n, n))


def test_fp8_reads_the_bf16_measured_grouped_curves_at_the_measured_fp8_speed_up():
    """A calibrated profile's grouped curves are bf16 kernels' achieved/bf16 peak (an fp8 calibration keeps its
    base's). Under fp8 a grouped GEMM runs (1043 + 1084) / (694 + 678) = 1.55x its bf16 time on the curve —
    not 2x, which reading the curve against the fp8 peak would give — with one curve or per-shape curves."""
    curve = MeasuredCurve(((16.0, 0.2), (4096.0, 0.6)))
    speed_up = (1043 + 1084) / (694 + 678)
    for hw in (replace(H100, grouped_gemm_efficiency=curve),
               replace(H100, grouped_gemm_shape_efficiency=(("4096x14336", curve),))):
        bf16, fp8 = compute_rates(hw, "bf16"), compute_rates(hw, "fp8")
        for tokens in (64.0, 1024.0):
            ratio = grouped_gemm_time(bf16, 8, tokens, 14336, 4096) / grouped_gemm_time(fp8, 8, tokens, 14336, 4096)
            assert ratio == pytest.approx(speed_up)


def test_fp8_expert_backward_prices_dgrad_in_fp8_and_wgrad_in_bf16():
    """The executor's fp8 runs the expert wgrad in bf16: the backward is the fp8 dgrad plus the bf16 wgrad
    (Mixtral's w13 at 1024 tokens per expert, compute-bound: the bf16 half ~1.55 x the fp8 one, the speed-up
    torch._scaled_grouped_mm measured over torch._grouped_mm at these shapes: (1043 + 1084) / (694 + 678))."""
    bf16, fp8 = compute_rates(H100, "bf16"), compute_rates(H100, "fp8")
    args = (8, 1024.0, 28672, 4096)
    fwd, bwd = grouped_gemm_fwd_bwd(fp8, *args, wgrad_rates=bf16)
    dgrad_fp8 = grouped_gemm_time(fp8, 8, 1024.0, 4096, 28672)
    wgrad_bf16 = grouped_gemm_time(bf16, 8, 1024.0, 4096, 28672)
    assert fwd == grouped_gemm_time(fp8, *args)
    assert bwd == pytest.approx(dgrad_fp8 + wgrad_bf16)
    assert wgrad_bf16 / dgrad_fp8 == pytest.approx((1043 + 1084) / (694 + 678), rel=2e-2)
    assert grouped_gemm_fwd_bwd(fp8, *args)[1] == pytest.approx(2 * dgrad_fp8)  # no wgrad_rates: both fp8


def test_skinny_gemm_is_bandwidth_bound_and_efficiency_saturates_with_flops():
    rates = compute_rates(H100, "bf16")
    # 16 rows against a 8192x8192 weight: the weight read dominates
    t = gemm_time(rates, 16, 8192, 8192)
    weight_read = 2 * (16 * 8192 * 2 + 8192 * 8192) / (3.35e12 * 0.875)
    assert t == pytest.approx(weight_read + KERNEL_OVERHEAD_S, rel=1e-2)
    effs = [2 * n**3 / gemm_time(rates, n, n, n) / 989.4e12 for n in (256, 1024, 4096, 16384)]
    assert effs == sorted(effs) and effs[-1] < GEMM_EFFICIENCY["bf16"]


def test_grouped_gemm_efficiency_grows_with_tokens_per_expert():
    rates = compute_rates(H100, "bf16")
    h, f = 4096, 14336

    def eff(tokens):
        return 2 * tokens * h * f * 8 / grouped_gemm_time(rates, 8, tokens, f, h) / 989.4e12

    values = [eff(t) for t in (32, 128, 512, 2048, 8192)]
    assert values == sorted(values)
    assert values[-1] == pytest.approx(755 / 989.4, rel=0.02)  # the grouped-GEMM ceiling
    assert values[0] < 0.2  # 32 tokens per expert: weight-bandwidth bound


def test_measured_curves_replace_the_defaults():
    curve = MeasuredCurve(((1e6, 0.25), (1e12, 0.5)))
    hw = replace(H100, gemm_efficiency=curve, grouped_gemm_efficiency=MeasuredCurve(((1.0, 0.4),)),
                 hbm_efficiency=0.5)
    rates = compute_rates(hw, "bf16")
    flops = 2 * 4096**3
    assert gemm_time(rates, 4096, 4096, 4096) == pytest.approx(flops / (989.4e12 * curve(flops)))
    assert grouped_gemm_time(rates, 4, 100, 512, 256) == pytest.approx(2 * 100 * 512 * 256 * 4 / (989.4e12 * 0.4))
    assert memory_time(rates, 1e9, kernels=0) == pytest.approx(1e9 / (3.35e12 * 0.5))


def test_causal_flash_attention_counts_half_the_scores_and_a_slower_backward():
    rates = compute_rates(H100, "bf16")
    causal = attention_time(rates, 4096, 4096, 32, 128, 128, causal=True)
    full = attention_time(rates, 4096, 4096, 32, 128, 128, causal=False)
    assert causal[0] < full[0] < 2.05 * causal[0]
    # backward: 2.5x the FLOPs at a lower efficiency
    assert causal[1] / causal[0] == pytest.approx(2.5 * 0.60 / 0.45, rel=0.01)
    # attention runs below the GEMM ceiling
    flops = 2 * 4096 * 4096 * 32 * 256 * 0.5
    assert flops / causal[0] / 989.4e12 < GEMM_EFFICIENCY["bf16"]


def test_unfused_attention_pays_for_the_score_matrix():
    rates = compute_rates(H100, "bf16")
    flash = attention_time(rates, 8192, 2048, 16, 128, 128, flash=True)
    unfused = attention_time(rates, 8192, 2048, 16, 128, 128, flash=False, dropout=True)
    assert unfused[0] > flash[0] and unfused[1] > flash[1]


def test_ring_attention_blocks_run_less_efficiently():
    rates = compute_rates(H100, "bf16")
    whole = attention_time(rates, 4096, 4096, 32, 128, 128)
    # CP4: each rank owns a quarter of the queries and meets the keys in four blocks of 1024
    quarter = attention_time(rates, 1024, 4096, 32, 128, 128, steps=4)
    assert 4 * quarter[0] > 1.1 * whole[0] and 4 * quarter[1] > 1.1 * whole[1]


def test_sustained_clock_factor_scales_every_compute_bound_kernel_and_no_memory_bound_one():
    # Curves are timed in bursts; a step runs at the power-limited clock: 0.8 of it makes a compute-bound
    # GEMM, grouped GEMM and attention take 1/0.8 as long, while a copy (HBM clock) keeps its time.
    slow = replace(H100, sustained_clock_factor=0.8)
    for precision in ("bf16", "fp8"):
        fast_r, slow_r = compute_rates(H100, precision), compute_rates(slow, precision)
        assert gemm_time(slow_r, 8192, 8192, 8192) - KERNEL_OVERHEAD_S == pytest.approx(
            (gemm_time(fast_r, 8192, 8192, 8192) - KERNEL_OVERHEAD_S) / 0.8)
        assert gemm_time(slow_r, 8192, 8192, 8192, low_precision=False) - KERNEL_OVERHEAD_S == pytest.approx(
            (gemm_time(fast_r, 8192, 8192, 8192, low_precision=False) - KERNEL_OVERHEAD_S) / 0.8)
        assert grouped_gemm_time(slow_r, 8, 4096, 14336, 4096) - KERNEL_OVERHEAD_S == pytest.approx(
            (grouped_gemm_time(fast_r, 8, 4096, 14336, 4096) - KERNEL_OVERHEAD_S) / 0.8)
        assert memory_time(slow_r, 2**30) == memory_time(fast_r, 2**30)
    # attention runs at the 16-bit peak, with the default efficiencies and with measured (burst) curves alike
    curves = dict(attention_fwd_efficiency=MeasuredCurve(((1024.0, 0.3), (4096.0, 0.5))),
                  attention_bwd_efficiency=MeasuredCurve(((1024.0, 0.2), (4096.0, 0.4))))
    for fast in (H100, replace(H100, **curves)):
        fast_r, slow_r = compute_rates(fast, "bf16"), compute_rates(replace(fast, sustained_clock_factor=0.8), "bf16")
        for f, s in zip(attention_time(fast_r, 4096, 4096, 32, 128, 128, steps=2),
                        attention_time(slow_r, 4096, 4096, 32, 128, 128, steps=2)):
            assert s - 2 * KERNEL_OVERHEAD_S == pytest.approx((f - 2 * KERNEL_OVERHEAD_S) / 0.8)
    # not measured (None) is priced as a clock that holds: the same seconds as a measured factor of 1
    unmeasured, holds = (compute_rates(replace(H100, sustained_clock_factor=v), "bf16") for v in (None, 1.0))
    assert unmeasured is not holds
    assert gemm_time(unmeasured, 8192, 8192, 8192) == gemm_time(holds, 8192, 8192, 8192)
    assert attention_time(unmeasured, 4096, 4096, 32, 128, 128) == attention_time(holds, 4096, 4096, 32, 128, 128)


def test_profiles_written_before_the_sustained_clock_and_attention_curves_still_load():
    old = {k: v for k, v in replace(H100, sustained_clock_factor=0.8).to_dict().items()
           if k not in ("sustained_clock_factor", "attention_fwd_efficiency", "attention_bwd_efficiency",
                        "gemm_bwd_efficiency")}
    loaded = HardwareProfile.from_dict(old)
    assert loaded.sustained_clock_factor is None and loaded.attention_fwd_efficiency is None
    assert compute_rates(loaded, "bf16").bf16_peak == H100.gpu.peak("bf16")
    measured = replace(H100, sustained_clock_factor=0.8)
    assert HardwareProfile.from_dict(measured.to_dict()) == measured
    assert compute_rates(measured, "bf16").bf16_peak == pytest.approx(0.8 * H100.gpu.peak("bf16"))


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.2])
def test_sustained_clock_factor_outside_0_1_is_refused(bad):
    from spec.errors import SpecError

    with pytest.raises(SpecError, match="sustained_clock_factor"):
        replace(H100, sustained_clock_factor=bad)


def test_a_measured_backward_curve_prices_both_backward_gemms_of_a_linear():
    """Forward at 0.8 of the peak, backward measured at 0.4: the input- and weight-gradient GEMMs (twice the
    forward's FLOPs) take 4x the forward. A 16-bit GEMM under fp8 training (the output layer) keeps the
    shape-by-shape forward pricing: the curve was timed in fp8."""
    flat = MeasuredCurve(((1e9, 0.8), (1e13, 0.8)))
    slow_bwd = replace(H100, gemm_efficiency=flat, gemm_bwd_efficiency=MeasuredCurve(((1e9, 0.4), (1e13, 0.4))))
    fwd, bwd = gemm_fwd_bwd(compute_rates(slow_bwd, "bf16"), 4096, 14336, 4096)
    assert fwd == pytest.approx(2 * 4096 * 14336 * 4096 / (H100.gpu.peak("bf16") * 0.8))
    assert bwd == pytest.approx(4 * fwd)
    # without the curve each backward GEMM is a forward of its own shape: here the same flat 0.8
    assert gemm_fwd_bwd(compute_rates(replace(H100, gemm_efficiency=flat), "bf16"), 4096, 14336, 4096)[1] == \
        pytest.approx(2 * fwd)
    fp8 = compute_rates(slow_bwd, "fp8")
    assert gemm_fwd_bwd(fp8, 4096, 32000, 4096, low_precision=False)[1] == pytest.approx(
        gemm_time(fp8, 4096, 4096, 32000, low_precision=False) + gemm_time(fp8, 4096, 32000, 4096, low_precision=False))
    assert gemm_fwd_bwd(fp8, 4096, 14336, 4096)[1] == pytest.approx(
        4 * 4096 * 14336 * 4096 / (H100.gpu.peak("fp8") * 0.4))
    assert HardwareProfile.from_dict(slow_bwd.to_dict()) == slow_bwd


def test_grouped_gemms_read_the_curve_of_the_nearest_measured_expert_shapes():
    """Curves measured at a fine-grained expert (2048 x 768: 1.57 M weights) and a Mixtral one (4096 x 14336:
    58.7 M): each shape prices at its own curve, a DeepSeek-like 7168 x 2048 (14.7 M) between them, linearly
    in log size, and shapes outside the measured range at the nearest end."""
    fine, mixtral = MeasuredCurve(((16.0, 0.05), (4096.0, 0.4))), MeasuredCurve(((16.0, 0.1), (4096.0, 0.7)))
    hw = replace(H100, grouped_gemm_efficiency=mixtral,
                 grouped_gemm_shape_efficiency={"2048x768": fine, "4096x14336": mixtral})
    rates = compute_rates(hw, "bf16")

    def eff(n, k, t=4096):
        return 2.0 * 8 * t * n * k / grouped_gemm_time(rates, 8, t, n, k) / rates.gemm_peak

    assert eff(14336, 4096) == pytest.approx(0.7) and eff(768, 2048) == pytest.approx(0.4)
    frac = (math.log(7168 * 2048) - math.log(2048 * 768)) / (math.log(4096 * 14336) - math.log(2048 * 768))
    assert eff(2048, 7168) == pytest.approx(0.4 + frac * 0.3)
    assert eff(128, 256) == pytest.approx(0.4) and eff(28672, 8192) == pytest.approx(0.7)
    assert eff(768, 2048, t=16) == pytest.approx(0.05)
    # a profile without shape curves keeps the single curve for every shape
    plain = compute_rates(replace(hw, grouped_gemm_shape_efficiency=()), "bf16")
    assert grouped_gemm_time(plain, 8, 4096, 768, 2048) == pytest.approx(
        2.0 * 8 * 4096 * 768 * 2048 / (plain.gemm_peak * 0.7))
    assert HardwareProfile.from_dict(hw.to_dict()) == hw


@pytest.mark.parametrize("key", ["4096", "x768", "4096x", "0x768", "4096x-1", "4096*14336", "²x768", "4096x1²"])
def test_malformed_expert_shape_keys_are_refused(key):
    with pytest.raises(FoldtuneError, match="grouped_gemm_shape_efficiency"):
        replace(H100, grouped_gemm_shape_efficiency={key: MeasuredCurve(((16.0, 0.5),))})


def test_executor_sink_attention_is_fp32_gemms_over_every_pair_plus_passes_over_the_score_matrix():
    # 4096 queries x 4096 keys, 8 heads of 64: each of the two GEMMs 2·4096·4096·8·64 FLOPs at the fp32 peak
    # (no causal skipping); 4096·4097·8 fp32 scores read and written by 4 kernels forward (32 B) and 5 backward
    rates = compute_rates(H100, "bf16")
    fwd, bwd = sink_attention_time(rates, 4096, 4096, 8, 64)
    assert rates.fp32_peak == pytest.approx(66.9e12)
    gemm = 2.0 * 4096 * 4096 * 8 * 64 / (66.9e12 * GEMM_EFFICIENCY["bf16"]) + KERNEL_OVERHEAD_S
    scores = 4096 * 4097 * 8
    assert fwd == pytest.approx(2 * gemm + memory_time(rates, 32 * scores, 4), rel=1e-9)
    assert bwd == pytest.approx(4 * gemm + memory_time(rates, 44 * scores, 5), rel=1e-9)
    # some 30x the causal flash kernel on the same shape
    flash = attention_time(rates, 4096, 4096, 8, 64, 64)
    assert fwd > 20 * flash[0]
