"""bench/executor_gpu.py's MoE part and bench/moe_breakdown.py's steady-state timer, on CPU at tiny shapes."""

from __future__ import annotations

import time

import pytest
import torch

import bench.executor_gpu as eg
from bench.moe_breakdown import steady_seconds


def test_steady_seconds_times_back_to_back_calls():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    t = steady_seconds(fn, torch.device("cpu"), iters=5, lead=2, trials=3)
    assert len(calls) == 1 + 3 * (2 + 5)  # one warm-up, then per trial the lead and the timed calls
    assert 0.002 <= t < 0.05


@pytest.mark.parametrize("mbs", [1, 2])
def test_part_moe_reports_steady_and_isolated(monkeypatch, mbs):
    monkeypatch.setattr(eg, "DEV", torch.device("cpu"))
    monkeypatch.setattr(eg, "BF16", torch.float32)
    monkeypatch.setattr(eg, "STEADY_ITERS", 3)
    r = eg.part_moe(*eg.TINY_MOE_SHAPES["mixtral"], eg.TINY_SEQ, mbs)
    assert r["shape"]["tokens"] == eg.TINY_SEQ * mbs and r["shape"]["mbs"] == mbs
    assert r["ratio"] == pytest.approx(r["ideal_s"] / r["layer_s"])
    assert r["balanced_ratio"] == pytest.approx(r["ideal_s"] / r["balanced_layer_s"])
    assert r["isolated_ratio"] == pytest.approx(r["isolated_ideal_s"] / r["isolated_layer_s"])
    assert r["isolated_balanced_ratio"] == pytest.approx(r["isolated_ideal_s"] / r["isolated_balanced_layer_s"])
    for key in ("layer_s", "ideal_s", "isolated_layer_s", "host_issue_s", "balanced_host_issue_s"):
        assert r[key] > 0, key
    rows = eg.moe_rows("moe_mixtral", r, 0.95 if mbs == 1 else None)
    assert rows[0][1] == f"{r['ratio']:.3f}" and f"({r['shape']['tokens']} tok)" in rows[0][0]
    assert (rows[0][2] != "") == (mbs == 1)  # the bar is judged at 4096-token shapes only
    assert rows[1][1] == f"{r['isolated_ratio']:.3f}"


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
