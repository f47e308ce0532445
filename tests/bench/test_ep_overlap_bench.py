"""bench/ep_overlap_gpu.py and bench/ep_overlap_paired.py: CPU smoke runs of the whole benches (gloo); their
arithmetic is tested with executor/microbench/ep_overlap_bar.py."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_cpu_smoke_run_writes_the_table_and_json(tmp_path, script):
    out = tmp_path / "ep.json"
    done = script("ep_overlap_gpu", "--device", "cpu", "--tiny", "--micro", "2", "--rounds", "1", "--warmup", "0",
                  "--steps", "1", "--trace", "--out", str(out), "--variants", "on,on_carve8",
                  "--start-method", "fork")  # six fresh 2-rank worlds that skip re-importing torch
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["micro_per_rank"] == 2 and report["model"] == "tiny-moe"
    assert report["exposed_a2a_off"] > 0
    assert report["loss_rel_diff"] < 1e-6  # the same step computed in another order
    # the carveout variant: the same step (on CPU the carveout is never set), reported beside 'on'
    assert report["primary_variant"] == "on" and set(report["variants"]) == {"on", "on_carve8"}
    assert report["variants"]["on_carve8"]["sm_carveout"] == 8
    assert report["variants"]["on_carve8"]["loss_rel_diff"] < 1e-6
    assert [len(report["runs"][m]) for m in ("off", "on", "on_carve8")] == [1, 1, 1]
    printed = done.stdout
    assert "hidden fraction" in printed and "beside compute" in printed and "on_carve8" in printed
    for mode in ("off", "on", "on_carve8"):  # on CPU no CUDA kernels: the profile runs, the kernel times are 0
        assert [r["rank"] for r in report["trace"][mode]] == [0, 1]
        assert report["trace"][mode][0]["a2a_under_compute_ms"] == 0.0


@pytest.mark.slow
def test_paired_cpu_smoke_run_of_the_whole_bench(tmp_path, script):
    out = tmp_path / "paired.json"
    done = script("ep_overlap_paired", "--device", "cpu", "--tiny", "--pairs", "2", "--warmup", "1", "--out",
                  str(out), "--start-method", "fork")
    assert done.returncode == 0, done.stderr[-3000:]
    body = json.loads(out.read_text())
    assert body["pairs"] == 2 and body["micro_per_rank"] == 8 and len(body["ranks"]) == 2
    for rank in body["ranks"]:
        for mode in ("off", "on"):
            assert len(rank[mode]["step_s"]) == 2 and all(t > 0 for t in rank[mode]["ep_alltoall_s"])
    assert "hidden fraction" in done.stdout
