"""executor/microbench/ep_overlap_bar.py: the hidden-fraction arithmetic of separate off/on runs and of
paired steps (ABBA order, the exposed all-to-all read on the rank that waits least), and the variant names."""

from __future__ import annotations

import pytest

from executor.microbench.ep_overlap_bar import pair_orders, parse_variant, summarize_pairs, summarize_runs
from executor.options import ExecutorOptions


def _run(step, a2a, losses):
    return {"ok": True, "step_time": step, "phases": {"ep_alltoall": a2a, "experts": 1.0}, "losses": losses}


def test_hidden_fraction_is_the_step_saved_over_the_exposed_all_to_all():
    runs = {"off": [_run(0.100, 0.020, [2.0, 1.0]), _run(0.104, 0.022, [2.0, 1.0])],
            "on": [_run(0.088, 0.001, [2.0, 1.001]), _run(0.090, 0.001, [2.0, 1.0])]}
    s = summarize_runs(runs, micro=8)
    assert s["step_off"] == pytest.approx(0.102) and s["step_on"] == pytest.approx(0.089)
    assert s["exposed_a2a_off"] == pytest.approx(0.021) and s["a2a_phase_on"] == pytest.approx(0.001)
    assert s["hidden_fraction"] == pytest.approx(0.013 / 0.021)  # 0.619: passes the 0.60 bar
    assert s["passes"] and s["max_hideable_fraction"] == pytest.approx(7 / 8)
    assert s["loss_rel_diff"] == pytest.approx(1e-3)
    runs["on"][1]["step_time"] = 0.095  # median 0.0915: 0.5 of the exposed a2a hidden
    assert not summarize_runs(runs, micro=8)["passes"]


def test_a_failed_run_is_reported_not_divided():
    runs = {"off": [_run(0.1, 0.02, [1.0])], "on": [{"ok": False, "failure_reason": "oom"}]}
    s = summarize_runs(runs, micro=2)
    assert not s["ok"] and s["failures"] == ["oom"] and "hidden_fraction" not in s
    runs["off"] = [{"ok": False, "failure_reason": "nccl"}]
    assert summarize_runs(runs, micro=2) == {"ok": False, "failures": ["nccl", "oom"]}


def test_variants_are_each_compared_with_off_and_on_keeps_the_top_level_keys():
    runs = {"off": [_run(0.100, 0.020, [2.0])], "on": [_run(0.092, 0.001, [2.0])],
            "on_carve16": [_run(0.086, 0.001, [2.002])], "on_nch8": [{"ok": False, "failure_reason": "hang"}]}
    variants = {n: parse_variant(n) for n in ("on", "on_carve16", "on_nch8")}
    s = summarize_runs(runs, micro=8, variants=variants)
    assert not s["ok"] and s["failures"] == ["hang"]  # one variant failed; the others are still reported
    assert s["primary_variant"] == "on" and s["step_on"] == pytest.approx(0.092)
    assert s["hidden_fraction"] == pytest.approx(0.4) and not s["passes"]
    carve = s["variants"]["on_carve16"]
    assert carve["hidden_fraction"] == pytest.approx(0.7) and carve["passes"] and carve["sm_carveout"] == 16
    assert carve["loss_rel_diff"] == pytest.approx(1e-3) and carve["nccl_max_nchannels"] is None
    assert s["best_variant"] == "on_carve16" and not s["variants"]["on_nch8"]["ok"]
    # without 'on' the first variant stands in for it at the top level
    del runs["on"]
    assert summarize_runs(runs, micro=8)["primary_variant"] == "on_carve16"


def test_variant_names_parse_to_carveout_and_nccl_channels():
    v = parse_variant("on_carve16_nch8")
    assert (v.overlap, v.sm_carveout, v.nccl_channels) == (True, 16, 8)
    assert v.env() == {"NCCL_MAX_NCHANNELS": "8"} and v.options(ExecutorOptions()).ep_overlap_sm_carveout == 16
    assert parse_variant("on").env() == {} and parse_variant("on").sm_carveout == 0
    assert parse_variant("on").options(ExecutorOptions()).ep_overlap_transport == "auto"
    assert parse_variant("on_nccl").transport == "nccl"
    ce = parse_variant("on_carve8_ce")
    assert (ce.sm_carveout, ce.transport) == (8, "copy_engine")
    assert ce.options(ExecutorOptions()).ep_overlap_transport == "copy_engine"
    for bad in ("off", "on_carve", "on_nch0", "carve8", "on_nch8_carve16", "on_ce_carve8", "on_cE", "on_ce_nccl"):
        with pytest.raises(ValueError):
            parse_variant(bad)


def _report(off, on, a2a_off, a2a_on=None):
    return {"off": {"step_s": off, "ep_alltoall_s": a2a_off},
            "on": {"step_s": on, "ep_alltoall_s": a2a_on or [0.001] * len(on)}}


def test_pairs_alternate_their_order():
    assert pair_orders(4) == [(False, True), (True, False), (False, True), (True, False)]


def test_hidden_fraction_is_the_median_saving_per_pair_over_the_exposed_all_to_all():
    # the off steps drift up by 10 ms over the pairs; each pair's saving stays 12-14 ms
    s = summarize_pairs(_report([0.400, 0.405, 0.410], [0.388, 0.392, 0.396], [0.020, 0.021, 0.022]), micro=8)
    assert s["saved_per_pair"] == pytest.approx(0.013) and s["exposed_a2a_off"] == pytest.approx(0.021)
    assert s["hidden_fraction"] == pytest.approx(0.013 / 0.021) and s["passes"]  # 0.619
    assert (s["saved_min"], s["saved_max"]) == (pytest.approx(0.012), pytest.approx(0.014))
    assert s["pairs_saving"] == 3 and s["max_hideable_fraction"] == pytest.approx(7 / 8)
    assert s["peak_bytes_on"] == 0  # no peak recorded (a CPU run)
    report = _report([0.4, 0.4], [0.39, 0.39], [0.02, 0.02])
    report["off"]["peak_bytes"], report["on"]["peak_bytes"] = [3 << 30, 4 << 30], [6 << 30, 5 << 30]
    s = summarize_pairs(report, micro=8)
    assert (s["peak_bytes_off"], s["peak_bytes_on"]) == (4 << 30, 6 << 30)
    # a pair in which the overlap lost: the median saving falls to 12 ms, 0.571 of the exposed time
    s = summarize_pairs(_report([0.400, 0.405, 0.410], [0.388, 0.392, 0.420], [0.020, 0.021, 0.022]), micro=8)
    assert s["pairs_saving"] == 2 and not s["passes"]


def test_the_exposed_all_to_all_is_the_least_over_the_ranks():
    # rank 0 reaches every exchange first and waits there for the slower rank 1: 12 ms more per step
    rank0 = _report([0.430, 0.431], [0.418, 0.418], [0.031, 0.032])
    rank1 = _report([0.430, 0.431], [0.418, 0.418], [0.019, 0.020])
    s = summarize_pairs([rank0, rank1], micro=8)
    assert s["exposed_a2a_off"] == pytest.approx(0.0195) and s["exposed_a2a_off_rank0"] == pytest.approx(0.0315)
    assert s["hidden_fraction"] == pytest.approx(0.0125 / 0.0195) and s["passes"]
    # per pair, not per rank: the least of each pair's phases, then their median
    rank1 = _report([0.430, 0.431], [0.418, 0.418], [0.040, 0.010])
    assert summarize_pairs([rank0, rank1], micro=8)["exposed_a2a_off"] == pytest.approx((0.031 + 0.010) / 2)
    with pytest.raises(ValueError, match="same off steps"):
        summarize_pairs([rank0, _report([0.43], [0.41], [0.02])], micro=8)


def test_unequal_or_empty_reports_are_refused():
    with pytest.raises(ValueError, match="equal in number"):
        summarize_pairs(_report([0.4, 0.4], [0.39], [0.02, 0.02]), micro=8)
    with pytest.raises(ValueError, match="not empty"):
        summarize_pairs(_report([], [], []), micro=8)
