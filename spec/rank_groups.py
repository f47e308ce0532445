"""Orthogonal rank groups of a folded layout, in Megatron-LM's ``tp-cp-ep-dp-pp`` order.

Ranks are laid out on a grid whose axes are the parallel dimensions, the first axis varying fastest.
A group along a set of axes holds the ranks that agree on every *other* axis. The same generator is
used twice: once for the dense/attention layout (tp, cp, dp, pp; ep = 1) and once for the expert
layout (etp in the tp slot, ep, edp in the dp slot, pp; cp = 1). Both put pp last with the same size,
so their pipeline groups are identical, which is what lets the two layouts fold onto one set of GPUs.
The planner uses these groups to tell which collectives cross a node boundary; the executor builds
exactly these process groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from spec.errors import InvalidConfigError
from spec.parallel_config import ParallelConfig

DEFAULT_ORDER = "tp-cp-ep-dp-pp"


@dataclass(frozen=True)
class RankGrid:
    """Ranks 0..world-1 on a grid with named axes; ``sizes`` maps axis name -> size (fastest first)."""

    axes: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def world_size(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def groups(self, along: str) -> list[list[int]]:
        """All groups along the axes named in ``along`` ('tp', 'dp-cp', 'tp-ep', ...).

        Within a group ranks are ordered with the first listed-in-grid-order axis varying fastest;
        groups are ordered by the remaining coordinates, fastest axis first.
        """
        wanted = along.split("-")
        unknown = [a for a in wanted if a not in self.axes]
        if unknown:
            raise InvalidConfigError(f"unknown axis {unknown} in group {along!r}; axes are {self.axes}")
        strides = []
        stride = 1
        for size in self.sizes:
            strides.append(stride)
            stride *= size
        inside = [i for i, a in enumerate(self.axes) if a in wanted]
        outside = [i for i, a in enumerate(self.axes) if a not in wanted]

        def offsets(axis_ids: list[int]) -> list[int]:
            result = [0]
            for i in axis_ids:  # fastest axis first: expand existing offsets along each next axis
                result = [base + k * strides[i] for k in range(self.sizes[i]) for base in result]
            return result

        members = offsets(inside)
        return [[start + m for m in members] for start in offsets(outside)]

    def group_of(self, along: str, rank: int) -> list[int]:
        """The group along ``along`` that contains ``rank``."""
        for group in self.groups(along):
            if rank in group:
                return group
        raise InvalidConfigError(f"rank {rank} is outside a world of {self.world_size}")


def _grid(order: str, sizes: dict[str, int]) -> RankGrid:
    axes = tuple(order.split("-"))
    missing = [a for a, s in sizes.items() if a not in axes and s != 1]
    if missing:
        raise InvalidConfigError(f"order {order!r} lacks axes {missing} whose size is not 1")
    return RankGrid(axes=axes, sizes=tuple(sizes.get(a, 1) for a in axes))


@dataclass(frozen=True)
class FoldedGroups:
    """The dense and expert rank grids of one layout, and the named groups the executor builds."""

    config: ParallelConfig
    order: str = DEFAULT_ORDER

    @cached_property
    def dense(self) -> RankGrid:
        c = self.config
        return _grid(self.order, {"tp": c.tp, "cp": c.cp, "ep": 1, "dp": c.dp, "pp": c.pp})

    @cached_property
    def expert(self) -> RankGrid:
        c = self.config
        # The expert grid reuses the dense axis names: etp sits in the tp slot, edp in the dp slot.
        return _grid(self.order, {"tp": c.etp, "cp": 1, "ep": c.ep, "dp": c.edp, "pp": c.pp})

    def groups(self, name: str) -> list[list[int]]:
        """Groups by their field name: tp, cp, dp, dp_cp, tp_cp, pp, mp (tp-pp), etp, ep, edp, tp_ep (etp-ep)."""
        dense = {"tp": "tp", "cp": "cp", "dp": "dp", "dp_cp": "cp-dp", "tp_cp": "tp-cp", "pp": "pp",
                 "mp": "tp-pp"}
        expert = {"etp": "tp", "ep": "ep", "edp": "dp", "tp_ep": "tp-ep", "expert_pp": "pp"}
        if name in dense:
            return self.dense.groups(dense[name])
        if name in expert:
            return self.expert.groups(expert[name])
        raise InvalidConfigError(f"unknown group {name!r}; known: {sorted(dense) + sorted(expert)}")

    def group_of(self, name: str, rank: int) -> list[int]:
        for group in self.groups(name):
            if rank in group:
                return group
        raise InvalidConfigError(f"rank {rank} is outside a world of {self.config.world_size}")


def node_of_rank(rank: int, gpus_per_node: int) -> int:
    """The node (0, 1, ...) that holds ``rank``: nodes are filled in rank order, ``gpus_per_node`` ranks each.

    The one definition of where a rank lives: the cost model prices groups by it and the Ray launcher
    puts rank r into the placement bundle of node ``node_of_rank(r)``, so both agree on who shares a node.
    """
    return rank // gpus_per_node


def nodes_spanned(group: list[int], gpus_per_node: int) -> int:
    """How many nodes the ranks of ``group`` occupy."""
    return len({node_of_rank(r, gpus_per_node) for r in group})


def group_span(config: ParallelConfig, name: str, gpus_per_node: int) -> int:
    """Nodes spanned by one group of kind ``name`` of ``config`` (all groups of a kind are congruent)."""
    return nodes_spanned(FoldedGroups(config).groups(name)[0], gpus_per_node)


def group_stride_span(sizes_before: int, size: int, gpus_per_node: int) -> int:
    """Nodes one group spans when its ranks are ``sizes_before`` apart (no enumeration; for hot loops).

    A group of ``size`` ranks spaced by the product of the faster axes' sizes covers
    ``sizes_before·(size-1)+1`` consecutive rank slots; that many slots starting on a node boundary
    span ceil(span_ranks / gpus_per_node) nodes, and never more than ``size`` nodes.
    """
    if size == 1:
        return 1
    extent = sizes_before * (size - 1) + 1
    return min(size, -(-extent // gpus_per_node)) if extent > gpus_per_node else 1
