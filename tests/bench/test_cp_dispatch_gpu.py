"""bench/cp_dispatch_gpu.py: the CPU smoke run on 2 gloo ranks, and --price's prediction of the same cases."""

from __future__ import annotations

import json

import pytest

from bench.cp_dispatch_gpu import BenchConfig, format_prediction, main, predict
from costmodel.context_parallel import cp_attention_time
from costmodel.compute import compute_rates
from spec import get_hardware


@pytest.mark.slow
def test_smoke_run_on_two_gloo_ranks(tmp_path, capsys):
    out = tmp_path / "cp_dispatch.json"
    assert main(["--cpu", "--out", str(out)]) == 0
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
    printed = capsys.readouterr().out
    assert "CPU SMOKE RUN" in printed and "speedup" in printed and "allgather" in printed


def test_price_predicts_every_case_from_the_named_quantities():
    cfg = BenchConfig()
    hw = get_hardware("h100-sxm")
    pred = predict(hw, cfg)
    assert list(pred["cp"]) == ["2048", "4096", "8192"] and list(pred["dispatch"]) == ["1024", "4096", "16384"]
    rates = compute_rates(hw, "bf16")
    for s, row in pred["cp"].items():
        assert row["cp2_core_ms"] == pytest.approx(1e3 * sum(cp_attention_time(rates, 1, int(s), 2, 32, 128, 128)))
        assert row["cp2_total_ms"] == pytest.approx(row["cp2_core_ms"] + row["cp2_kv_ms"] + row["cp2_proj_ms"])
        assert 1.0 < row["speedup_total"] < 2.0  # less than ideal: shorter chunks, the exchange
        assert row["speedup_core"] < 2.0  # shorter chunks on the slower flash kernel
    for n, row in pred["dispatch"].items():
        # EP2 top-2: the same token rows on the wire each way (module test); allgather also gathers the routing
        assert row["allgather_gather_bytes"] == 2 * int(n) * (4096 * 2 + 2 * 12)
        assert row["alltoall_ms"] > 0 and row["allgather_ms"] > 0
    measured = {"cp": {"4096": {"cp2_total_ms": 1.5}}, "dispatch": {}}
    table = format_prediction(pred, measured)
    assert "model | measured" in table and "1.500" in table
