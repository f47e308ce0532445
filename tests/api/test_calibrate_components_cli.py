"""``foldtune calibrate --model NAME --seq S``: component factors land in the saved profile, per model shape."""

from __future__ import annotations

import json

import pytest

from api.cli.main import main
from spec.profile_io import load_profile

pytestmark = pytest.mark.slow


def test_calibrate_with_a_model_stores_factors_per_shape(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    base = ["calibrate", "--gpu", "cpu", "--gpus", "1", "--quick", "--model", "tiny-moe", "--layers", "1",
            "--mbs", "2", "--components", "isolated", "--out", str(out)]
    assert main([*base, "--seq", "32"]) == 0
    text = capsys.readouterr().out
    assert "component  measured (s) predicted (s)  factor  timed as" in text
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


def test_calibrate_in_step_components_from_a_real_step(tmp_path, capsys):
    """The default mode runs one 1-GPU training step of the model (spawned rank, phase timer on) and reads
    its phases as components: every component of tiny-moe, the embedding included, gets a time."""
    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--gpu", "cpu", "--gpus", "1", "--quick", "--model", "tiny-moe", "--seq", "64",
                 "--step-micro-batches", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "(in-step)" in text and "1-GPU step tp1 cp1 pp1" in text
    record = json.loads(out.read_text())["raw"]["components"]
    names = {c["name"] for c in record["components"]}
    assert {"attention", "moe", "head", "embedding", "optimizer"} <= names
    assert set(record["timing"].values()) == {"in-step phases"}
    assert all(c["measured_s"] > 0 for c in record["components"])
    assert record["step"]["global_batch_size"] == 2 and record["step"]["phases"]["experts"] > 0
    factors = dict(dict(load_profile(out).component_factors)["tiny-moe@seq64@mbs1"])
    assert {"gemm", "grouped_gemm", "memory_bound", "optimizer"} <= set(factors)
    assert all(f > 0 for f in factors.values())
    # the host probe needs CUDA: on CPU ranks it says so and stores no host factor
    assert "host probe: skipped on CPU ranks" in text
    assert "host" not in factors and "host_probe" not in record


def test_calibrate_model_needs_seq(capsys):
    assert main(["calibrate", "--gpu", "cpu", "--model", "tiny-moe"]) == 2
    assert "--model needs --seq" in capsys.readouterr().err
    assert main(["calibrate", "--gpu", "cpu", "--model", "nope", "--seq", "32"]) == 2
