"""``foldtune calibrate --model NAME --seq S``: component factors land in the saved profile, per model shape."""

from __future__ import annotations

import json

import pytest

from api.cli.main import main
from spec.profile_io import load_profile

pytestmark = pytest.mark.slow


def test_calibrate_with_a_model_stores_factors_per_shape(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    base = ["calibrate", "--gpu", "cpu", "--ranks", "1", "--quick", "--model", "tiny-moe", "--layers", "1",
            "--mbs", "2", "--out", str(out)]
    assert main([*base, "--seq", "32"]) == 0
    text = capsys.readouterr().out
    assert "component   measured ms  predicted ms  factor  timed as" in text
    assert "term factors for tiny-moe@1L@seq32@mbs2" in text
    # the stored report says how each component was timed (CPU: wall clock; a GPU: device time, host ahead)
    timing = json.loads(out.read_text())["raw"]["components"]["timing"]
    assert timing == {"attention": "wall clock", "moe": "wall clock", "head": "wall clock", "optimizer": "wall clock"}
    assert any(line.startswith("attention") and line.endswith("wall clock") for line in text.splitlines())
    assert main([*base, "--seq", "64"]) == 0  # a second shape into the same file keeps the first
    factors = dict(load_profile(out).component_factors)
    assert set(factors) == {"tiny-moe@1L@seq32@mbs2", "tiny-moe@1L@seq64@mbs2"}
    assert {t for t, _ in factors["tiny-moe@1L@seq64@mbs2"]} == {"gemm", "grouped_gemm", "attention_core",
                                                             "memory_bound", "optimizer"}


def test_calibrate_model_needs_seq(capsys):
    assert main(["calibrate", "--gpu", "cpu", "--model", "tiny-moe"]) == 2
    assert "--model needs --seq" in capsys.readouterr().err
    assert main(["calibrate", "--gpu", "cpu", "--model", "nope", "--seq", "32"]) == 2
