"""Interval coverage (planner.accuracy.interval_coverage) worked by hand, and the intervals compare() puts on
every row of a measured layout table."""

from __future__ import annotations

import pytest

from planner.accuracy import compare, interval_coverage
from spec.catalog import get_hardware, get_model
from spec.hardware import ClusterSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec


def test_coverage_worked_by_hand():
    """Five timed rows: 1.0 in [0.9, 1.2] inside; 1.2 in [0.9, 1.2] inside (ends count); 0.8 in [0.9, 1.2] below;
    2.0 in [1.0, 1.5] above; 1.1 in [1.0, 1.5] inside: 3 of 5 = 60 %, one below, one above. Mean relative width
    over predictions 1.0, 1.0, 1.0, 1.2, 1.2: (0.3 x 3 + 0.5 / 1.2 x 2) / 5 = 0.34667. Memory: two rows with a
    peak, 10 in [9, 11] inside, 12 in [9, 11] above: 1 of 2; a row without a measured peak is not judged."""
    rows = [{"measured_s": 1.0, "predicted_s": 1.0, "interval_s": (0.9, 1.2),
             "measured_peak_bytes": 10, "memory_interval_bytes": (9, 11)},
            {"measured_s": 1.2, "predicted_s": 1.0, "interval_s": (0.9, 1.2),
             "measured_peak_bytes": 12, "memory_interval_bytes": (9, 11)},
            {"measured_s": 0.8, "predicted_s": 1.0, "interval_s": (0.9, 1.2), "measured_peak_bytes": None,
             "memory_interval_bytes": (9, 11)},
            {"measured_s": 2.0, "predicted_s": 1.2, "interval_s": (1.0, 1.5)},
            {"measured_s": 1.1, "predicted_s": 1.2, "interval_s": (1.0, 1.5)},
            {"measured_s": 1.1, "predicted_s": 1.2}]  # no interval (an injected model): not judged
    c = interval_coverage(rows)
    assert c["step_time"] == {"rows": 5, "covered": 3, "coverage": 0.6, "below": 1, "above": 1}
    assert c["memory"] == {"rows": 2, "covered": 1, "coverage": 0.5, "below": 0, "above": 1}
    assert c["mean_relative_width"] == pytest.approx((0.3 * 3 + 0.5 / 1.2 * 2) / 5)
    empty = interval_coverage([])
    assert empty["step_time"]["coverage"] is None and empty["mean_relative_width"] is None


def test_compare_puts_the_intervals_on_every_measured_row():
    model, training = get_model("tiny-moe"), TrainingSpec(seq_length=64, global_batch_size=8, precision="fp32")
    cluster = ClusterSpec(get_hardware("cpu"), 2)
    config = ParallelConfig(world_size=2, ep=2)
    table = [{"layout": config.label(), "config": config.to_dict(), "ok": True, "step_time": 0.05,
              "phases": {}, "peak_allocated_bytes": None},
             {"layout": "x", "config": ParallelConfig(world_size=2).to_dict(), "ok": False, "step_time": None,
              "failure_reason": "crash"}]
    rows, summary = compare(model, training, cluster, table)
    assert len(rows) == 1
    lo, hi = rows[0]["interval_s"]
    assert lo <= rows[0]["predicted_s"] <= hi
    assert set(rows[0]["provenance"]) <= {"gemm", "grouped_gemm", "attention_core", "memory_bound", "ep_a2a",
                                          "etp_comm", "dp_grad", "edp_grad", "param_gather", "optimizer",
                                          "host_overhead", "tp_comm"}
    assert summary["interval_coverage"]["step_time"]["rows"] == 1
