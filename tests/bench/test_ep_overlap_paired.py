"""bench/ep_overlap_paired.py: the paired steps' arithmetic, their ABBA order, and a CPU smoke run (gloo)."""

from __future__ import annotations

import json
import sys

import pytest

import bench.ep_overlap_paired as paired


def _report(off, on, a2a_off, a2a_on=None):
    return {"off": {"step_s": off, "ep_alltoall_s": a2a_off},
            "on": {"step_s": on, "ep_alltoall_s": a2a_on or [0.001] * len(on)}}


def test_pairs_alternate_their_order():
    assert paired.pair_orders(4) == [(False, True), (True, False), (False, True), (True, False)]


def test_hidden_fraction_is_the_median_saving_per_pair_over_the_exposed_all_to_all():
    # the off steps drift up by 10 ms over the pairs; each pair's saving stays 12-14 ms
    s = paired.summarize(_report([0.400, 0.405, 0.410], [0.388, 0.392, 0.396], [0.020, 0.021, 0.022]), micro=8)
    assert s["saved_per_pair"] == pytest.approx(0.013) and s["exposed_a2a_off"] == pytest.approx(0.021)
    assert s["hidden_fraction"] == pytest.approx(0.013 / 0.021) and s["passes"]  # 0.619
    assert (s["saved_min"], s["saved_max"]) == (pytest.approx(0.012), pytest.approx(0.014))
    assert s["pairs_saving"] == 3 and s["max_hideable_fraction"] == pytest.approx(7 / 8)
    assert s["peak_bytes_on"] == 0  # no peak recorded (a CPU run)
    report = _report([0.4, 0.4], [0.39, 0.39], [0.02, 0.02])
    report["off"]["peak_bytes"], report["on"]["peak_bytes"] = [3 << 30, 4 << 30], [6 << 30, 5 << 30]
    s = paired.summarize(report, micro=8)
    assert (s["peak_bytes_off"], s["peak_bytes_on"]) == (4 << 30, 6 << 30)
    assert "4.00 / 6.00 GiB" in paired.table(s, "head")
    # a pair in which the overlap lost: the median saving falls to 12 ms, 0.571 of the exposed time
    s = paired.summarize(_report([0.400, 0.405, 0.410], [0.388, 0.392, 0.420], [0.020, 0.021, 0.022]), micro=8)
    assert s["pairs_saving"] == 2 and not s["passes"]
    assert "NO" in paired.table(s, "head")


def test_the_exposed_all_to_all_is_the_least_over_the_ranks():
    # rank 0 reaches every exchange first and waits there for the slower rank 1: 12 ms more per step
    rank0 = _report([0.430, 0.431], [0.418, 0.418], [0.031, 0.032])
    rank1 = _report([0.430, 0.431], [0.418, 0.418], [0.019, 0.020])
    s = paired.summarize([rank0, rank1], micro=8)
    assert s["exposed_a2a_off"] == pytest.approx(0.0195) and s["exposed_a2a_off_rank0"] == pytest.approx(0.0315)
    assert s["hidden_fraction"] == pytest.approx(0.0125 / 0.0195) and s["passes"]
    # per pair, not per rank: the least of each pair's phases, then their median
    rank1 = _report([0.430, 0.431], [0.418, 0.418], [0.040, 0.010])
    assert paired.summarize([rank0, rank1], micro=8)["exposed_a2a_off"] == pytest.approx((0.031 + 0.010) / 2)
    with pytest.raises(ValueError, match="same off steps"):
        paired.summarize([rank0, _report([0.43], [0.41], [0.02])], micro=8)


def test_unequal_or_empty_reports_are_refused():
    with pytest.raises(ValueError, match="equal in number"):
        paired.summarize(_report([0.4, 0.4], [0.39], [0.02, 0.02]), micro=8)
    with pytest.raises(ValueError, match="not empty"):
        paired.summarize(_report([], [], []), micro=8)


@pytest.mark.slow
def test_cpu_smoke_run_of_the_whole_bench(tmp_path, monkeypatch, capsys):
    out = tmp_path / "paired.json"
    monkeypatch.setattr(sys, "argv", ["ep_overlap_paired", "--device", "cpu", "--tiny", "--pairs", "2",
                                      "--warmup", "1", "--out", str(out)])
    assert paired.main() == 0
    body = json.loads(out.read_text())
    assert body["pairs"] == 2 and body["micro_per_rank"] == 8 and len(body["ranks"]) == 2
    for rank in body["ranks"]:
        for mode in ("off", "on"):
            assert len(rank[mode]["step_s"]) == 2 and all(t > 0 for t in rank[mode]["ep_alltoall_s"])
    assert "hidden fraction" in capsys.readouterr().out


def test_bad_arguments_are_refused(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["ep_overlap_paired", "--device", "cpu", "--pairs", "0"])
    with pytest.raises(SystemExit) as exc:
        paired.main()
    assert exc.value.code == 2
