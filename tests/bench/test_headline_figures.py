"""``python3 -m bench.headline_figures --no-write``: every headline run priced, with its published figure, the
prediction and the per-term breakdown of its miss."""

from __future__ import annotations

import pytest

from costmodel.published_runs import HEADLINE_RUNS

# a whole script run in a child process: the full suite's; the arithmetic it drives has fast tests
# (tests/costmodel/test_published_memory.py)
pytestmark = pytest.mark.slow


def test_headline_figures_prints_every_run_and_its_terms(script):
    proc = script("headline_figures", "--no-write")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("## The seeds' headline figures, priced by the cost model")
    for run in HEADLINE_RUNS:
        assert f"| {run.key} |" in out and f"**{run.key}**" in out
    for published in ("1,233 TFLOPS", "1,048 TFLOPS", "974 TFLOPS", "919 TFLOPS", "49.3% MFU", "39.0% MFU"):
        assert published in out, published
    assert out.count("| term | predicted s | share | factor to close |") == len(HEADLINE_RUNS)
    assert "Cost-model predictions at commit `" in out
