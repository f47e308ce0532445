"""The tuner spends its trials where the candidates' step-time intervals overlap: the start-up order, the
calibrated intervals narrowed by the fit's residuals, the contenders against the best measured step, and the
real search driven through Optuna with them."""

from __future__ import annotations

import math

import optuna
import pytest

from planner.calibration import GROUPS, Calibration, Observation, fit_calibration
from planner.search import (Candidate, SearchBudget, calibrated_interval, contenders, run_search,
                            startup_order)
from spec.parallel_config import ParallelConfig

optuna.logging.set_verbosity(optuna.logging.WARNING)


def cand(tp: int, point: float, low: float | None, high: float | None, memory: float = 1.0) -> Candidate:
    """A 16-GPU layout (told apart by tp and ep) whose time is all GEMM seconds, with its interval."""
    config = ParallelConfig(world_size=16, tp=tp, ep=16 // tp if tp < 16 else 1)
    return Candidate(config, point, (("gemm", point),), memory, predicted_low=low, predicted_high=high)


def test_startup_order_worked_by_hand():
    """C has the lowest pessimistic end (1.4 s): first. B (0.7-1.8) and A (0.9-1.5) reach below 1.4: they may be
    faster, so they come next, lowest prediction first (B 0.9 s, then A 1.0 s). D's optimistic end (1.45) is above
    C's pessimistic one: it waits, with the rest, by pessimistic end."""
    a, b, c, d = cand(1, 1.0, 0.9, 1.5), cand(2, 0.9, 0.7, 1.8), cand(4, 1.2, 1.1, 1.4), cand(8, 1.3, 1.45, 1.6)
    assert startup_order([a, b, c, d]) == [c, b, a, d]
    # without intervals: the point estimates' order, as the search had before intervals
    plain = [cand(1, 1.0, None, None), cand(2, 0.9, None, None), cand(4, 1.2, None, None)]
    assert startup_order(plain) == [plain[1], plain[0], plain[2]]
    assert startup_order([]) == []


def test_calibrated_interval_is_narrowed_by_the_fit_residuals_worked_by_hand():
    """Point 1.0 s in [0.8, 1.5] (-20 % / +50 %); the fit multiplies compute by 1.2 (1.2 s) with a relative RMSE
    of 5 % over 4 trials: the residual error is 1.2816 x 0.05 x sqrt(1 + 1/4) = 0.07164, below both widths, so
    the interval becomes 1.2 x (1 -/+ 0.07164) = [1.11403, 1.28597]. With 2 trials the residuals say nothing:
    the widths stay, around the calibrated time: [0.96, 1.8]."""
    c = cand(1, 1.0, 0.8, 1.5)
    fit = Calibration(time_multipliers=tuple((g, 1.2 if g == "compute" else 1.0) for g in GROUPS),
                      relative_rmse=0.05, num_observations=4)
    iv = calibrated_interval(c, fit)
    residual = 1.2816 * 0.05 * math.sqrt(1.25)
    assert (iv.value, iv.low, iv.high) == pytest.approx((1.2, 1.2 * (1 - residual), 1.2 * (1 + residual)))
    assert (iv.low, iv.high) == pytest.approx((1.11403, 1.28597), abs=1e-5)
    few = Calibration(time_multipliers=fit.time_multipliers, relative_rmse=0.05, num_observations=2)
    iv = calibrated_interval(c, few)
    assert (iv.low, iv.high) == pytest.approx((0.96, 1.8))
    bare = calibrated_interval(cand(2, 1.0, None, None), fit)
    assert bare.low == bare.value == bare.high == pytest.approx(1.2)


def test_contenders_are_the_candidates_that_may_beat_the_best_measured_step():
    identity = {None: Calibration()}
    near, far, bare = cand(1, 1.1, 0.95, 1.3), cand(2, 1.4, 1.05, 1.9), cand(4, 0.8, None, None)
    assert contenders([near, far, bare], identity, best_measured=1.0) == [near]
    assert contenders([near, far], identity, best_measured=1.1) == [near, far]
    assert contenders([bare], identity, best_measured=5.0) == []  # no interval: no claim either way


def test_search_measures_where_the_intervals_overlap():
    """Five layouts, all of GEMM seconds. A (1.00 s, at worst 1.05) is the robust best and measured first; B, C
    and Z reach below 1.05 at their optimistic ends and Y (1.08-1.20) does not, so B and C, the lowest
    predictions among them, fill the start-up trials. The machine: A 1.00 s, B 1.25 s, C 0.85 s. The fit
    (one compute multiplier) is c = sum(p/m) / sum((p/m)^2) = 3.008 / 3.092864 = 0.97256 with relative RMSE
    0.15762 over 3 trials, so the residual error is 1.2816 x 0.15762 x sqrt(4/3) = 0.23326. Y then is
    calibrated to 1.0698 s in [1.0504, ...]: it cannot beat the best measured 0.85 s. Z is calibrated to 1.0893 s,
    more than Y, but its optimistic end, 1.0893 x (1 - 0.23326) = 0.8352 s, is below 0.85 s: the fourth trial is
    Z, where a search by calibrated prediction alone would measure Y."""
    a, b, c = cand(1, 1.00, 0.97, 1.05), cand(2, 1.01, 0.90, 1.50), cand(4, 1.02, 0.90, 1.60)
    z, y = cand(8, 1.12, 0.60, 2.50), cand(16, 1.10, 1.08, 1.20)
    truth = {1: 1.00, 2: 1.25, 4: 0.85, 8: 1.30, 16: 1.10}
    order = []

    def run_trial(config, report):
        order.append(config.tp)
        t = truth[config.tp]
        report(0, t)
        return type("M", (), {"ok": True, "step_time": t, "peak_allocated_bytes": None, "pruned": False,
                              "tokens_per_expert": None})()

    assert startup_order([a, b, c, z, y]) == [a, b, c, z, y]
    result = run_search([y, z, c, b, a], run_trial, capacity_bytes=10.0, budget=SearchBudget(max_trials=4))
    assert order == [1, 2, 4, 8]
    assert [r.layout for r in result.rows][:1] == [a.label]
    assert result.best_config.tp == 4 and result.best_step_time == pytest.approx(0.85)
    # the fourth trial's reasoning, from the fit over the first three
    first3 = fit_calibration([Observation(k.predicted_terms, 1.0, truth[k.config.tp]) for k in (a, b, c)])
    assert dict(first3.time_multipliers)["compute"] == pytest.approx(0.97256, abs=1e-5)
    assert (first3.relative_rmse, first3.num_observations) == (pytest.approx(0.15762, abs=1e-5), 3)
    assert calibrated_interval(y, first3).low == pytest.approx(1.0504, abs=1e-4)
    assert calibrated_interval(z, first3).low == pytest.approx(0.8352, abs=1e-4)
    assert contenders([y, z], {None: first3}, 0.85) == [z]
