"""The components' timing (executor/microbench/components.py): each block is issued COMPONENT_CALLS times back to
back with one sync per window, as a training step runs its blocks, and the mean per call is reported."""

from __future__ import annotations

import torch

from executor.microbench import components, timing
from spec.catalog import get_model


def test_blocks_are_timed_back_to_back_with_one_sync_per_window(monkeypatch):
    log = []
    monkeypatch.setattr(timing, "synchronize", lambda device: log.append("sync"))
    clock = iter(range(100))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(clock)))
    calls = components.COMPONENT_CALLS
    seconds = timing.time_op(lambda: log.append("op"), torch.device("cpu"), iters=calls, warmup=1, repeats=2)
    assert log == ["sync", "op", "sync"] + (["op"] * calls + ["sync"]) * 2
    assert seconds == 1 / calls  # each window reads the clock twice: one tick over its calls


def test_measure_components_times_every_block_back_to_back_and_the_optimizer_alone(monkeypatch):
    used = []

    def back_to_back(op, device, iters=None, **kw):
        used.append(("time_op", iters))
        return 1.0

    def alone(op, device, **kw):
        used.append(("time_device", None))
        return 1.0

    monkeypatch.setattr(components, "time_op", back_to_back)
    monkeypatch.setattr(components, "time_device", alone)
    _, measured = components.measure_components(get_model("tiny-moe"), 32, 1, "fp32", "cpu", optimizer_params=4096)
    blocks = [name for name in measured if name != "optimizer"]
    assert used == [("time_op", components.COMPONENT_CALLS)] * len(blocks) + [("time_device", None)]
