"""bench/grad_accumulate_gpu.py's CPU smoke run with the kernel in Triton's interpreter (a child process):
every row timed, the kernel bitwise equal to torch, every launch configuration of the sweep tried."""

from __future__ import annotations

import json

import pytest

from executor.microbench.grad_accumulate import SWEEP, TINY_SIZES

# a whole script run in a child process: the full suite's; the code it drives has fast tests in its package
pytestmark = pytest.mark.slow


def test_cpu_smoke_run_with_the_kernel_in_the_interpreter(tmp_path, script):
    pytest.importorskip("triton")
    out = tmp_path / "acc.json"
    done = script("grad_accumulate_gpu", "--device", "cpu", "--tiny", "--fp16", "--sweep", "--out", str(out),
                  env={"TRITON_INTERPRET": "1"}, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["kernel_ran"] and result["first_use_check"] == {"bfloat16": True, "float16": True}
    assert len(result["rows"]) == 2 * len(TINY_SIZES)
    assert all(r["bitwise_equal"] and r["kernel_ms"] > 0 for r in result["rows"])
    assert [(r["block"], r["vec"], r["num_warps"]) for r in result["sweep"]] == list(SWEEP)
    assert all(r["bitwise_equal"] and r["ms"] > 0 for r in result["sweep"])
