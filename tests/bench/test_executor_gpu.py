"""bench/executor_gpu.py's MoE part and bench/moe_breakdown.py's steady-state timer, on CPU at tiny shapes."""

from __future__ import annotations

import time

import pytest
import torch

import bench.executor_gpu as eg
from bench.moe_breakdown import moe_spec, paired_steady, steady_seconds


def test_steady_seconds_times_back_to_back_calls():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    t = steady_seconds(fn, torch.device("cpu"), iters=5, lead=2, trials=3)
    assert len(calls) == 1 + 3 * (2 + 5)  # one warm-up, then per trial the lead and the timed calls
    assert 0.002 <= t < 0.05


def test_paired_steady_alternates_windows_and_takes_the_median_round_ratio():
    order = []

    def a():
        order.append("a")
        time.sleep(0.001)

    def b():
        order.append("b")
        time.sleep(0.003)

    r = paired_steady(a, b, torch.device("cpu"), rounds=4, iters=2, lead=1)
    windows = [order[i] for i in range(2, len(order), 3)]  # after the warm-up pair, windows of 1 + 2 calls
    assert windows == ["a", "b", "b", "a", "a", "b", "b", "a"]  # order flipped every round
    assert len(r["ratio_by_round"]) == 4 and r["ratio"] == pytest.approx(sum(sorted(r["ratio_by_round"])[1:3]) / 2)
    assert 1.5 < r["ratio"] < 6  # b sleeps three times as long as a
    assert r["b_s"] > r["a_s"] > 0.001


@pytest.mark.parametrize("mbs", [1, 2])
def test_part_moe_reports_balanced_random_and_uneven_ideal(monkeypatch, mbs):
    monkeypatch.setattr(eg, "DEV", torch.device("cpu"))
    monkeypatch.setattr(eg, "BF16", torch.float32)
    monkeypatch.setattr(eg, "STEADY_ITERS", 3)
    monkeypatch.setattr(eg, "PAIRED_ROUNDS", 2)
    r = eg.part_moe(*eg.TINY_MOE_SHAPES["mixtral"], eg.TINY_SEQ, mbs)
    assert r["shape"]["tokens"] == eg.TINY_SEQ * mbs and r["shape"]["mbs"] == mbs
    # the headline comes from alternated windows: the median of the rounds' ratios
    for key in ("ratio", "random_ratio"):
        rounds = r[key + "_by_round"] if key == "ratio" else r["random_ratio_by_round"]
        assert len(rounds) == 2 and r[key] == pytest.approx(sum(rounds) / 2)
    assert r["sequential_ratio"] == pytest.approx(r["sequential_ideal_s"] / r["sequential_layer_s"])
    assert r["isolated_ratio"] == pytest.approx(r["isolated_ideal_s"] / r["isolated_layer_s"])
    assert r["imbalance_max_over_mean"] >= 1.0 and r["uneven_ideal_over_ideal"] > 0
    for key in ("layer_s", "ideal_s", "random_layer_s", "isolated_layer_s", "host_issue_s", "random_host_issue_s"):
        assert r[key] > 0, key
    rows = eg.moe_rows("moe_mixtral", r, 0.95 if mbs == 1 else None)
    assert rows[0][1] == f"{r['ratio']:.3f}" and f"({r['shape']['tokens']} tok)" in rows[0][0]
    assert (rows[0][2] != "") == (mbs == 1)  # the bar is judged at 4096-token shapes only
    assert rows[1][1] == f"{r['random_ratio']:.3f} / {r['random_vs_uneven_ideal']:.3f}"


def test_part_moe_pairs_each_step_with_its_reference(monkeypatch):
    # Tag every step part_moe builds and give each tag fixed seconds; a fake paired_steady then answers as the
    # real one does (b_s / a_s). Every reported ratio must come from the right pair, the right way up.
    seconds = {"layer-forced": 1.0, "layer-random": 1.2, "ideal-balanced": 0.9, "ideal-uneven": 0.99}

    def tagged(tag, fn):
        fn.tag = tag
        return fn

    real_layer, real_ideal = eg.layer_fwd_bwd, eg.ideal_fwd_bwd
    monkeypatch.setattr(eg, "layer_fwd_bwd", lambda layer, x, gy: tagged(
        "layer-forced" if layer.router.options.moe_router_force_load_balancing else "layer-random",
        real_layer(layer, x, gy)))
    monkeypatch.setattr(eg, "ideal_fwd_bwd", lambda experts, xs, gs, counts: tagged(
        "ideal-balanced" if bool((counts == counts[0]).all()) else "ideal-uneven", real_ideal(experts, xs, gs, counts)))

    def fake_paired(fn_a, fn_b, dev, rounds, iters):
        a, b = seconds[fn_a.tag], seconds[fn_b.tag]
        return {"a_s": a, "b_s": b, "ratio": b / a, "ratio_by_round": [b / a] * rounds}

    monkeypatch.setattr(eg, "paired_steady", fake_paired)
    monkeypatch.setattr(eg, "DEV", torch.device("cpu"))
    monkeypatch.setattr(eg, "BF16", torch.float32)
    monkeypatch.setattr(eg, "STEADY_ITERS", 2)
    h, f, experts, topk = eg.TINY_MOE_SHAPES["mixtral"]
    r = eg.part_moe(h, f, experts, topk, eg.TINY_SEQ, 1)
    if r["imbalance_max_over_mean"] == 1.0:
        pytest.skip("the random router happened to balance the tiny shape")
    assert r["layer_s"] == 1.0 and r["ideal_s"] == 0.9 and r["ratio"] == pytest.approx(0.9)
    assert r["random_layer_s"] == 1.2 and r["random_ratio"] == pytest.approx(0.9 / 1.2)
    assert r["random_vs_uneven_ideal"] == pytest.approx(0.99 / 1.2)
    assert r["uneven_ideal_over_ideal"] == pytest.approx(0.99 / 0.9)  # seconds on uneven groups / on balanced


def test_forced_balance_router_still_computes_scores_and_assigns_round_robin():
    # the bar's layer keeps the router's own work (logits, softmax, probabilities); only the choice is fixed
    from executor.options import ExecutorOptions
    from executor.parallel.groups import single_process_state
    from executor.router import Router

    spec = moe_spec(*eg.TINY_MOE_SHAPES["mixtral"])
    router = Router(spec, ExecutorOptions(moe_router_force_load_balancing=True), single_process_state(), 0,
                    torch.device("cpu"), torch.float32)
    x = torch.randn(32, spec.hidden_size, requires_grad=True)
    routing = router(x)
    assert torch.equal(routing.tokens_per_expert, torch.full((spec.num_experts,), 32 * spec.moe_router_topk
                                                              // spec.num_experts))
    routing.probs_NK.sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_breakdown_headline_ratio_is_steady_state():
    from bench.moe_breakdown import breakdown, format_table

    r = breakdown(*eg.TINY_MOE_SHAPES["finegrained"], tokens=eg.TINY_SEQ, dev=torch.device("cpu"),
                  dtype=torch.float32)
    for mode in ("random", "balanced"):
        m = r[mode]
        assert m["ratio"] == pytest.approx(r["ideal"]["steady_s"] / m["layer_steady_s"])
        assert m["isolated_ratio"] == pytest.approx(r["ideal"]["wall_s"] / m["layer_wall_s"])
    assert r["uneven_ideal_over_ideal"] == pytest.approx(r["ideal_uneven"]["steady_s"] / r["ideal"]["steady_s"])
    assert "layer_steady_s" in format_table("tiny", r)
