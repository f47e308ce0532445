"""Routing scenarios of a slice: loads as shares, and whole token copies per expert worked by hand."""

import pytest

from spec.errors import SpecError
from spec.routing_scenarios import even_load, hot_expert_load, routed_counts, scenario_load


def test_hot_expert_is_factor_times_the_mean_and_the_rest_share_what_is_left():
    load = hot_expert_load(8, 2.0)
    assert load[0] == 2.0 and sum(load) / 8 == pytest.approx(1.0)
    assert load[1:] == (6 / 7,) * 7
    assert hot_expert_load(1, 2.0) == (1.0,)  # one expert cannot be skewed
    assert scenario_load("even", 3) == even_load(3) == (1.0, 1.0, 1.0)


def test_a_hot_factor_beyond_the_experts_is_refused():
    with pytest.raises(SpecError, match=r"\[1, 4\]"):
        hot_expert_load(4, 5.0)
    with pytest.raises(SpecError, match="even, skewed"):
        scenario_load("lopsided", 4)


def test_even_counts_split_the_copies_and_give_the_remainder_to_the_first_experts():
    # 10 tokens x top-2 = 20 copies over 3 experts: 6.67 each -> 7, 7, 6 (largest remainders, then expert order)
    assert routed_counts(even_load(3), 10, 2) == [7, 7, 6]
    assert routed_counts(even_load(8), 64, 4) == [32] * 8


def test_skewed_counts_worked_by_hand():
    # 64 tokens x top-4 = 256 copies over 8 experts: expert 0 gets 2/8 = 64, the others 192/7 = 27.43 each;
    # the 0.43 remainders round three of them up (27 * 7 = 189, 3 copies left)
    counts = routed_counts(hot_expert_load(8, 2.0), 64, 4)
    assert counts == [64, 28, 28, 28, 27, 27, 27, 27] and sum(counts) == 256


def test_no_expert_gets_more_copies_than_tokens():
    # 4 tokens x top-2 over 2 experts at factor 2: expert 0 would take all 8 copies, but a token picks it once
    counts = routed_counts(hot_expert_load(2, 2.0), 4, 2)
    assert counts == [4, 4]
    with pytest.raises(SpecError, match="top-k"):
        routed_counts(even_load(2), 4, 3)
