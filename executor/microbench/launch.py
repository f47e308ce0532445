"""Host-side overhead: seconds per eager PyTorch op launch and per small collective.

A layer of a small model (hidden a few hundred) runs hundreds of tiny kernels per micro-batch whose
device time is negligible; the step is then bounded by how fast the host issues them (Python, the
dispatcher, the CUDA launch path). These benchmarks measure that rate directly:

* ``op_launch_s``: wall seconds of one eager op on a 1-element tensor, from a loop of N such ops ended
  by one synchronisation. The device finishes each tiny kernel faster than the host queues the next,
  so the loop measures the host's issue rate (dispatch + launch), not device time.
* ``collective_launch_s``: wall seconds of one all-reduce of a 1-element tensor over the whole world,
  from a loop of N ended by one synchronisation: the fixed host + protocol cost of a collective that
  moves no meaningful bytes (None with a single rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from executor.microbench.timing import time_op

# Loop lengths: long enough that the final synchronisation (~10-50 us) is under 1 % of the loop and
# a 5-10 us launch cost is resolved; short enough for well under a second per benchmark on a GPU.
OPS_PER_LOOP = 2000
COLLECTIVES_PER_LOOP = 200
CPU_COLLECTIVES_PER_LOOP = 20  # gloo on shared CPU cores: each call costs tens of microseconds or more


def measure_op_launch(device: torch.device, ops: int = OPS_PER_LOOP, repeats: int = 3) -> float:
    """Seconds per eager op launch (median of ``repeats`` loops of ``ops`` in-place adds on one element)."""
    x = torch.zeros(1, device=device, dtype=torch.float32)
    return time_op(lambda: x.add_(1.0), device, iters=ops, repeats=repeats, warmup=max(2, ops // 100))


def measure_collective_launch(device: torch.device, calls: int | None = None, repeats: int = 3) -> float | None:
    """Seconds per all-reduce of one element over the default group; None without a multi-rank group.

    Every rank must call this (the ranks agree on ``calls``); take the max over ranks.
    """
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    calls = calls or (COLLECTIVES_PER_LOOP if device.type == "cuda" else CPU_COLLECTIVES_PER_LOOP)
    x = torch.zeros(1, device=device, dtype=torch.float32)
    dist.barrier()
    seconds = time_op(lambda: dist.all_reduce(x), device, iters=calls, repeats=repeats, warmup=3)
    dist.barrier()
    return seconds


def measure_launch(device: torch.device) -> dict:
    """``{'op_launch_s', 'collective_launch_s'}`` on this rank (every rank of a group must call it)."""
    return {"op_launch_s": measure_op_launch(device), "collective_launch_s": measure_collective_launch(device)}
