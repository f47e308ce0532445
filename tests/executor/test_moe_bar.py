"""The MoE layer bar (executor/microbench/moe_bar.py), its stage breakdown (moe_stages.py) and the steady-state
timers of executor/microbench/timing.py, on CPU at tiny shapes."""

from __future__ import annotations

import time

import pytest
import torch

import executor.microbench.moe_bar as mb
from executor.microbench.moe_bar import SharedExpertIdeal, bar_inputs, layer_fwd_bwd, moe_bar
from executor.microbench.moe_stages import StagedLayer, breakdown, format_table
from executor.microbench.timing import PairedTimes, time_paired_steady, time_steady
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from executor.router import Router
from spec.catalog import get_model


def test_steady_seconds_times_back_to_back_calls():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    t = time_steady(fn, torch.device("cpu"), iters=5, lead=2, trials=3)
    assert len(calls) == 1 + 3 * (2 + 5)  # one warm-up, then per trial the lead and the timed calls
    assert 0.002 <= t < 0.05


def test_paired_steady_alternates_windows_and_takes_the_median_round_ratio():
    order = []

    # sleeps long enough that a loaded machine's oversleeping (a few ms) leaves b clearly the longer
    def a():
        order.append("a")
        time.sleep(0.01)

    def b():
        order.append("b")
        time.sleep(0.05)

    r = time_paired_steady(a, b, torch.device("cpu"), rounds=4, iters=2, lead=1)
    windows = [order[i] for i in range(2, len(order), 3)]  # after the warm-up pair, windows of 1 + 2 calls
    assert windows == ["a", "b", "b", "a", "a", "b", "b", "a"]  # order flipped every round
    assert len(r.ratio_by_round) == 4 and r.ratio == pytest.approx(sum(sorted(r.ratio_by_round)[1:3]) / 2)
    assert 1.5 < r.ratio < 10  # b sleeps five times as long as a
    assert r.b_s > r.a_s > 0.01


@pytest.mark.parametrize("name, mbs", [("mixtral", 1), ("mixtral", 2), ("deepseek-v3", 1)])
def test_moe_bar_reports_balanced_random_and_uneven_ideal(name, mbs):
    r = moe_bar(mb.TINY_MOE_SHAPES[name], mb.TINY_SEQ, mbs, torch.device("cpu"), torch.float32, steady_iters=3,
                paired_rounds=2)
    assert r["shape"]["tokens"] == mb.TINY_SEQ * mbs and r["shape"]["mbs"] == mbs
    # the headline comes from alternated windows: the median of the rounds' ratios
    for key in ("ratio", "random_ratio"):
        rounds = r[key + "_by_round"] if key == "ratio" else r["random_ratio_by_round"]
        assert len(rounds) == 2 and r[key] == pytest.approx(sum(rounds) / 2)
    assert r["sequential_ratio"] == pytest.approx(r["sequential_ideal_s"] / r["sequential_layer_s"])
    assert r["isolated_ratio"] == pytest.approx(r["isolated_ideal_s"] / r["isolated_layer_s"])
    assert r["imbalance_max_over_mean"] >= 1.0 and r["uneven_ideal_over_ideal"] > 0
    for key in ("layer_s", "ideal_s", "random_layer_s", "isolated_layer_s", "host_issue_s", "random_host_issue_s"):
        assert r[key] > 0, key


@pytest.mark.parametrize("name", ["mixtral", "deepseek-v3"])
def test_moe_bar_pairs_each_step_with_its_reference(monkeypatch, name):
    # Tag every step moe_bar builds and give each tag fixed seconds; a fake time_paired_steady then answers as the
    # real one does (b_s / a_s). Every reported ratio must come from the right pair, the right way up.
    seconds = {"layer-forced": 1.0, "layer-random": 1.2, "ideal-balanced": 0.9, "ideal-uneven": 0.99}

    def tagged(tag, fn):
        fn.tag = tag
        return fn

    real_layer, real_ideal = mb.layer_fwd_bwd, mb.ideal_fwd_bwd
    shape = mb.TINY_MOE_SHAPES[name]
    layers, shareds = [], []

    def fake_layer(layer, x, gy):
        layers.append(layer)
        return tagged("layer-forced" if layer.router.options.moe_router_force_load_balancing else "layer-random",
                      real_layer(layer, x, gy))

    def fake_ideal(experts, xs, gs, counts, shared=None):
        shareds.append(shared)
        return tagged("ideal-balanced" if bool((counts == counts[0]).all()) else "ideal-uneven",
                      real_ideal(experts, xs, gs, counts, shared))

    monkeypatch.setattr(mb, "layer_fwd_bwd", fake_layer)
    monkeypatch.setattr(mb, "ideal_fwd_bwd", fake_ideal)

    def fake_paired(fn_a, fn_b, dev, rounds, iters):
        a, b = seconds[fn_a.tag], seconds[fn_b.tag]
        return PairedTimes(a, b, b / a, [b / a] * rounds)

    monkeypatch.setattr(mb, "time_paired_steady", fake_paired)
    r = moe_bar(shape, mb.TINY_SEQ, 1, torch.device("cpu"), torch.float32, steady_iters=2)
    # both layers run the shape's router (expert bias as the model has it), and with a shared expert both
    # ideals (balanced and uneven groups) include its GEMMs
    assert len(layers) == 2 and all(layer.router.spec == shape.spec for layer in layers)
    assert all((layer.router.expert_bias is not None) == shape.expert_bias for layer in layers)
    assert len(shareds) == 2 and all((sh is not None) == bool(shape.spec.shared_expert_ffn_hidden_size)
                                     for sh in shareds)
    if r["imbalance_max_over_mean"] == 1.0:
        pytest.skip("the random router happened to balance the tiny shape")
    assert r["layer_s"] == 1.0 and r["ideal_s"] == 0.9 and r["ratio"] == pytest.approx(0.9)
    assert r["random_layer_s"] == 1.2 and r["random_ratio"] == pytest.approx(0.9 / 1.2)
    assert r["random_vs_uneven_ideal"] == pytest.approx(0.99 / 1.2)
    assert r["uneven_ideal_over_ideal"] == pytest.approx(0.99 / 0.9)  # seconds on uneven groups / on balanced


def test_forced_balance_router_still_computes_scores_and_assigns_round_robin():
    # the bar's layer keeps the router's own work (logits, softmax, probabilities); only the choice is fixed
    spec = mb.TINY_MOE_SHAPES["mixtral"].spec
    router = Router(spec, ExecutorOptions(moe_router_force_load_balancing=True), single_process_state(), 0,
                    torch.device("cpu"), torch.float32)
    x = torch.randn(32, spec.hidden_size, requires_grad=True)
    routing = router(x)
    assert torch.equal(routing.tokens_per_expert, torch.full((spec.num_experts,), 32 * spec.moe_router_topk
                                                              // spec.num_experts))
    routing.probs_NK.sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3"])
def test_breakdown_headline_ratio_is_steady_state(name):
    shape = mb.TINY_MOE_SHAPES[name]
    r = breakdown(shape.spec, tokens=mb.TINY_SEQ, dev=torch.device("cpu"), dtype=torch.float32,
                  options=shape.options())
    assert ("shared_bwd" in r["random"]["stages_device_s"]) == bool(shape.spec.shared_expert_ffn_hidden_size)
    for mode in ("random", "balanced"):
        m = r[mode]
        assert m["ratio"] == pytest.approx(r["ideal"]["steady_s"] / m["layer_steady_s"])
        assert m["isolated_ratio"] == pytest.approx(r["ideal"]["wall_s"] / m["layer_wall_s"])
    assert r["uneven_ideal_over_ideal"] == pytest.approx(r["ideal_uneven"]["steady_s"] / r["ideal"]["steady_s"])
    assert "layer_steady_s" in format_table("tiny", r)


def test_bar_shapes_are_the_catalog_models_moe_layers():
    # Qwen3-30B-A3B whole; DeepSeek-V3 as one EP8 rank's 32 experts with the model's router rule and shared expert
    qwen, dsv3 = mb.MOE_SHAPES["qwen3-30b-a3b"], mb.MOE_SHAPES["deepseek-v3"]
    model = get_model("qwen3-30b-a3b")
    assert (qwen.spec.hidden_size, qwen.spec.expert_ffn_hidden_size, qwen.spec.num_experts,
            qwen.spec.moe_router_topk, qwen.bar) == (model.hidden_size, 768, model.num_experts, 8, 0.90)
    model, s = get_model("deepseek-v3"), dsv3.spec
    assert (s.hidden_size, s.expert_ffn_hidden_size, s.moe_router_topk, s.shared_expert_ffn_hidden_size) == (
        7168, 2048, 8, 2048)
    assert (s.moe_router_score_function, s.moe_router_topk_scaling_factor) == ("sigmoid", 2.5)
    assert s.num_experts == 32 and (s.moe_router_num_groups, s.moe_router_group_topk) == (8, 4)
    assert dsv3.expert_bias and dsv3.bar == 0.90 and mb.MOE_SHAPES["mixtral"].bar == 0.95
    # rows per expert on one GPU at seq 4096 = rows per expert of an EP8 rank when 8 ranks send 4096 tokens each
    ep = model.num_experts // s.num_experts
    one_gpu_rows, ep8_rank_rows = mb.SEQ * 8 // s.num_experts, ep * mb.SEQ * 8 // model.num_experts
    assert ep == 8 and one_gpu_rows == ep8_rank_rows == 1024


def test_deepseek_v3_bar_layer_routes_by_sigmoid_groups_with_scaling():
    shape = mb.TINY_MOE_SHAPES["deepseek-v3"]
    spec = shape.spec
    bar = bar_inputs(spec, mb.TINY_SEQ, 1, torch.device("cpu"), torch.float32, shape.options())
    routing = bar.layer.router(bar.x.detach().view(mb.TINY_SEQ, spec.hidden_size))
    per_group = spec.num_experts // spec.moe_router_num_groups
    groups_used = [len(set((routing.experts_NK[t] // per_group).tolist())) for t in range(mb.TINY_SEQ)]
    assert max(groups_used) <= spec.moe_router_group_topk
    # sigmoid scores normalised over the top-k, then scaled: each token's weights sum to the scaling factor
    assert torch.allclose(routing.probs_NK.sum(-1), torch.full((mb.TINY_SEQ,), 2.5))


def test_shared_expert_ideal_computes_the_layers_shared_expert():
    shape = mb.TINY_MOE_SHAPES["deepseek-v3"]
    bar = bar_inputs(shape.spec, mb.TINY_SEQ, 1, torch.device("cpu"), torch.float32, shape.options())
    x = bar.shared.x.detach()
    want = bar.layer.shared(x.view(mb.TINY_SEQ, 1, -1)).view(mb.TINY_SEQ, -1)
    assert isinstance(bar.shared.ideal, SharedExpertIdeal)
    torch.testing.assert_close(bar.shared.ideal(x), want)
    bar.ideal_step()()  # the ideal's fwd+bwd writes the shared expert's weight gradients too
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in bar.shared.ideal.parameters())


def test_staged_layer_with_shared_expert_gives_the_layers_input_gradient():
    # the breakdown's stages must add up to the layer: same input gradient as one fwd+bwd of MoELayer
    shape = mb.TINY_MOE_SHAPES["deepseek-v3"]
    bar = bar_inputs(shape.spec, mb.TINY_SEQ, 1, torch.device("cpu"), torch.float32, shape.options())
    layer_fwd_bwd(bar.layer, bar.x, bar.gy)()
    h = shape.spec.hidden_size
    staged = StagedLayer(bar.layer, bar.x.detach().view(mb.TINY_SEQ, h), bar.gy.view(mb.TINY_SEQ, h))
    staged.step()
    assert staged.FWD[-1] == "shared" and staged.BWD[0] == "shared"
    torch.testing.assert_close(staged.s["g_x"], bar.x.grad.view(mb.TINY_SEQ, h))
    torch.testing.assert_close(staged.s["out_total"], bar.layer(bar.x)[0].detach().view(mb.TINY_SEQ, h))
