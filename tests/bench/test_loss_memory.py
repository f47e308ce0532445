"""bench/loss_memory.py --device cpu --tiny: both paths reported, the fused one saving no logits and agreeing."""

from __future__ import annotations

import json

import pytest

# a whole script run in a child process: the full suite's; the code it drives has fast tests in its package
pytestmark = pytest.mark.slow


def test_tiny_run_reports_both_paths(tmp_path, script):
    out = tmp_path / "loss_memory.json"
    done = script("loss_memory", "--device", "cpu", "--tiny", "--iters", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["dtype"] == "bf16" and report["date"]
    assert [c["case"]["name"] for c in report["cases"]] == ["tiny seq64 mbs1", "tiny seq64 mbs2"]
    for case in report["cases"]:
        unfused, fused = case["paths"]
        assert (unfused["path"], unfused["chunk_logits"]) == ("unfused", 0)
        assert fused["path"] == "fused" and 0 < fused["chunk_logits"]
        for row in (unfused, fused):
            assert row["forward_ms"] > 0 and row["forward_backward_ms"] > 0
            assert row["peak_extra_mib"] is None  # CUDA memory statistics only
        tokens = case["case"]["seq_length"] * case["case"]["micro_batch_size"]
        logits_mib = tokens * case["case"]["padded_vocab"] * 2 / 2**20  # bf16 logits
        assert unfused["saved_mib"] >= logits_mib  # the unfused path keeps [tokens, vocab] tensors
        assert fused["saved_mib"] < logits_mib / 10  # the fused one [tokens] vectors and the labels
        assert fused["loss_abs_diff"] < 1e-2  # fp32 loss from bf16 logits either way
        assert fused["grad_weight_rel_diff"] < 2e-2 and fused["grad_hidden_rel_diff"] < 2e-2
    assert "fused" in done.stdout
