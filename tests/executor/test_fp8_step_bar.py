"""executor/microbench/fp8_step_bar.py: the loss comparisons of the fp8 step bar, hand-worked."""

from __future__ import annotations

import pytest

from executor.microbench.fp8_step_bar import compare, max_rel_diff, max_rise


def test_loss_comparisons_hand_worked():
    """max_rel_diff is step for step against the reference; max_rise measures a climb above the earlier low
    (not above the first loss), 0 for a loss that only falls."""
    assert max_rel_diff([10.0, 9.0, 8.8], [10.0, 10.0, 8.0]) == pytest.approx(0.1)
    assert max_rise([11.0, 10.0, 10.5, 9.0, 9.9]) == pytest.approx(0.1)  # 9.0 -> 9.9, not 10.5 over 10
    assert max_rise([3.0, 2.0, 1.0]) == 0.0
    assert max_rise([]) == 0.0


def test_compare_judges_speed_and_losses_against_the_bars():
    bf16 = {"tokens_per_s": 1000.0, "losses": [10.0, 9.0, 9.5]}
    fp8 = {"tokens_per_s": 1300.0, "losses": [10.0, 9.05, 9.5]}
    got = compare(bf16, fp8)
    assert got["speedup"] == pytest.approx(1.3) and got["speedup_ok"]
    assert got["max_rel_loss_diff"] == pytest.approx(0.05 / 9) and got["loss_ok"]
    assert got["bf16_max_rise"] == pytest.approx(0.5 / 9)
    assert not compare(bf16, {**fp8, "tokens_per_s": 1200.0})["speedup_ok"]
    assert not compare(bf16, {**fp8, "losses": [10.0, 9.2, 9.5]})["loss_ok"]  # 2.2 % off
