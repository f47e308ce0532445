"""executor/microbench/timing.time_steady: calls issued back to back, one sync per window, the mean per call."""

from __future__ import annotations

import torch

from executor.microbench import timing


def test_calls_run_back_to_back_with_one_sync_per_window(monkeypatch):
    log = []
    monkeypatch.setattr(timing, "synchronize", lambda device: log.append("sync"))
    clock = iter(range(100))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(clock)))
    seconds = timing.time_steady(lambda: log.append("op"), torch.device("cpu"), calls=4, warmup=1, repeats=2)
    assert log == ["op", "sync"] + (["op"] * 4 + ["sync"]) * 2
    assert seconds == 1 / 4  # each window reads the clock twice: one tick over its four calls
