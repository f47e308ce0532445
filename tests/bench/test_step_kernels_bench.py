"""bench/step_kernels_gpu.py on CPU (a child process): one row per precision, micro-batch and keep_logits value,
its step timed and its JSON written; a CPU run has no CUDA kernels to sort and leaves docs/benchmarks.md alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a whole script run in a child process

DOC = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


def test_cpu_smoke_run_writes_its_rows_and_not_the_docs(tmp_path, script):
    before = DOC.read_text()
    out = tmp_path / "sk.json"
    done = script("step_kernels_gpu", "--models", "tiny-moe", "--layers", "1", "--seq", "64", "--gbs", "2",
                  "--runs", "fp32:1,fp32:2", "--keep-logits", "0,default", "--commit", "abc1234", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["commit"] == "abc1234"
    rows = [(r["precision"], r["mbs"], r["keep_logits"] > 0) for r in report["runs"]]
    assert rows == [("fp32", 1, False), ("fp32", 1, True), ("fp32", 2, False), ("fp32", 2, True)]
    assert all(r["step_ms"] > 0 and r["kernels"] == 0 for r in report["runs"])
    assert "docs/benchmarks.md" not in done.stdout and DOC.read_text() == before
