"""planner.accuracy.k_trial: calibration fitted on the model's top-ranked layouts, scored on the rest."""

from __future__ import annotations

import pytest

from planner.accuracy import k_trial


def _row(name: str, predicted: float, measured: float) -> dict:
    # one compute term: measured = 3 x predicted for every layout, so a fit on any of them is exact
    return {"layout": name, "predicted_s": predicted, "measured_s": measured, "predicted_terms": (("gemm", predicted),),
            "predicted_memory_bytes": 100.0, "measured_peak_bytes": 120.0}


def test_k_trial_fits_on_the_top_ranked_and_scores_only_the_rest():
    rows = [_row(f"l{i}", 0.1 * (i + 1), 0.3 * (i + 1)) for i in range(8)]
    out = k_trial(rows, [], capacity_bytes=1e12, k=3)
    assert out["fitted_on"] == ["l0", "l1", "l2"]  # the three the model ranks fastest
    assert out["layouts"] == 5  # held out: the other five, never the fitted ones
    assert out["mape"] == pytest.approx(0.0, abs=1e-6) and out["spearman"] == pytest.approx(1.0)
    assert out["memory_worst_under"] >= -1e-9  # memory multiplier = max measured/predicted ratio seen


def test_k_trial_counts_an_oom_among_the_top_ranked_as_an_oom_observation():
    rows = [_row(f"l{i}", 0.1 * (i + 2), 0.3 * (i + 2)) for i in range(6)]
    oom = {"layout": "big", "predicted_s": 0.05, "predicted_terms": (("gemm", 0.05),),
           "predicted_memory_bytes": 100.0, "oom": True}
    out = k_trial(rows, [oom], capacity_bytes=150.0, k=3)
    assert out["fitted_on"][0] == "big" and out["layouts"] == 4
    # the OOM forces the memory multiplier above capacity / predicted = 1.5
    assert out["calibration"]["memory_multiplier"] >= 1.5
    assert k_trial(rows[:3], [], capacity_bytes=1e12, k=3) is None  # nothing left to score
