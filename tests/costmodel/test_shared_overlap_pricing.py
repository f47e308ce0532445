"""The cost model's price of shared-expert overlap (``moe_shared_expert_overlap``): per MoE layer and micro-batch
the shared experts' forward compute hides under the dispatch all-to-all, up to the smaller of the two (the
dispatch's forward: a quarter of the layer's all-to-all seconds), and nothing else changes."""

from __future__ import annotations

import dataclasses

import pytest

from costmodel.step_time import estimate_step_time, layer_times
from spec import ClusterSpec, ParallelConfig, TrainingSpec, get_hardware, get_model

H100 = get_hardware("h100-sxm")
COMPUTE = ("gemm", "grouped_gemm", "attention_core", "memory_bound")


def _pair(model, gpus: int, ep: int):
    training = TrainingSpec(seq_length=4096, global_batch_size=2 * gpus)  # 2 micro-batches per rank
    cluster = ClusterSpec(H100, gpus)
    plain = ParallelConfig(world_size=gpus, ep=ep)
    base = estimate_step_time(model, training, cluster, plain)
    on = estimate_step_time(model, training, cluster, plain.replace(moe_shared_expert_overlap=True))
    return training, cluster, plain, base, on


def _shared_fwd(model, training, cluster, config) -> float:
    """Forward compute seconds of one MoE layer's shared experts: the MoE part with them less without them."""
    without = dataclasses.replace(model, moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False)
    a, b = (layer_times(m, training, cluster, config)["moe"] for m in (model, without))
    return sum(v for k, v in a.fwd if k in COMPUTE) - sum(v for k, v in b.fwd if k in COMPUTE)


def _hidden_a2a(estimate) -> float:
    return dict(estimate.hidden).get("ep_a2a", 0.0)


@pytest.mark.parametrize("gpus", [8, 32])
def test_small_shared_experts_hide_entirely_under_the_dispatch(gpus):
    """DeepSeek-V2-Lite (shared FFN 2816 against 64 experts top-6): its shared experts take less than the dispatch,
    so all of their forward hides: m · MoE layers · their forward seconds, taken off the step."""
    model = get_model("deepseek-v2-lite")
    training, cluster, plain, base, on = _pair(model, gpus, gpus)
    per_layer = _shared_fwd(model, training, cluster, plain)
    expected = 2 * model.num_moe_layers * per_layer
    assert per_layer > 0
    assert _hidden_a2a(base) == 0.0
    assert _hidden_a2a(on) == pytest.approx(expected, rel=1e-9)
    assert base.step_time - on.step_time == pytest.approx(expected, rel=1e-6)
    assert on.term("ep_a2a") == pytest.approx(base.term("ep_a2a") - expected, rel=1e-9)
    for term in COMPUTE:  # the compute is the same, only less of the all-to-all is exposed
        assert on.term(term) == pytest.approx(base.term(term))


def test_large_shared_experts_hide_only_the_dispatch():
    """Qwen2-57B-A14B on 8 GPUs (shared FFN 20480): its shared experts outlast the dispatch, so what hides is the
    dispatch's forward, a quarter of the all-to-all, not the shared experts' time."""
    model = get_model("qwen2-57b-a14b")
    training, cluster, plain, base, on = _pair(model, 8, 8)
    moe = layer_times(model, training, cluster, plain)["moe"]
    a2a_per_layer = dict(moe.fwd)["ep_a2a"] + dict(moe.bwd)["ep_a2a"]
    m_layers = 2 * model.num_moe_layers
    hidden = _hidden_a2a(on)
    assert 0 < hidden < m_layers * _shared_fwd(model, training, cluster, plain)
    assert hidden <= m_layers * a2a_per_layer / 4
    assert base.step_time - on.step_time == pytest.approx(hidden, rel=1e-6)


def test_without_shared_experts_the_knob_prices_nothing():
    """The knob on a model without shared experts (a layout the rule book refuses) changes no price."""
    model = get_model("mixtral-8x7b")
    training, cluster, plain, base, on = _pair(model, 8, 8)
    assert on.step_time == base.step_time
