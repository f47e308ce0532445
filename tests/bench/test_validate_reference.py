"""bench/validate_reference.py: calibrated compute fractions replace the datasheet's, the network stays."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench import validate_reference
from spec.catalog import get_hardware
from spec.hardware import MeasuredCurve
from spec.profile_io import save_profile

if not validate_reference.REFERENCE.exists():
    pytest.skip("tests/data/reference.json not present", allow_module_level=True)


def test_calibrated_profile_takes_compute_fractions_only():
    h100 = get_hardware("h100-sxm")
    measured = replace(get_hardware("h200"), name="m", gemm_efficiency=MeasuredCurve(((1e9, 0.3), (1e12, 0.6))),
                       hbm_efficiency=0.8, overlap_slowdown=0.25, op_launch_s=1e-5, sustained_clock_factor=0.9,
                       attention_fwd_efficiency=MeasuredCurve(((256.0, 0.2), (8192.0, 0.6))),
                       attention_bwd_efficiency=MeasuredCurve(((256.0, 0.1), (8192.0, 0.5))),
                       gemm_bwd_efficiency=MeasuredCurve(((1e9, 0.2), (1e12, 0.5))),
                       intra_node_bandwidth=1.0, collective_efficiency={})
    cal = validate_reference.calibrated(h100, measured)
    assert cal.gemm_efficiency == measured.gemm_efficiency and cal.hbm_efficiency == 0.8
    assert cal.gemm_bwd_efficiency == measured.gemm_bwd_efficiency
    assert (cal.attention_fwd_efficiency, cal.attention_bwd_efficiency) == (measured.attention_fwd_efficiency,
                                                                            measured.attention_bwd_efficiency)
    assert cal.overlap_slowdown == 0.25 and cal.sustained_clock_factor == 0.9
    assert cal.gpu == h100.gpu and cal.intra_node_bandwidth == h100.intra_node_bandwidth  # datasheet network
    assert cal.op_launch_s == h100.op_launch_s  # the executor's host figures do not describe Megatron


def test_a_slower_fp8_gemm_curve_lowers_predicted_nemo_throughput(tmp_path, capsys):
    slow = replace(get_hardware("h200"), name="slow-fp8", gemm_efficiency=MeasuredCurve(((1e9, 0.2), (1e13, 0.4))))
    path = save_profile(slow, tmp_path / "fp8.json")
    assert validate_reference.main(["--fp8", str(path), "--no-write"]) == 0
    out = capsys.readouterr().out
    assert "NeMo 24.07 fp8 H100 dense" in out and "Korthikanti" in out and "Megatron MoE layer" in out
    ref = validate_reference.json.loads(validate_reference.REFERENCE.read_text())
    result = validate_reference.tables(ref, None, slow)
    nemo = result[0]
    assert all(c[1] < d[1] for d, c in zip(nemo["datasheet"], nemo["calibrated"]))  # every row predicted slower
    assert result[1]["calibrated"] is None  # no A100 calibration
