"""executor/microbench/grad_accumulate.py on CPU: torch only where the kernel does not run; every row timed; a
kernel that disagrees with torch fails the run."""

from __future__ import annotations

import torch

from executor.microbench import grad_accumulate as bench


def test_cpu_run_without_the_kernel(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    result = bench.run("cpu", tiny=True, huge=False, dtypes=[torch.bfloat16])
    assert not result["kernel_ran"] and result["bytes_per_element"] == 10
    assert [r["elements"] for r in result["rows"]] == [n for _, n in bench.TINY_SIZES]
    assert all(r["torch_ms"] > 0 and "kernel_ms" not in r for r in result["rows"])
    assert bench.passed(result)


def test_a_kernel_that_differs_fails_the_run(monkeypatch):
    """As if the kernel ran (torch standing in for it) but dropped the last element."""
    monkeypatch.setattr(bench, "kernel_runs", lambda device: True)
    monkeypatch.setattr(bench.acc, "checked", lambda dtype, device: True)

    def short(main, grad, *config):
        main[:-1].add_(grad[:-1])
        return main

    monkeypatch.setattr(bench.acc, "accumulate_", short)
    result = bench.run("cpu", tiny=True, huge=False, dtypes=[torch.bfloat16])
    assert [r["bitwise_equal"] for r in result["rows"]] == [False] * len(result["rows"])
    assert not bench.passed(result)
