"""bench/grad_accumulate_gpu.py's CPU smoke run: torch only in this process, torch and the kernel (Triton's
interpreter) in a child; every row timed, the kernel bitwise equal to torch; a disagreeing kernel fails it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench import grad_accumulate_gpu as bench


def test_cpu_smoke_run_without_the_kernel(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "acc.json"
    assert bench.main(["--device", "cpu", "--tiny", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert not result["kernel_ran"] and result["bytes_per_element"] == 10
    assert [r["elements"] for r in result["rows"]] == [n for _, n in bench.TINY_SIZES]
    assert all(r["torch_ms"] > 0 and "kernel_ms" not in r for r in result["rows"])


def test_cpu_smoke_run_with_the_kernel_in_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "acc.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "bench.grad_accumulate_gpu", "--device", "cpu", "--tiny", "--fp16",
                           "--sweep", "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["kernel_ran"] and result["first_use_check"] == {"bfloat16": True, "float16": True}
    assert len(result["rows"]) == 2 * len(bench.TINY_SIZES)
    assert all(r["bitwise_equal"] and r["kernel_ms"] > 0 for r in result["rows"])
    assert [(r["block"], r["vec"], r["num_warps"]) for r in result["sweep"]] == list(bench.SWEEP)
    assert all(r["bitwise_equal"] and r["ms"] > 0 for r in result["sweep"])


def test_a_kernel_that_differs_fails_the_bench(tmp_path, monkeypatch):
    """As if the kernel ran (torch standing in for it) but dropped the last element: exit status 1."""
    monkeypatch.setattr(bench, "kernel_runs", lambda device: True)
    monkeypatch.setattr(bench.acc, "checked", lambda dtype, device: True)

    def short(main, grad, *config):
        main[:-1].add_(grad[:-1])
        return main

    monkeypatch.setattr(bench.acc, "accumulate_", short)
    assert bench.main(["--device", "cpu", "--tiny", "--out", str(tmp_path / "acc.json")]) == 1
    rows = json.loads((tmp_path / "acc.json").read_text())["rows"]
    assert [r["bitwise_equal"] for r in rows] == [False] * len(rows)
