"""In-step component times: a 1-GPU step's phases -> component seconds -> per-term factors (hand-worked)."""

from __future__ import annotations

import pytest

from costmodel.calibrate.component_factors import build_report, predicted_parts
from costmodel.calibrate.step_phases import IN_STEP_PHASES, components_from_phases, step_parameters
from spec.catalog import get_hardware, get_model

DSV2 = get_model("deepseek-v2-lite").with_layers(2)  # layer 0 dense, layer 1 MoE (with shared experts)
MIXTRAL = get_model("mixtral-8x7b").with_layers(2)  # both layers MoE


def test_phases_map_to_components_per_occurrence_and_micro_batch():
    # 4 micro-batches; seconds per step as the phase timer sums them
    phases = {"attention": 0.016, "router": 0.001, "dispatch": 0.002, "experts": 0.010, "combine": 0.002,
              "shared_experts": 0.005, "mlp": 0.006, "norm": 0.004, "lm_head_loss": 0.020, "embedding": 0.008,
              "optimizer": 0.010, "other": 0.5, "tp_allgather": 0.3, "grad_reduce": 0.2}
    got = components_from_phases(DSV2, phases, micro_batches=4, parameters=1_000_000)
    # attention: 2 layers x 4 micro-batches -> 16 ms / 8
    assert got["attention"] == pytest.approx(0.002)
    # moe: (1 + 2 + 10 + 2 + 5) ms + half the norm (1 MoE layer of 2) = 22 ms over 1 layer x 4 micro-batches
    assert got["moe"] == pytest.approx(0.0055)
    # dense_mlp: 6 ms + 2 ms of norm over 1 x 4
    assert got["dense_mlp"] == pytest.approx(0.002)
    assert got["head"] == pytest.approx(0.005)
    assert got["embedding"] == pytest.approx(0.002)
    assert got["optimizer"] == pytest.approx(1e-8)  # 10 ms over 1 M parameters
    assert set(got) == {"attention", "moe", "dense_mlp", "head", "embedding", "optimizer"}  # 'other' etc. left out


def test_all_moe_model_has_no_dense_component_and_norm_goes_to_moe():
    phases = {"attention": 0.008, "experts": 0.012, "norm": 0.004, "lm_head_loss": 0.002, "embedding": 0.002,
              "optimizer": 0.001}
    got = components_from_phases(MIXTRAL, phases, micro_batches=2, parameters=1000)
    assert "dense_mlp" not in got
    assert got["moe"] == pytest.approx((0.012 + 0.004) / 4)


def test_missing_phase_and_mtp_model_are_refused():
    with pytest.raises(ValueError, match="experts"):
        components_from_phases(MIXTRAL, {"attention": 1.0, "lm_head_loss": 1.0, "embedding": 1.0,
                                         "optimizer": 1.0}, 1, 10)
    with pytest.raises(ValueError, match="MTP"):
        components_from_phases(get_model("deepseek-v3").with_layers(2), {}, 1, 10)


def test_step_parameters_counts_the_whole_one_gpu_model():
    # DeepSeek-V2-Lite 2L: bigger than its embedding + head alone, smaller than the full 15.7 B model
    n = step_parameters(DSV2)
    assert 2 * DSV2.vocab_size * DSV2.hidden_size < n < 15e9


def test_phases_built_from_the_prediction_give_back_the_ratios():
    """Synthetic step: every component's phase is its prediction x a chosen ratio (head 2x, others 1x), so
    the factors are known by hand: terms only the layers hold keep 1, gemm and memory_bound take the head's
    share of their predicted seconds times the extra 1x."""
    hw = get_hardware("h200")
    seq, m = 1024, 4
    parts, per_param = predicted_parts(DSV2, seq, 1, "bf16", hw)
    total = {name: sum(terms.values()) for name, terms in parts.items()}
    params = step_parameters(DSV2)
    phases = {"attention": 2 * m * total["attention"], "experts": m * total["moe"], "mlp": m * total["dense_mlp"],
              "lm_head_loss": 2.0 * m * total["head"], "embedding": m * total["embedding"],
              "optimizer": per_param * params}
    measured = components_from_phases(DSV2, phases, m, params)
    report = build_report(DSV2, seq, 1, "bf16", "synthetic", measured, hw, {k: IN_STEP_PHASES for k in measured})
    ratios = {c.name: c.ratio for c in report.components}
    assert ratios == pytest.approx({"attention": 1.0, "moe": 1.0, "dense_mlp": 1.0, "head": 2.0, "embedding": 1.0,
                                    "optimizer": 1.0})
    counts = {"attention": 2, "moe": 1, "dense_mlp": 1, "head": 1, "embedding": 1}
    for term in ("gemm", "memory_bound"):
        all_s = sum(counts[c] * parts[c].get(term, 0.0) for c in counts)
        assert report.factors[term] == pytest.approx(1.0 + parts["head"].get(term, 0.0) / all_s)
    assert report.factors["grouped_gemm"] == pytest.approx(1.0)
    assert report.factors["attention_core"] == pytest.approx(1.0)
    assert report.factors["optimizer"] == pytest.approx(1.0)
    assert report.timing["head"] == IN_STEP_PHASES
