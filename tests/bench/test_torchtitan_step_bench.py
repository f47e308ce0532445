"""bench/torchtitan_step.py off the GPU: its argument errors, its refusal to run without CUDA or torchtitan, and
``--render``, which turns saved reports (what a remote GPU run sends back) into its docs/benchmarks.md section:
the speed-up computed from the two step times, failed sides shown as failures, and the placeholders listed."""

from __future__ import annotations

import json

import pytest
import torch

BASE = {"date": "2026-12-04T20:40:33+00:00", "machine": "1x NVIDIA H200", "torch": "2.11.0+cu130",
        "torchtitan": "0.3.0", "layers": 4, "seq": 4096, "mbs": 1, "micro_batches": 4, "warmup": 3, "steps": 8,
        "commit": "abc1234", "command": "python3 -m bench.torchtitan_step --steps 8"}


def test_unknown_model_is_refused_by_name(script):
    done = script("torchtitan_step", "--models", "qwen3-30b-a3b,llama-7b")
    assert done.returncode == 2 and "--models" in done.stderr and "llama-7b" in done.stderr


def test_bad_counts_are_refused(script):
    done = script("torchtitan_step", "--steps", "0")
    assert done.returncode == 2 and "--steps must be at least 1" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_says_why_and_exits_2(script):
    done = script("torchtitan_step")
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr and "Traceback" not in done.stderr


def test_render_writes_the_section_with_speedups_and_failures(tmp_path, script):
    report = dict(BASE, rows=[
        {"model": "qwen3-30b-a3b",
         "foldtune": {"step_ms": 200.0, "tokens_per_s": 81920.0},
         "torchtitan": {"step_ms": 300.0, "tokens_per_s": 54613.0, "cuda_graphs": False,
                        "loss": "CrossEntropyLoss", "reshard_after_forward": "never", "placeholders": ["datasets"]}},
        {"model": "deepseek-v2-lite", "foldtune": {"step_ms": 150.0, "tokens_per_s": 109226.0},
         "torchtitan": {"error": "RuntimeError: boom"}}])
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    doc = tmp_path / "bench.md"
    doc.write_text("# Benchmarks\n\n## Another section\n\nkept\n")
    done = script("torchtitan_step", "--render", str(path), "--doc", str(doc))
    assert done.returncode == 0, done.stderr
    text = doc.read_text()
    assert "## Another section\n\nkept" in text
    assert "| qwen3-30b-a3b | 200.0 | 300.0 | CrossEntropyLoss, never | off | 81,920 | 54,613 | 1.50x |" in text
    assert "| deepseek-v2-lite | 150.0 | failed: RuntimeError: boom |" in text
    assert "at abc1234, 2026-12-04 20:40 UTC" in text and "`datasets`" in text
    # a second render replaces the section rather than appending another
    assert script("torchtitan_step", "--render", str(path), "--doc", str(doc)).returncode == 0
    assert doc.read_text().count("foldtune's step against torchtitan") == 1


def test_render_refuses_a_file_that_is_not_a_report(tmp_path, script):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    doc = tmp_path / "bench.md"
    done = script("torchtitan_step", "--render", str(bad), "--doc", str(doc))
    assert done.returncode == 2 and "not a report of this script" in done.stderr and "Traceback" not in done.stderr
    assert not doc.exists()
