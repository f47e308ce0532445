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
