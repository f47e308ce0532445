"""bench/fp8_grouped_gemm.py's CPU smoke mode: every product of both expert weights through foldtune's grouped
fp8 path (emulated on the CPU), with its error against bf16 and the per-layer sums, written as JSON."""

from __future__ import annotations

import json

import pytest

# a whole script run in a child process: the full suite's; the code it drives has fast tests in its package
pytestmark = pytest.mark.slow


def test_tiny_mode_runs_every_product_in_both_scalings(tmp_path, script):
    out = tmp_path / "gg.json"
    done = script("fp8_grouped_gemm", "--tiny", "--calls", "1", "--out", str(out), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [(r["weight"], r["product"]) for r in res["rows"]] == [
        (w, p) for w in ("w13", "w2") for p in ("fwd", "dgrad", "wgrad")]
    for r in res["rows"]:
        for scaling in ("rowwise", "blockwise"):
            assert 0.01 < r[f"{scaling}_rel_err"] < 0.05  # e4m3's band against bf16: the fp8 path ran, right
            assert r[f"{scaling}_s"] > 0 and r[f"{scaling}_config"] == "emulated"
    assert [(layer["model"], layer["weight"]) for layer in res["layers"]] == [("tiny-moe", "w13"), ("tiny-moe", "w2")]
    assert "| tiny-moe | 64 | w13 fwd | 128 × 64 × 64, 8 |" in done.stdout
