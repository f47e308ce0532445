"""Collective timings over message sizes and group sizes, every group of a size running at once.

Groups are consecutive ranks (the stride-1 groups of TP, EP and ETP·EP); with a group size below the
world size all groups run concurrently, as they do in training. Each collective's ``bytes`` is the
full-size buffer of the cost model's formulas (``costmodel.comm``): the gathered output of an
all-gather, the input of a reduce-scatter, the buffer of an all-reduce, the per-rank buffer of an
all-to-all, the payload of a p2p send. A time is the slowest rank's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from executor.microbench.timing import time_op
from executor.parallel.collectives import all_gather_tensor, reduce_scatter_tensor

COLLECTIVES = ("all_to_all", "all_reduce", "all_gather", "reduce_scatter", "p2p")
GPU_BYTES = (1 << 16, 1 << 20, 1 << 24, 1 << 28)
GPU_BYTES_QUICK = (1 << 20, 1 << 26)
CPU_BYTES = (1 << 10, 1 << 14, 1 << 18, 1 << 22)
CPU_BYTES_QUICK = (1 << 12, 1 << 16, 1 << 20)


def default_bytes(device: torch.device, quick: bool) -> tuple[int, ...]:
    if device.type == "cuda":
        return GPU_BYTES_QUICK if quick else GPU_BYTES
    return CPU_BYTES_QUICK if quick else CPU_BYTES


def group_sizes(world_size: int) -> list[int]:
    """Powers of two from 2 up to ``world_size`` that divide it."""
    sizes, n = [], 2
    while n <= world_size:
        if world_size % n == 0:
            sizes.append(n)
        n *= 2
    return sizes


def _op(collective: str, nbytes: int, n: int, pg, rank: int, device: torch.device, dtype: torch.dtype):
    elem = torch.tensor([], dtype=dtype).element_size()
    numel = max(n, nbytes // elem // n * n)  # divisible by the group size
    if collective == "all_to_all":
        x = torch.ones(numel, device=device, dtype=dtype)
        y = torch.empty_like(x)
        return lambda: dist.all_to_all_single(y, x, group=pg)
    if collective == "all_reduce":
        x = torch.ones(numel, device=device, dtype=dtype)
        return lambda: dist.all_reduce(x, group=pg)
    if collective == "all_gather":
        full = torch.empty(numel, device=device, dtype=dtype)
        shard = torch.ones(numel // n, device=device, dtype=dtype)
        return lambda: all_gather_tensor(full, shard, group=pg)
    if collective == "reduce_scatter":
        full = torch.ones(numel, device=device, dtype=dtype)
        shard = torch.empty(numel // n, device=device, dtype=dtype)
        return lambda: reduce_scatter_tensor(shard, full, group=pg)
    if collective == "p2p":  # pairs (2i, 2i+1): the even rank sends, the odd one receives
        x = torch.ones(numel, device=device, dtype=dtype)
        peer = rank + 1 if rank % 2 == 0 else rank - 1
        return (lambda: dist.send(x, peer)) if rank % 2 == 0 else (lambda: dist.recv(x, peer))
    raise ValueError(f"unknown collective {collective!r}")


def _iters(nbytes: int, device: torch.device) -> int:
    """Calls per timed loop, the same on every rank (a collective's ranks must agree on the count)."""
    if device.type == "cuda":
        return max(2, min(20, int(1e9 / nbytes)))
    return 3  # gloo on shared CPU cores: every call costs milliseconds anyway


def measure_collectives(rank: int, world_size: int, device: torch.device, dtype: torch.dtype,
                        sizes_bytes: tuple[int, ...], collectives: tuple[str, ...] = COLLECTIVES,
                        repeats: int = 3, say=None) -> list[dict]:
    """Time every collective at every message size and group size; every rank must call this.

    Returns this rank's ``[{'collective', 'group_size', 'bytes', 'seconds'}]`` (take the max over ranks).
    """
    out = []
    for n in group_sizes(world_size):
        pgs = [dist.new_group(list(range(start, start + n))) for start in range(0, world_size, n)]
        pg = pgs[rank // n]
        for collective in collectives:
            if collective == "p2p" and n != 2:
                continue  # a p2p transfer has two ends; measured once, on the pairs
            for nbytes in sizes_bytes:
                op = _op(collective, nbytes, n, pg, rank, device, dtype)
                dist.barrier()
                seconds = time_op(op, device, _iters(nbytes, device), repeats, warmup=1)
                out.append({"collective": collective, "group_size": n, "bytes": nbytes, "seconds": seconds})
                if say:
                    say(f"  {collective:<14} n={n:<3} {nbytes / 2**20:9.3f} MiB  {seconds * 1e6:10.1f} us")
    dist.barrier()
    return out
