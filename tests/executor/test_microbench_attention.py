"""The attention microbenchmark, its curves in the profile, and the time model pricing with them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from spec.catalog import get_hardware
from costmodel.compute import KERNEL_OVERHEAD_S, attention_time, compute_rates
from spec.flops import attention_fwd_flops
from spec.hardware import HardwareProfile, MeasuredCurve
from executor.microbench.attention import measure_attention
from costmodel.calibrate.profile_builder import attention_curves, build_profile

H100 = get_hardware("h100-sxm")


def test_attention_fwd_flops_hand_worked():
    # 1024 queries x 1024 keys x 8 heads x (64 + 64) x 2, halved by the mask; 2048 x 4096 keys, no mask
    assert attention_fwd_flops(1024, 1024, 8, 64, 64) == 2.0 * 1024 * 1024 * 8 * 128 / 2
    assert attention_fwd_flops(2048, 4096, 4, 128, 64, causal=False) == 2.0 * 2048 * 4096 * 4 * 192


def test_measure_attention_on_cpu_times_forward_and_backward():
    rows = measure_attention((64, 128), torch.device("cpu"), torch.float32, repeats=1)
    assert [r["seq"] for r in rows] == [64, 128]
    for r in rows:
        assert r["fwd_seconds"] > 0 and r["bwd_seconds"] > 0
        assert r["fwd_flops"] == 2.0 * r["batch"] * r["seq"] ** 2 * r["heads"] * 2 * r["head_dim"] / 2
        assert r["bwd_flops"] == 2.5 * r["fwd_flops"]


def test_attention_curves_are_achieved_over_the_bf16_peak():
    rows = [{"seq": 1024, "fwd_flops": 4e11, "bwd_flops": 1e12, "fwd_seconds": 1e-3, "bwd_seconds": 4e-3},
            {"seq": 4096, "fwd_flops": 8e11, "bwd_flops": 2e12, "fwd_seconds": 1e-3, "bwd_seconds": 4e-3}]
    fwd, bwd = attention_curves(rows, 1e15)
    assert fwd.points == ((1024.0, 0.4), (4096.0, 0.8)) and bwd.points == ((1024.0, 0.25), (4096.0, 0.5))
    raw = {"precision": "bf16", "gemm": [], "grouped_gemm": [], "copy": [], "collectives": [], "attention": rows,
           "ranks": 1, "device_name": "gpu", "backend": "nccl", "measured_at": "2026-11-26T10:30:00+00:00"}
    profile = build_profile(H100, raw)
    assert profile.attention_fwd_efficiency.points[0] == pytest.approx((1024.0, 4e11 / 1e-3 / H100.gpu.peak("bf16")))
    assert HardwareProfile.from_dict(profile.to_dict()) == profile  # the curves survive the JSON round trip


def test_measured_attention_curves_replace_the_default_efficiencies():
    # one call over 4096 keys: forward FLOPs 2·4096·4096·32·256/2, at the curves' 0.5 forward and 0.4 backward
    cal = replace(H100, attention_fwd_efficiency=MeasuredCurve(((1024.0, 0.3), (4096.0, 0.5))),
                  attention_bwd_efficiency=MeasuredCurve(((1024.0, 0.2), (4096.0, 0.4))))
    rates = compute_rates(cal, "bf16")
    fwd, bwd = attention_time(rates, 4096, 4096, 32, 128, 128, True, True)
    flops = 2.0 * 4096 * 4096 * 32 * 256 / 2
    peak = H100.gpu.peak("bf16")
    assert fwd == pytest.approx(flops / (peak * 0.5) + KERNEL_OVERHEAD_S)
    assert bwd == pytest.approx(2.5 * flops / (peak * 0.4) + KERNEL_OVERHEAD_S)
    # CP2: two calls over blocks of 2048 keys each, priced at the curves' value at 2048 (the block, not 4096)
    fwd2, _ = attention_time(rates, 4096, 4096, 32, 128, 128, True, True, steps=2)
    eff = cal.attention_fwd_efficiency(2048.0)
    assert 0.3 < eff < 0.5 and fwd2 == pytest.approx(flops / (peak * eff) + 2 * KERNEL_OVERHEAD_S)
    # the same attention on a profile without the curves uses the defaults, which differ
    assert attention_time(compute_rates(H100, "bf16"), 4096, 4096, 32, 128, 128, True, True)[0] != pytest.approx(fwd)


def test_ranks_attention_seconds_merge_as_their_median():
    from executor.microbench.runner import merge_ranks

    def rank(fwd: float, bwd: float) -> dict:
        return {"device_name": "gpu", "gemm": [], "grouped_gemm": [], "copy": [], "collectives": [],
                "launch": {"op_launch_s": 1e-5, "collective_launch_s": None, "moe_layer_host_s": None},
                "attention": [{"seq": 1024, "fwd_flops": 4e11, "bwd_flops": 1e12, "fwd_seconds": fwd,
                               "bwd_seconds": bwd}]}

    # a slow rank (straggler) and a fast one: the median rank's seconds, not the max or the mean
    merged = merge_ranks([rank(1e-3, 9e-3), rank(4e-3, 3e-3), rank(2e-3, 4e-3)])["attention"]
    assert merged == [{"seq": 1024, "fwd_flops": 4e11, "bwd_flops": 1e12, "fwd_seconds": 2e-3, "bwd_seconds": 4e-3}]
    assert merge_ranks([{**rank(1e-3, 1e-3), "attention": []}])["attention"] == []


def test_measure_attention_mla_shape_has_wider_query_key_heads():
    rows = measure_attention((64,), torch.device("cpu"), torch.float32, repeats=1, kind="mla")
    (r,) = rows
    assert r["kind"] == "mla" and r["head_dim"] > r["v_head_dim"]
    # 2·q·k·heads·(qk + v), halved by the mask
    assert r["fwd_flops"] == 2.0 * r["batch"] * 64 * 64 * r["heads"] * (r["head_dim"] + r["v_head_dim"]) / 2
    assert r["fwd_seconds"] > 0 and r["bwd_seconds"] > 0


def test_mla_rows_make_their_own_curves_and_price_mla_attention_only():
    # the same key length measured for both head shapes: MLA's kernel at a fifth of the flash kernel's speed
    mha = {"kind": "mha", "seq": 4096, "fwd_flops": 5e11, "bwd_flops": 1.25e12, "fwd_seconds": 1e-3,
           "bwd_seconds": 4e-3}
    mla = {**mha, "kind": "mla", "fwd_seconds": 5e-3, "bwd_seconds": 20e-3}
    old = {k: v for k, v in mha.items() if k != "kind"}  # a profile measured before the MLA shape: 'mha'
    assert attention_curves([old, mla], 1e15)[0].points == ((4096.0, 0.5),)
    fwd, bwd = attention_curves([mha, mla], 1e15, "mla")
    assert fwd.points == ((4096.0, 0.1),) and bwd.points == ((4096.0, 0.0625),)
    raw = {"precision": "bf16", "gemm": [], "grouped_gemm": [], "copy": [], "collectives": [],
           "attention": [mha, mla], "ranks": 1, "device_name": "gpu", "backend": "nccl",
           "measured_at": "2026-11-27T03:00:00+00:00"}
    profile = build_profile(H100, raw)
    assert HardwareProfile.from_dict(profile.to_dict()) == profile
    rates = compute_rates(profile, "bf16")
    peak = H100.gpu.peak("bf16")
    # DeepSeek-V2's core: 16 heads, query/key 192 wide, values 128: forward FLOPs 2·4096·4096·16·320/2
    flops = 2.0 * 4096 * 4096 * 16 * 320 / 2
    fwd_s, bwd_s = attention_time(rates, 4096, 4096, 16, 192, 128, True, True)
    mla_eff = mla["fwd_flops"] / mla["fwd_seconds"] / peak
    assert fwd_s == pytest.approx(flops / (peak * mla_eff) + KERNEL_OVERHEAD_S)
    # equal widths keep the flash curve: five times faster per FLOP
    flops_mha = 2.0 * 4096 * 4096 * 16 * 256 / 2
    mha_eff = mha["fwd_flops"] / mha["fwd_seconds"] / peak
    assert attention_time(rates, 4096, 4096, 16, 128, 128, True, True)[0] == pytest.approx(
        flops_mha / (peak * mha_eff) + KERNEL_OVERHEAD_S)
