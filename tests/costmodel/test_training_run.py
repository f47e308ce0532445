"""Time and cost to train N tokens, on numbers worked by hand."""

import pytest

from costmodel.training_run import training_run
from spec.errors import SpecError
from spec.run_inputs import check_price_per_gpu_hour, format_token_count, parse_token_count


def test_whole_steps_wall_time_gpu_hours_and_cost():
    # 10 sequences x 10 tokens = 100 tokens a step; 1,000 tokens = 10 steps; 10 x 360 s = 1 h on 8 GPUs = 8 GPU-h
    run = training_run(1000, 360.0, seq_length=10, global_batch_size=10, num_gpus=8, price_per_gpu_hour=2.0)
    assert (run.tokens_per_step, run.steps, run.wall_s, run.wall_hours) == (100, 10, 3600.0, 1.0)
    assert run.gpu_hours == 8.0 and run.cost_usd == 16.0
    # one token more needs an 11th step, and it costs a whole step
    longer = training_run(1001, 360.0, seq_length=10, global_batch_size=10, num_gpus=8, price_per_gpu_hour=2.0)
    assert longer.steps == 11 and longer.wall_s == 3960.0 and longer.cost_usd == pytest.approx(17.6)


def test_a_realistic_run_and_no_price():
    # 1e12 tokens at 256 x 4096 = 1,048,576 tokens a step: 953,674.3 -> 953,675 steps; at 2 s: 1,907,350 s
    run = training_run(10**12, 2.0, seq_length=4096, global_batch_size=256, num_gpus=64)
    assert run.steps == 953_675 and run.wall_s == 1_907_350.0
    assert run.gpu_hours == pytest.approx(64 * 1_907_350 / 3600)  # 33,908.4 GPU-hours
    assert run.cost_usd is None and run.price_per_gpu_hour is None
    assert run.to_dict()["steps"] == 953_675


def test_training_run_refuses_nonsense():
    with pytest.raises(ValueError):
        training_run(1000, 0.0, seq_length=10, global_batch_size=10, num_gpus=8)


@pytest.mark.parametrize("text, tokens", [("1e12", 10**12), ("300B", 300 * 10**9), ("1.5T", 1_500_000_000_000),
                                          ("1.5t", 1_500_000_000_000), ("2_000_000", 2_000_000), ("7", 7),
                                          ("4.5k", 4500), ("2G", 2 * 10**9), (" 12M ", 12 * 10**6)])
def test_token_counts_as_people_write_them(text, tokens):
    assert parse_token_count(text) == tokens


@pytest.mark.parametrize("text, says", [("abc", "takes a number of tokens such as 1e12"), ("1.5X", "takes"),
                                        ("-3", "takes"), ("0", "at least 1 token"), ("0.5", "whole number"),
                                        ("1e17", "at most 1e+16"), ("", "takes")])
def test_bad_token_counts_name_the_flag_and_the_rule(text, says):
    with pytest.raises(SpecError) as info:
        parse_token_count(text)
    assert str(info.value).startswith("--tokens ") and says in str(info.value) and "\n" not in str(info.value)


def test_prices_are_bounded_and_counts_print_short():
    assert check_price_per_gpu_hour(2.5) == 2.5
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1000.01):
        with pytest.raises(SpecError, match="--price-per-gpu-hour must be more than 0 and at most 1000 USD"):
            check_price_per_gpu_hour(bad)
    assert [format_token_count(n) for n in (1_500_000_000_000, 300 * 10**9, 42 * 10**6, 512)] == \
        ["1.5T", "300B", "42M", "512"]
