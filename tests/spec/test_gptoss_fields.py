"""GPT-OSS's attention and activation fields of ModelSpec: per-layer windows, validation, JSON round trip."""

from __future__ import annotations

import dataclasses

import pytest

from spec.catalog import get_model
from spec.errors import SpecError
from spec.model_spec import ModelSpec
from spec.validity import executor_layout_rules, unsupported_features
from spec.parallel_config import ParallelConfig

GPTOSS = get_model("gpt-oss-120b")


def test_gpt_oss_alternates_windowed_and_full_layers_as_megatron_numbers_them():
    # Megatron's layer numbers are 1-based: with skip frequency 2 layers 2, 4, ... attend fully; the published
    # sliding_window 128 counts the query's own key, Megatron's window the keys before it (127)
    assert [GPTOSS.attention_window(i) for i in range(4)] == [127, None, 127, None]
    pattern = dataclasses.replace(GPTOSS, window_attn_skip_freq=(0, 1) * 18)
    assert [pattern.attention_window(i) for i in range(4)] == [None, 127, None, 127]
    assert get_model("tiny-moe").attention_window(0) is None


def test_gpt_oss_round_trips_through_json_and_stays_gated():
    assert ModelSpec.from_dict(GPTOSS.to_dict()) == GPTOSS
    assert GPTOSS.gated_linear_unit and not GPTOSS.swiglu
    assert unsupported_features(GPTOSS) == []
    assert GPTOSS.with_layers(3).num_layers == 3


@pytest.mark.parametrize("fields", [
    {"quick_geglu": True},  # swiglu stays True: both at once
    {"swiglu": False, "activation_func_clamp_value": 7.0},  # a clamp without a gated unit
    {"softmax_type": "sparse"},
    {"window_size": (128,)},
    {"window_attn_skip_freq": 2},  # without window_size
    {"window_size": (4, 0), "window_attn_skip_freq": (1, 0, 1)},  # pattern longer than num_layers (2)
])
def test_bad_attention_or_activation_fields_are_rejected(fields):
    with pytest.raises(SpecError):
        dataclasses.replace(get_model("tiny-moe"), **fields)


def test_executor_rejects_non_causal_windows_and_etp_that_cuts_biased_experts_unevenly():
    bidirectional = dataclasses.replace(get_model("tiny-moe"), window_size=(4, 4))
    assert unsupported_features(bidirectional)
    odd = dataclasses.replace(get_model("tiny-moe"), hidden_size=66, num_attention_heads=6, num_query_groups=2,
                              add_bias_linear=True)
    config = ParallelConfig(world_size=4, ep=1, etp=4)
    assert any("hidden_size" in r.reason for r in executor_layout_rules(odd, config, 16))
