"""The memory-bound benchmark: every op class timed forward + backward at every size, on the executor's code."""

from __future__ import annotations

import math

import torch

from executor.microbench import memory_bound
from spec.hardware import MEMORY_OP_CLASSES


def test_every_class_is_timed_at_every_size():
    sizes = ((32, 16), (64, 32))
    rows = memory_bound.measure_memory_bound(sizes, torch.device("cpu"), torch.float32, repeats=1)
    assert [(r["op"], r["rows"], r["width"]) for r in rows] == [(op, *s) for op in MEMORY_OP_CLASSES for s in sizes]
    assert all(math.isfinite(r["seconds"]) and r["seconds"] > 0 and r["elem_bytes"] == 4 for r in rows)
    assert {r["copies"] for r in rows if r["op"] == "permute"} == {memory_bound.PERMUTE_COPIES}
    assert {r["copies"] for r in rows if r["op"] != "permute"} == {1}


def test_each_call_runs_the_backward_into_fresh_gradients():
    for op in MEMORY_OP_CLASSES:
        call, inputs = memory_bound._op(op, 8, 4, torch.device("cpu"), torch.float32)
        assert bool(inputs) == (op != "activation")  # the experts' node computes the activation's gradient itself
        call()
        first = [t.grad.clone() for t in inputs]
        call()  # the same inputs and output gradient: the same gradients, not twice them
        assert all(torch.equal(a, t.grad) for a, t in zip(first, inputs)), op
    call, (x, y) = memory_bound._op("elementwise", 8, 4, torch.device("cpu"), torch.float32)
    call()
    assert x.grad is not None and torch.allclose(x.grad / y, y.grad / x)  # d(xy)/dx = g y, d/dy = g x


def test_sizes_start_at_a_tiny_models_shape_on_cpu():
    cpu = memory_bound.default_sizes(torch.device("cpu"), quick=True)
    assert cpu[0] == (256, 64) and list(cpu) == sorted(cpu)
