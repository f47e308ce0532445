"""bench/cuda_graphs_gpu.py --predict-only (no GPU): the cost model's CUDA-graph gain per model, against the
catalog entry or a stored calibrated profile, whose measured MoE-layer host time makes the host, and so the
graphs, count at a short sequence; a file that is no profile is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

PROFILE = Path(__file__).resolve().parents[2] / "bench" / "results" / "h200-fp8-calibration_2026-12-04_1613a6b.json"


def _gains(script, tmp_path, *args) -> dict[str, float]:
    out = tmp_path / "cg.json"
    done = script("cuda_graphs_gpu", "--predict-only", "--seq", "512", "--gbs", "16", "--out", str(out), *args)
    assert done.returncode == 0, done.stderr
    return {name: entry["predicted"]["gain"] for name, entry in json.loads(out.read_text())["models"].items()}


def test_a_calibrated_profile_prices_more_of_the_graphs_gain_than_the_catalog(tmp_path, script):
    catalog = _gains(script, tmp_path)
    calibrated = _gains(script, tmp_path, "--profile", str(PROFILE))
    assert set(catalog) == set(calibrated) == {"qwen3-30b-a3b", "deepseek-v2-lite"}
    # measured on an H200 (docs/benchmarks.md, "CUDA graphs as a layout knob"): 1.54x and 2.53x at seq 512
    assert all(calibrated[m] > max(catalog[m], 1.1) for m in catalog), (catalog, calibrated)


def test_a_file_that_is_no_profile_is_refused(tmp_path, script):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    done = script("cuda_graphs_gpu", "--predict-only", "--profile", str(bad))
    assert done.returncode == 2 and "--profile" in done.stderr and "Traceback" not in done.stderr
