"""bench/cp_comm_gpu.py's CPU smoke run: every CP communication type of a 4-rank world runs the executor's code,
matches causal attention over the whole sequence and is priced by the cost model."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_cpu_smoke_run_checks_every_type(script):
    done = script("cp_comm_gpu", "--cpu", "--world", "4")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 64 ") or line.startswith("| 128 ")]
    assert len(rows) == 2 and all(row.count("✓") == 4 for row in rows), done.stdout
    assert "cp_comm=a2a+p2p:2x2" in done.stdout


def test_one_rank_times_the_core_alone_with_the_shape_asked(script):
    """On one GPU (``--world 1 --cp1``) only the single-GPU core column is measured and priced, at the heads
    asked for; without ``--cp1`` there is nothing to time, and it says so."""
    done = script("cp_comm_gpu", "--cpu", "--world", "1", "--cp1", "--kv-heads", "2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "| seq | cp1 core (1 GPU) |" in done.stdout and "4/2 heads" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 64 ") or line.startswith("| 128 ")]
    assert len(rows) == 2 and all(row.count("|") == 3 and " / " in row for row in rows), done.stdout
    refused = script("cp_comm_gpu", "--cpu", "--world", "1")
    assert refused.returncode == 2 and "add --cp1" in refused.stderr
