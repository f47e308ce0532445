"""Component factors in a HardwareProfile: JSON round trip, look-up by model shape, and the estimate they scale."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from costmodel.calibrate.component_factors import build_report
from spec.catalog import get_hardware, get_model
from costmodel.estimate import estimate, step_time
from spec.hardware import ClusterSpec, HardwareProfile, component_key, parse_component_key
from spec.parallel_config import ParallelConfig
from spec.profile_io import load_profile, save_profile
from spec.training_spec import TrainingSpec

FACTORS = {"gemm": 1.25, "grouped_gemm": 1.5, "attention_core": 3.0, "memory_bound": 2.0, "optimizer": 4.0}
MODEL = get_model("mixtral-8x7b").with_layers(2)


def _profile(factors=None) -> HardwareProfile:
    return replace(get_hardware("h200"), name="h200-components",
                   component_factors=factors or {f"{MODEL.name}@seq4096": FACTORS})


def test_factors_round_trip_through_profile_json(tmp_path):
    profile = _profile()
    assert load_profile(save_profile(profile, tmp_path / "p.json")) == profile
    assert HardwareProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile
    hash(profile)  # compute_rates caches on the profile: it must stay hashable
    plain = get_hardware("h200")
    assert "component_factors" not in plain.to_dict()  # files without factors are written as before
    assert HardwareProfile.from_dict(plain.to_dict()) == plain


def test_invalid_factor_is_rejected():
    with pytest.raises(Exception, match="component_factors"):
        _profile({"x@seq1": {"gemm": 0.0}})


def test_lookup_exact_then_nearest_seq_then_base_model():
    profile = _profile({f"{MODEL.name}@seq4096": {"gemm": 2.0}, f"{MODEL.name}@seq1024": {"gemm": 3.0},
                        "mixtral-8x7b@seq8192": {"gemm": 5.0}})
    assert profile.component_corrections(MODEL.name, 4096) == {"gemm": 2.0}
    assert profile.component_corrections(MODEL.name, 2048) == {"gemm": 3.0}  # nearest of the same proxy
    assert profile.component_corrections("mixtral-8x7b", 4096) == {"gemm": 5.0}  # exact name first
    assert profile.component_corrections("mixtral-8x7b@4L", 4096) == {"gemm": 2.0}  # same base model, nearest
    assert profile.component_corrections("qwen3-30b-a3b", 4096) is None
    assert get_hardware("h200").component_corrections(MODEL.name, 4096) is None


def test_lookup_picks_the_nearest_micro_batch_size_of_the_nearest_seq():
    profile = _profile({f"{MODEL.name}@seq4096@mbs1": {"gemm": 1.5}, f"{MODEL.name}@seq4096@mbs2": {"gemm": 1.2},
                        f"{MODEL.name}@seq4096": {"gemm": 9.0}, f"{MODEL.name}@seq2048@mbs4": {"gemm": 7.0}})
    assert profile.component_corrections(MODEL.name, 4096, 1) == {"gemm": 1.5}
    assert profile.component_corrections(MODEL.name, 4096, 4) == {"gemm": 1.2}  # nearest size at the nearest seq
    assert profile.component_corrections(MODEL.name, 4096) == {"gemm": 9.0}  # no size asked: the key without one
    assert parse_component_key(component_key("a@2L", 4096, 2)) == ("a@2L", 4096, 2)
    assert parse_component_key("a@seq128") == ("a", 128, None)
    training = TrainingSpec(seq_length=4096, global_batch_size=16)
    cluster = ClusterSpec(profile, 4)
    t1 = estimate(MODEL, training, cluster, ParallelConfig(world_size=4, ep=2, micro_batch_size=1)).time
    plain = estimate(MODEL, training, ClusterSpec(get_hardware("h200"), 4),
                     ParallelConfig(world_size=4, ep=2, micro_batch_size=1)).time
    assert t1.term("gemm") == pytest.approx(1.5 * plain.term("gemm"))


def test_lookup_follows_the_tokens_one_rank_works_on():
    """TP and CP split each micro-batch's tokens: a TP2 rank at mbs 1 and seq 4096 runs 2048 tokens per
    MoE pass, so the factors measured at 2048 tokens apply, not those of a whole 4096-token micro-batch."""
    profile = _profile({f"{MODEL.name}@seq4096@mbs1": {"gemm": 1.5}, f"{MODEL.name}@seq2048@mbs1": {"gemm": 2.5},
                        f"{MODEL.name}@seq4096@mbs2": {"gemm": 1.2}})
    assert profile.component_corrections(MODEL.name, 4096, 1, tokens_divisor=2) == {"gemm": 2.5}
    assert profile.component_corrections(MODEL.name, 4096, 2, tokens_divisor=2) == {"gemm": 1.5}
    assert profile.component_corrections(MODEL.name, 4096, 2, tokens_divisor=1) == {"gemm": 1.2}
    training = TrainingSpec(seq_length=4096, global_batch_size=16)
    cluster = ClusterSpec(profile, 4)
    plain = ClusterSpec(get_hardware("h200"), 4)
    for config, factor in ((ParallelConfig(world_size=4, tp=2, ep=2, micro_batch_size=1), 2.5),
                           (ParallelConfig(world_size=4, cp=2, ep=2, micro_batch_size=2), 1.5)):
        assert estimate(MODEL, training, cluster, config).time.term("gemm") == pytest.approx(
            factor * estimate(MODEL, training, plain, config).time.term("gemm"))


def test_estimate_with_factors_scales_exactly_the_named_terms():
    training = TrainingSpec(seq_length=4096, global_batch_size=16)
    config = ParallelConfig(world_size=4, ep=2, micro_batch_size=2)
    plain = estimate(MODEL, training, ClusterSpec(get_hardware("h200"), 4), config).time
    cluster = ClusterSpec(_profile(), 4)
    scaled = estimate(MODEL, training, cluster, config).time
    assert step_time(MODEL, training, cluster, config) == scaled
    before, after = dict(plain.terms), dict(scaled.terms)
    for term, value in before.items():
        assert after[term] == pytest.approx(value * FACTORS.get(term, 1.0), rel=1e-12)
    assert FACTORS.keys() <= {t for t, v in before.items() if v > 0}  # every factor had something to scale
    assert scaled.step_time == pytest.approx(sum(after.values()))
    assert scaled.step_time > plain.step_time
    # a model the profile has no entry for is priced as without factors
    qwen = get_model("qwen3-30b-a3b").with_layers(2)
    assert estimate(qwen, training, cluster, config).time.step_time == \
        estimate(qwen, training, ClusterSpec(get_hardware("h200"), 4), config).time.step_time


def test_report_names_every_component_without_a_usable_time():
    measured = {"attention": 1e-3, "moe": 0.0, "head": float("nan"), "optimizer": 1e-9}
    with pytest.raises(ValueError, match="moe: measured 0.0 s.*head: measured nan s"):
        build_report(get_model("tiny-moe"), 32, 2, "fp32", "cpu", measured, get_hardware("cpu"))
