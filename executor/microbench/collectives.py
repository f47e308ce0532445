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

from executor.microbench.timing import lockstep, time_op
from executor.node import node_name
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


def _op(collective: str, nbytes: int, n: int, pg, rank: int, device: torch.device, dtype: torch.dtype,
        members: list[int] | None = None):
    """The timed call; ``rank`` is the caller's index in its group, ``members`` the group's global ranks."""
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
    if collective == "p2p":  # pairs: the group's first rank sends, the second receives
        x = torch.ones(numel, device=device, dtype=dtype)
        members = members or [0, 1]
        peer = members[1 - rank]
        return (lambda: dist.send(x, peer)) if rank == 0 else (lambda: dist.recv(x, peer))
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

    Returns this rank's ``[{'collective', 'group_size', 'bytes', 'seconds', 'scope'}]`` (take the max over
    ranks). ``scope`` is 'intra' for groups inside one node, 'mixed' for contiguous groups that span nodes
    (hierarchical: the time model composes them from the other two) and 'inter' for the groups of one rank per
    node (the same local index on every node: the NIC stage of a hierarchical collective), which are timed
    only when the ranks span several nodes.
    """
    nodes: list[str | None] = [None] * world_size
    dist.all_gather_object(nodes, node_name())  # the launcher's node id where it set one, else the host name
    out = _sweep(rank, world_size, device, dtype, sizes_bytes, collectives, repeats, say,
                 [[list(range(start, start + n)) for start in range(0, world_size, n)]
                  for n in group_sizes(world_size)],
                 nodes)
    by_node = inter_node_groups(nodes)
    if by_node:
        if say:
            say(f"  across {len(by_node[0])} nodes: one rank per node, {len(by_node)} groups")
        out += _sweep(rank, world_size, device, dtype, sizes_bytes, tuple(c for c in collectives if c != "p2p"),
                      repeats, say, [by_node], nodes)
    return out


def inter_node_groups(nodes: list[str]) -> list[list[int]]:
    """Groups of one rank per node (the i-th rank of every node), when the ranks span two or more nodes with
    the same number of ranks each; [] otherwise."""
    ranks_of: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        ranks_of.setdefault(node, []).append(rank)
    per_node = {len(ranks) for ranks in ranks_of.values()}
    if len(ranks_of) < 2 or len(per_node) != 1:
        return []
    ordered = list(ranks_of.values())
    return [[ranks[i] for ranks in ordered] for i in range(per_node.pop())]


def _scope(group: list[int], nodes: list[str]) -> str:
    spanned = len({nodes[r] for r in group})
    if spanned == 1:
        return "intra"
    return "inter" if spanned == len(group) else "mixed"


def _sweep(rank: int, world_size: int, device: torch.device, dtype: torch.dtype, sizes_bytes: tuple[int, ...],
           collectives: tuple[str, ...], repeats: int, say, partitions: list[list[list[int]]],
           nodes: list[str]) -> list[dict]:
    """Time ``collectives`` over each partition of the ranks into equal groups (every rank in one group)."""
    out = []
    for groups in partitions:
        n = len(groups[0])
        pgs = [dist.new_group(group) for group in groups]
        mine = next(i for i, group in enumerate(groups) if rank in group)
        pg, scope = pgs[mine], _scope(groups[mine], nodes)
        rank_in_group = groups[mine].index(rank)
        for collective in collectives:
            if collective == "p2p" and n != 2:
                continue  # a p2p transfer has two ends; measured once, on the pairs
            for nbytes in sizes_bytes:
                op = _op(collective, nbytes, n, pg, rank_in_group, device, dtype, groups[mine])
                dist.barrier()
                with lockstep(device.type != "cuda"):  # a collective's ranks call it together, never in turns
                    seconds = time_op(op, device, _iters(nbytes, device), repeats, warmup=1)
                out.append({"collective": collective, "group_size": n, "bytes": nbytes, "seconds": seconds,
                            "scope": scope})
                if say:
                    say(f"  {collective:<14} n={n:<3} {nbytes / 2**20:9.3f} MiB  {seconds * 1e6:10.1f} us")
    dist.barrier()
    return out
