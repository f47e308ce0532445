"""executor/microbench/grouped_mm_check.py on the CPU: every grouped product of the bf16 and fp8 expert paths
lands in its precision's error band against the fp64 loop, and a wrong group is reported as such."""

from __future__ import annotations

import pytest
import torch

from executor.microbench.grouped_mm_check import _rel_errors, probe


def test_per_group_error_counts_an_empty_groups_output_and_each_group_alone():
    ref = torch.tensor([[0.0, 0.0], [3.0, 4.0], [30.0, 40.0]])
    got = torch.tensor([[0.5, 0.0], [3.0, 4.0], [30.0, 40.5]])
    assert _rel_errors(got, ref, [0]) == 0.5  # empty group: its output must be 0
    assert _rel_errors(got, ref, [1, 2]) == pytest.approx(0.01)  # 0.5 / 50, not diluted


def test_cpu_probe_puts_every_product_in_its_band():
    errors = probe("cpu")
    assert set(errors) == {f"{p} {g}" for p in ("bf16", "fp8") for g in ("fwd", "dgrad", "wgrad")} | {
        "swiglu dx", "swiglu dw13", "swiglu dw2"}
    for product, err in errors.items():
        low, high = (0.01, 0.06) if product.startswith("fp8") else (1e-4, 1e-2)  # e4m3 / bf16 rounding
        assert low < err < high, (product, err)


def test_a_wrong_grouped_product_fails_the_probe(monkeypatch):
    real = torch._grouped_mm

    def off_by_one_row(a, b, offs=None, **kw):  # each group boundary one row early: a plausible kernel fault
        early = (offs - 1).clamp(min=0)
        early[-1] = offs[-1]
        return real(a, b, offs=early, **kw)

    monkeypatch.setattr(torch, "_grouped_mm", off_by_one_row)
    errors = probe("cpu")
    assert min(errors["bf16 fwd"], errors["bf16 dgrad"], errors["bf16 wgrad"]) > 0.1  # the probe's limit
