"""Component calibration on CPU: the executor's blocks timed at tiny-moe shapes, and (with
costmodel.calibrate.component_factors) the per-term factors that spread each component's measured/predicted ratio so
that the corrected pass sums to the measured one."""

from __future__ import annotations

import math

import pytest

from spec.catalog import get_hardware, get_model
from costmodel.calibrate.component_factors import FACTOR_TERMS, ComponentTime, build_report, term_factors
from executor.microbench.components import measure_components


@pytest.fixture(scope="module")
def report():
    spec = get_model("tiny-moe")
    device, measured, timing = measure_components(spec, 32, 2, "fp32", "cpu", optimizer_params=4096)
    assert device == "cpu"
    return build_report(spec, 32, 2, "fp32", device, measured, get_hardware("cpu"), timing)


def test_every_component_has_a_positive_finite_time_and_prediction(report):
    names = [c.name for c in report.components]
    assert names == ["attention", "moe", "head", "optimizer"]  # tiny-moe has no dense layer
    for c in report.components:
        assert math.isfinite(c.measured_s) and c.measured_s > 0
        assert c.predicted_s == pytest.approx(sum(c.predicted_terms.values())) and c.predicted_s > 0
    assert report.counts["attention"] == 2 and report.counts["moe"] == 2 and report.counts["dense_mlp"] == 0
    assert set(report.factors) == set(FACTOR_TERMS)
    assert all(math.isfinite(f) and f > 0 for f in report.factors.values())
    assert report.key == "tiny-moe@seq32@mbs2"
    # on the CPU every component is wall clock (synchronous ops), and the report says so for each
    assert report.timing == {name: "wall clock" for name in names}
    assert report.to_dict()["timing"] == report.timing


def test_factors_reproduce_the_measured_pass(report):
    layer_parts = [c for c in report.components if c.name != "optimizer"]
    corrected = sum(report.counts[c.name] * report.factors[t] * s
                    for c in layer_parts for t, s in c.predicted_terms.items())
    measured = sum(report.counts[c.name] * c.measured_s for c in layer_parts)
    assert corrected == pytest.approx(measured)
    moe = next(c for c in report.components if c.name == "moe")
    assert report.factors["grouped_gemm"] == pytest.approx(moe.ratio)  # only the MoE block predicts it
    opt = report.components[-1]
    assert report.factors["optimizer"] == pytest.approx(opt.ratio)


def test_term_factor_is_the_seconds_weighted_ratio():
    a = ComponentTime("a", 3.0, 2.0, {"gemm": 1.0, "memory_bound": 1.0})  # ratio 1.5
    b = ComponentTime("b", 1.0, 2.0, {"gemm": 2.0})  # ratio 0.5
    f = term_factors([a, b], {"a": 2, "b": 1})
    assert f == {"gemm": pytest.approx((2 * 1.5 * 1.0 + 0.5 * 2.0) / (2 * 1.0 + 2.0)), "memory_bound": 1.5}
