"""bench/finegrained_moe.py end to end on the CPU (``--tiny``): it measures, writes its record, prices it and
renders a stored record again without measuring, as the lead runs it (``python3 bench/finegrained_moe.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_script_runs_tiny_on_the_cpu_and_renders_its_file(tmp_path, script):
    out = tmp_path / "fg.json"
    done = script("finegrained_moe", "--tiny", "--models", "qwen3-30b-a3b", "--local-experts", "2,4", "--tokens",
                  "8", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "point qwen3-30b-a3b@tiny@1L, 4 local experts (EP 2)" in done.stdout
    record = json.loads(out.read_text())
    assert record["kind"] == "finegrained_moe" and record["priced_on"] == "cpu" and len(record["points"]) == 2
    assert set(record["derived"]) >= {"local_expert_host_s", "moe_router_factor", "moe_permute_factor"}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    again = subprocess.run([sys.executable, "bench/finegrained_moe.py", "--render", str(out)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert "| qwen3-30b-a3b@tiny | 8 | 1 |" in again.stdout  # the exchange table: EP 8 of the tiny 8 experts
    assert "the latency between GPUs needs two or more GPUs" in again.stdout
