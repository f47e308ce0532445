"""Overlap interference: how much of a "hidden" collective still costs compute time.

The time model hides gradient reduce-scatters behind the last micro-batch's backward and parameter
all-gathers behind the first forward. Hidden is not free: the collective's kernels take SMs and HBM
bandwidth from the GEMMs they run beside. This benchmark measures that cost on the machine at hand:

* ``gemm_s``: a loop of bf16 GEMMs alone, sized to last about 1.5x the collective;
* ``comm_s``: a gradient-sized reduce-scatter (fp32, over every rank) alone;
* ``both_s``: the reduce-scatter launched asynchronously and the same GEMM loop issued at once, until both
  have finished.

``slowdown = (both_s - max(gemm_s, comm_s)) / comm_s``, clamped to [0, 1]: the fraction of the hidden
collective's seconds that the pair still costs. 0 is perfect overlap, 1 is none. The time model adds
``slowdown x hidden seconds`` to the overlapped gradient and parameter collectives
(``HardwareProfile.overlap_slowdown``).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from executor.microbench.timing import synchronize
from executor.parallel.collectives import reduce_scatter_tensor

GPU_GEMM_N = 8192
GPU_COMM_BYTES = 1 << 29  # 512 MiB of fp32 gradients: a few 25 MiB buckets' worth times the world size
CPU_GEMM_N = 192
CPU_COMM_BYTES = 1 << 22
REPEATS = 5


def _seconds(fn, device: torch.device) -> float:
    """Wall seconds of ``fn()`` from an idle device to all its work done (every rank starts together)."""
    dist.barrier()
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def measure_overlap(world_size: int, device: torch.device, dtype: torch.dtype) -> dict:
    """``{'gemm_s', 'comm_s', 'both_s', 'slowdown', 'gemm_iters', 'comm_bytes'}`` on this rank, medians of
    REPEATS. Every rank must call it (the reduce-scatter spans the whole world)."""
    gpu = device.type == "cuda"
    n = GPU_GEMM_N if gpu else CPU_GEMM_N
    nbytes = GPU_COMM_BYTES if gpu else CPU_COMM_BYTES
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    numel = nbytes // 4 // world_size * world_size
    full = torch.ones(numel, device=device, dtype=torch.float32)
    shard = torch.empty(numel // world_size, device=device, dtype=torch.float32)

    def comm(async_op: bool = False):
        return reduce_scatter_tensor(shard, full, async_op=async_op)

    def gemms(iters: int) -> None:
        for _ in range(iters):
            torch.mm(a, b)

    for _ in range(2):  # warm-up: NCCL connections, cuBLAS handles
        _seconds(comm, device)
        _seconds(lambda: gemms(2), device)
    comm_s = statistics.median(_seconds(comm, device) for _ in range(REPEATS))
    one = statistics.median(_seconds(lambda: gemms(4), device) for _ in range(3)) / 4
    iters = torch.tensor([max(2, round(1.5 * comm_s / max(one, 1e-7)))], device=device)
    dist.all_reduce(iters, op=dist.ReduceOp.MAX)  # the same loop on every rank
    iters = int(iters.item())
    gemm_s = statistics.median(_seconds(lambda: gemms(iters), device) for _ in range(REPEATS))

    def both() -> None:
        work = comm(async_op=True)
        gemms(iters)
        work.wait()

    both_s = statistics.median(_seconds(both, device) for _ in range(REPEATS))
    slowdown = min(1.0, max(0.0, (both_s - max(gemm_s, comm_s)) / comm_s))
    return {"gemm_s": gemm_s, "comm_s": comm_s, "both_s": both_s, "slowdown": slowdown, "gemm_iters": iters,
            "comm_bytes": numel * 4}
