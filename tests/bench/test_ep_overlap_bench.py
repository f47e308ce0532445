"""bench/ep_overlap_gpu.py: the hidden-fraction arithmetic, and a CPU smoke run of the whole bench (gloo)."""

from __future__ import annotations

import json
import sys

import pytest

import bench.ep_overlap_gpu as bench
from bench.intervals import gaps, overlap_us


def _run(step, a2a, losses):
    return {"ok": True, "step_time": step, "phases": {"ep_alltoall": a2a, "experts": 1.0}, "losses": losses}


def test_hidden_fraction_is_the_step_saved_over_the_exposed_all_to_all():
    runs = {"off": [_run(0.100, 0.020, [2.0, 1.0]), _run(0.104, 0.022, [2.0, 1.0])],
            "on": [_run(0.088, 0.001, [2.0, 1.001]), _run(0.090, 0.001, [2.0, 1.0])]}
    s = bench.summarize(runs, micro=8)
    assert s["step_off"] == pytest.approx(0.102) and s["step_on"] == pytest.approx(0.089)
    assert s["exposed_a2a_off"] == pytest.approx(0.021) and s["a2a_phase_on"] == pytest.approx(0.001)
    assert s["hidden_fraction"] == pytest.approx(0.013 / 0.021)  # 0.619: passes the 0.60 bar
    assert s["passes"] and s["max_hideable_fraction"] == pytest.approx(7 / 8)
    assert s["loss_rel_diff"] == pytest.approx(1e-3)
    runs["on"][1]["step_time"] = 0.095  # median 0.0915: 0.5 of the exposed a2a hidden
    assert not bench.summarize(runs, micro=8)["passes"]


def test_a_failed_run_is_reported_not_divided():
    runs = {"off": [_run(0.1, 0.02, [1.0])], "on": [{"ok": False, "failure_reason": "oom"}]}
    s = bench.summarize(runs, micro=2)
    assert not s["ok"] and s["failures"] == ["oom"] and "hidden_fraction" not in s
    assert "a run failed" in bench.table(s, "cpu")
    runs["off"] = [{"ok": False, "failure_reason": "nccl"}]
    assert bench.summarize(runs, micro=2) == {"ok": False, "failures": ["nccl", "oom"]}


def test_variants_are_each_compared_with_off_and_on_keeps_the_top_level_keys():
    runs = {"off": [_run(0.100, 0.020, [2.0])], "on": [_run(0.092, 0.001, [2.0])],
            "on_carve16": [_run(0.086, 0.001, [2.002])], "on_nch8": [{"ok": False, "failure_reason": "hang"}]}
    variants = {n: bench.parse_variant(n) for n in ("on", "on_carve16", "on_nch8")}
    s = bench.summarize(runs, micro=8, variants=variants)
    assert not s["ok"] and s["failures"] == ["hang"]  # one variant failed; the others are still reported
    assert s["primary_variant"] == "on" and s["step_on"] == pytest.approx(0.092)
    assert s["hidden_fraction"] == pytest.approx(0.4) and not s["passes"]
    carve = s["variants"]["on_carve16"]
    assert carve["hidden_fraction"] == pytest.approx(0.7) and carve["passes"] and carve["sm_carveout"] == 16
    assert carve["loss_rel_diff"] == pytest.approx(1e-3) and carve["nccl_max_nchannels"] is None
    assert s["best_variant"] == "on_carve16" and not s["variants"]["on_nch8"]["ok"]
    printed = bench.table(s, "cpu")
    assert "on_carve16" in printed and "best: on_carve16" in printed and "failed: hang" in printed
    # without 'on' the first variant stands in for it at the top level
    del runs["on"]
    assert bench.summarize(runs, micro=8)["primary_variant"] == "on_carve16"


def test_variant_names_parse_to_carveout_and_nccl_channels():
    v = bench.parse_variant("on_carve16_nch8")
    assert (v.overlap, v.sm_carveout, v.nccl_channels) == (True, 16, 8)
    assert v.env() == {"NCCL_MAX_NCHANNELS": "8"} and v.options(bench.ExecutorOptions()).ep_overlap_sm_carveout == 16
    assert bench.parse_variant("on").env() == {} and bench.parse_variant("on").sm_carveout == 0
    assert bench.parse_variant("on").options(bench.ExecutorOptions()).ep_overlap_transport == "auto"
    assert bench.parse_variant("on_nccl").transport == "nccl"
    ce = bench.parse_variant("on_carve8_ce")
    assert (ce.sm_carveout, ce.transport) == (8, "copy_engine")
    assert ce.options(bench.ExecutorOptions()).ep_overlap_transport == "copy_engine"
    for bad in ("off", "on_carve", "on_nch0", "carve8", "on_nch8_carve16", "on_ce_carve8", "on_cE", "on_ce_nccl"):
        with pytest.raises(ValueError):
            bench.parse_variant(bad)


def test_communication_beside_compute_is_the_intersection_with_the_compute_union():
    # all-to-all kernels [0, 10) and [20, 30); compute [5, 8), [7, 12) (overlapping each other), [25, 40)
    assert overlap_us([(0, 10), (20, 30)], [(5, 8), (7, 12), (25, 40)]) == pytest.approx(5 + 5)
    assert overlap_us([(0, 10)], []) == 0.0 and overlap_us([(0, 10)], [(10, 20)]) == 0.0
    assert overlap_us([(0, 4), (2, 6)], [(0, 100)]) == pytest.approx(6)  # counted once where they overlap


@pytest.mark.slow
def test_cpu_smoke_run_writes_the_table_and_json(tmp_path, monkeypatch, capsys):
    out = tmp_path / "ep.json"
    monkeypatch.setattr(sys, "argv", ["ep_overlap_gpu", "--device", "cpu", "--tiny", "--micro", "2", "--rounds",
                                      "1", "--warmup", "0", "--steps", "1", "--trace", "--out", str(out),
                                      "--variants", "on,on_carve8"])
    assert bench.main() == 0
    report = json.loads(out.read_text())
    assert report["ok"] and report["micro_per_rank"] == 2 and report["model"] == "tiny-moe"
    assert report["exposed_a2a_off"] > 0
    assert report["loss_rel_diff"] < 1e-6  # the same step computed in another order
    # the carveout variant: the same step (on CPU the carveout is never set), reported beside 'on'
    assert report["primary_variant"] == "on" and set(report["variants"]) == {"on", "on_carve8"}
    assert report["variants"]["on_carve8"]["sm_carveout"] == 8
    assert report["variants"]["on_carve8"]["loss_rel_diff"] < 1e-6
    assert [len(report["runs"][m]) for m in ("off", "on", "on_carve8")] == [1, 1, 1]
    printed = capsys.readouterr().out
    assert "hidden fraction" in printed and "beside compute" in printed and "on_carve8" in printed
    for mode in ("off", "on", "on_carve8"):  # on CPU no CUDA kernels: the profile runs, the kernel times are 0
        assert [r["rank"] for r in report["trace"][mode]] == [0, 1]
        assert report["trace"][mode][0]["a2a_under_compute_ms"] == 0.0


def test_the_device_idles_between_the_pieces_of_its_activity_union():
    # kernels [0, 10) and [5, 12) overlap; [15, 20) and [20, 22) touch; [30, 31) stands alone
    busy = [(5, 12), (0, 10), (20, 22), (15, 20), (30, 31)]
    assert gaps(busy) == [(12, 15), (22, 30)]
    assert gaps([(0, 1)]) == [] and gaps([]) == []
