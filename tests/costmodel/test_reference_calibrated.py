"""costmodel.reference.calibrated / tables: calibrated compute fractions replace the datasheet's, the network stays."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from costmodel.reference import calibrated, tables
from spec.catalog import get_hardware
from spec.hardware import MeasuredCurve

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "reference.json"
if not REFERENCE.exists():
    pytest.skip("tests/data/reference.json not present", allow_module_level=True)


def test_calibrated_profile_takes_compute_fractions_only():
    h100 = get_hardware("h100-sxm")
    measured = replace(get_hardware("h200"), name="m", gemm_efficiency=MeasuredCurve(((1e9, 0.3), (1e12, 0.6))),
                       hbm_efficiency=0.8, overlap_slowdown=0.25, op_launch_s=1e-5, sustained_clock_factor=0.9,
                       attention_fwd_efficiency=MeasuredCurve(((256.0, 0.2), (8192.0, 0.6))),
                       attention_bwd_efficiency=MeasuredCurve(((256.0, 0.1), (8192.0, 0.5))),
                       gemm_bwd_efficiency=MeasuredCurve(((1e9, 0.2), (1e12, 0.5))),
                       intra_node_bandwidth=1.0, collective_efficiency={})
    cal = calibrated(h100, measured)
    assert cal.gemm_efficiency == measured.gemm_efficiency and cal.hbm_efficiency == 0.8
    assert cal.gemm_bwd_efficiency == measured.gemm_bwd_efficiency
    assert (cal.attention_fwd_efficiency, cal.attention_bwd_efficiency) == (measured.attention_fwd_efficiency,
                                                                            measured.attention_bwd_efficiency)
    assert cal.overlap_slowdown == 0.25 and cal.sustained_clock_factor == 0.9
    assert cal.gpu == h100.gpu and cal.intra_node_bandwidth == h100.intra_node_bandwidth  # datasheet network
    assert cal.op_launch_s == h100.op_launch_s  # the executor's host figures do not describe Megatron


def test_a_slower_fp8_gemm_curve_lowers_predicted_nemo_throughput():
    slow = replace(get_hardware("h200"), name="slow-fp8", gemm_efficiency=MeasuredCurve(((1e9, 0.2), (1e13, 0.4))))
    result = tables(json.loads(REFERENCE.read_text()), None, slow)
    assert [t["title"].split(",")[0] for t in result] == ["NeMo 24.07 fp8 H100 dense", "Korthikanti 2022 A100 fp16",
                                                          "Megatron MoE layer 8xH100 TP1 EP8"]
    nemo = result[0]
    assert all(c[1] < d[1] for d, c in zip(nemo["datasheet"], nemo["calibrated"]))  # every row predicted slower
    assert result[1]["calibrated"] is None  # no A100 calibration
