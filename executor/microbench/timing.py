"""Timing of a device operation: warm-up, then the median of several timed repeats (:func:`time_op`: wall
clock over a loop of calls; :func:`time_device`: one call at a time, CUDA events on a GPU)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(op: Callable[[], object], device: torch.device, iters: int | None = None, repeats: int = 3,
            warmup: int = 2, target_s: float = 0.01) -> float:
    """Median over ``repeats`` of the mean seconds of one ``op()`` call in a loop of ``iters`` calls.

    ``iters`` None sizes the loop to about ``target_s`` seconds from the last warm-up call (only for
    single-rank work: ranks of a collective must agree on the count, so they pass it).
    """
    for _ in range(max(1, warmup)):
        synchronize(device)
        start = time.perf_counter()
        op()
        synchronize(device)
        last = time.perf_counter() - start
    if iters is None:
        iters = max(1, min(1000, int(target_s / max(last, 1e-7))))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            op()
        synchronize(device)
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def time_device(op: Callable[[], object], device: torch.device, warmup: int = 2,
                repeats: int = 5) -> float:
    """Median seconds of ``op()`` over ``repeats`` runs after ``warmup``: CUDA events on a GPU, wall clock
    (``op`` is synchronous there) on the CPU."""
    for _ in range(warmup):
        op()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            op()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            op()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)

