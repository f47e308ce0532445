"""Tensor-core throughput under sustained load, against the short bursts the GEMM curve is timed in.

The GEMM curve (:mod:`executor.microbench.gemm`) times loops of about 10 ms from an idle device: the card is
cool and at its boost clock. A training step keeps the tensor cores busy for seconds, and a 700 W Hopper
card then lowers its SM clock to stay under its power limit (nvidia-smi reports the software power cap as the
reason), so the sustained rate is several per cent below the burst (docs/benchmarks.md, "Sustained load",
has the H100 measurements). :func:`measure_sustained` measures the ratio on the benchmarked dtype over a run
long enough to pass the first seconds' fall (``SUSTAINED_SECONDS``); the time model scales the GPU's compute
peaks by it (``HardwareProfile.sustained_clock_factor``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from executor.microbench.gemm import gemm_product
from executor.microbench.timing import synchronize, time_op

SUSTAINED_SECONDS = 10.0  # its second half: past the first seconds' fall, near a 40 s run's settled rate
WINDOW_S = 0.05


def measure_sustained(device: torch.device, dtype: torch.dtype, seconds: float = SUSTAINED_SECONDS,
                      n: int = 8192, *, clock: Callable[[], float] = time.perf_counter,
                      sleep: Callable[[float], None] = time.sleep) -> dict:
    """Burst and sustained FLOP/s of one ``n``³ GEMM in ``dtype``.

    ``burst_flops_per_s``: timed as the GEMM curve is (short loops, after an idle second).
    ``sustained_flops_per_s``: the median of ~50 ms windows over the second half of ``seconds`` of
    back-to-back GEMMs. ``factor`` = sustained / burst, capped at 1 (a card that holds its clock reads 1;
    noise above it is not a speed-up). Returns those plus ``windows_flops_per_s`` (every window, in order).
    ``clock`` (seconds) and ``sleep`` time the run and its windows; tests pass their own, so that the number
    of windows does not depend on how busy the machine is.
    """
    op = gemm_product(n, n, n, device, dtype)
    flops = 2.0 * n**3
    op()
    synchronize(device)
    sleep(1.0)  # idle, as before the curve's own loops
    burst = flops / time_op(op, device)
    per_window = max(1, int(WINDOW_S * burst / flops))
    windows: list[tuple[float, float]] = []  # (seconds since start, FLOP/s)
    start = clock()
    while (now := clock() - start) < seconds:
        t0 = clock()
        for _ in range(per_window):
            op()
        synchronize(device)
        windows.append((now, flops * per_window / (clock() - t0)))
    return {"n": n, **summarize(windows, seconds, burst)}


def summarize(windows: list[tuple[float, float]], seconds: float, burst: float) -> dict:
    """``windows`` (start second, FLOP/s) of a ``seconds``-long run and the ``burst`` FLOP/s → the figures of
    :func:`measure_sustained`: the median over windows starting in the second half, its ratio to the burst."""
    late = [rate for t, rate in windows if t >= seconds / 2] or [windows[-1][1]]
    sustained = statistics.median(late)
    return {"seconds": seconds, "burst_flops_per_s": burst, "sustained_flops_per_s": sustained,
            "factor": min(1.0, sustained / burst), "windows_flops_per_s": [rate for _, rate in windows]}
