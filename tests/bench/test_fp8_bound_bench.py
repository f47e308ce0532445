"""bench/fp8_bound.py's choice of the bf16 step (off the GPU): a bench.step_kernels_gpu report's row of the model
at the micro-batch asked for, or a clear refusal naming what is missing; the GPU check comes only after."""

from __future__ import annotations

import json

import pytest
import torch

REPORT = {"layers": 4, "seq": 4096, "gbs": 8,
          "runs": [{"model": "qwen3-30b-a3b", "precision": "bf16", "mbs": 8, "step_ms": 250.0,
                    "classes_ms": {"grouped GEMM": 47.6}},
                   {"model": "qwen3-30b-a3b", "precision": "fp8", "mbs": 1, "step_ms": 330.0}]}


def test_a_missing_row_is_refused_by_model_and_micro_batch(tmp_path, script):
    path = tmp_path / "sk.json"
    path.write_text(json.dumps(REPORT))
    done = script("fp8_bound", "--step-json", str(path), "--model", "qwen3-30b-a3b", "--mbs", "1")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "no bf16 row of qwen3-30b-a3b at micro-batch 1" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the row's GEMMs would be timed, not refused")
def test_a_present_row_gets_past_the_report_to_the_gpu_check(tmp_path, script):
    path = tmp_path / "sk.json"
    path.write_text(json.dumps(REPORT))
    done = script("fp8_bound", "--step-json", str(path), "--model", "qwen3-30b-a3b", "--mbs", "8")
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr and "not a bench" not in done.stderr
