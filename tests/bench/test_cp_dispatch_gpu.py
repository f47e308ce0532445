"""bench/cp_dispatch_gpu.py: the CPU smoke run on 2 gloo ranks, and --price beside a measured run."""

from __future__ import annotations

import json

import pytest

from executor.microbench.exchanges import BenchConfig

# a whole script run in a child process: the full suite's; the code it drives has fast tests in its package
pytestmark = pytest.mark.slow


@pytest.mark.slow
def test_smoke_run_on_two_gloo_ranks(tmp_path, script):
    out = tmp_path / "cp_dispatch.json"
    done = script("cp_dispatch_gpu", "--cpu", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    cfg = BenchConfig.tiny()
    assert report["ok"] and report["device"] == "2 CPU ranks (gloo)"
    assert list(report["cp"]) == [str(s) for s in cfg.seqs]
    for row in report["cp"].values():
        assert row["cp2_matches_cp1"] and row["cp2_vs_cp1_rel_err"] < 1e-4  # CP2 computes CP1's attention
        for name in ("cp1_core_ms", "cp1_proj_ms", "cp1_total_ms", "cp2_core_ms", "cp2_kv_ms", "cp2_total_ms"):
            assert row[name] > 0 and len(row[name + "_per_rank"]) == 2
            assert row[name] == max(row[name + "_per_rank"])  # the slowest rank's
        assert row["speedup_total"] == pytest.approx(row["cp1_total_ms"] / row["cp2_total_ms"])
        s = row["seq"]
        # K and V of s/2 tokens, kv_heads x head_dim fp32 each, sent to the one peer
        assert row["kv_bytes_sent_per_rank"] == 2 * (s // 2) * cfg.kv_heads * cfg.head_dim * 4
    assert list(report["dispatch"]) == [str(n) for n in cfg.tokens]
    for row in report["dispatch"].values():
        assert row["alltoall_ms"] > 0 and row["allgather_ms"] > 0
        assert 0 < row["copies_to_peer"] < row["tokens"] * cfg.topk
    printed = done.stdout
    assert "CPU SMOKE RUN" in printed and "speedup" in printed and "allgather" in printed


def test_price_prints_the_model_beside_a_measured_run(tmp_path, script):
    measured = tmp_path / "measured.json"
    measured.write_text('{"cp": {"4096": {"cp2_total_ms": 1.5}}, "dispatch": {}}')
    done = script("cp_dispatch_gpu", "--price", "h100-sxm", "--measured", str(measured))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "model | measured" in done.stdout and "1.500" in done.stdout
