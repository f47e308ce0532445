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
from functools import cached_property, lru_cache
from typing import NamedTuple

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
class GroupKind:
    """A named group: which grid it lives in (``dense``: tp, cp, dp, pp; ``expert``: etp in the tp slot, ep,
    edp in the dp slot, pp) and the grid axes it runs along ('cp-dp', ...)."""

    name: str
    grid: str
    along: str


#: every named group (the executor's process groups and the cost model's), by field name
GROUP_KINDS: dict[str, GroupKind] = {k.name: k for k in (
    GroupKind("tp", "dense", "tp"), GroupKind("cp", "dense", "cp"), GroupKind("dp", "dense", "dp"),
    GroupKind("dp_cp", "dense", "cp-dp"), GroupKind("tp_cp", "dense", "tp-cp"), GroupKind("pp", "dense", "pp"),
    GroupKind("mp", "dense", "tp-pp"),
    GroupKind("etp", "expert", "tp"), GroupKind("ep", "expert", "ep"), GroupKind("edp", "expert", "dp"),
    GroupKind("tp_ep", "expert", "tp-ep"), GroupKind("expert_pp", "expert", "pp"))}


def _group_kind(name: str) -> GroupKind:
    kind = GROUP_KINDS.get(name)
    if kind is None:
        raise InvalidConfigError(f"unknown group {name!r}; known: {sorted(GROUP_KINDS)}")
    return kind


class GroupStride(NamedTuple):
    """One group of kind ``name`` in closed form: ``size`` ranks, consecutive members ``stride`` ranks apart
    (every group of a kind is this one shifted). A named tuple: the cost model keys its caches by it."""

    name: str
    stride: int
    size: int

    def nodes(self, gpus_per_node: int) -> int:
        """Nodes one such group spans (:func:`group_stride_span`)."""
        return group_stride_span(self.stride, self.size, gpus_per_node)


@dataclass(frozen=True)
class GridSizes:
    """The parallel sizes that place rank groups: the dense grid's tp, cp, dp, pp and the expert grid's etp,
    ep, edp (and the same pp). A size the caller does not know defaults to 1; a group's stride depends only on
    the sizes of the axes faster than it (tp, cp, etp and ep need no dp or pp)."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    etp: int = 1
    ep: int = 1
    edp: int = 1

    @classmethod
    def of(cls, config: ParallelConfig) -> GridSizes:
        """The sizes of ``config``'s two grids."""
        return cls(config.tp, config.cp, config.dp, config.pp, config.etp, config.ep, config.edp)

    def axis_sizes(self, grid: str) -> dict[str, int]:
        """Axis name -> size of the ``dense`` or ``expert`` grid (the expert grid reuses the dense axis names:
        etp sits in the tp slot, edp in the dp slot)."""
        if grid == "dense":
            return {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}
        return {"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.edp, "pp": self.pp}

    def group(self, name: str, order: str = DEFAULT_ORDER) -> GroupStride:
        """The group of kind ``name`` in closed form, from the same rank order :class:`RankGrid` enumerates:
        the stride is the product of the sizes of the axes before the group's first axis of size > 1 (before its
        first axis when all are 1), the size the product of its axes' sizes. InvalidConfigError for a group whose
        members are not evenly spaced (an axis of size > 1 between two of its axes of size > 1: ``mp``, tp-pp,
        with dp > 1). Cached: the cost model asks per priced layout."""
        return _closed_form(self, name, order)


@lru_cache(maxsize=4096)
def _closed_form(grids: GridSizes, name: str, order: str) -> GroupStride:
    """:meth:`GridSizes.group`, cached (an unknown or unevenly spaced group raises, and is not cached)."""
    kind = _group_kind(name)
    sizes = grids.axis_sizes(kind.grid)
    axes = order.split("-")
    along = kind.along.split("-")
    inside = [i for i, a in enumerate(axes) if a in along]
    spread = [i for i in inside if sizes[axes[i]] > 1] or inside[:1]  # the axes the members differ on
    for axis in axes[spread[0]:spread[-1] + 1]:
        if axis not in along and sizes[axis] > 1:
            raise InvalidConfigError(f"group {name!r} ({kind.along}) is not evenly spaced: axis {axis} of "
                                     f"size {sizes[axis]} lies between its axes")
    stride = size = 1
    for axis in axes[:spread[0]]:
        stride *= sizes[axis]
    for axis in along:
        size *= sizes[axis]
    return GroupStride(name, stride, size)


@dataclass(frozen=True)
class FoldedGroups:
    """The dense and expert rank grids of one layout, and the named groups the executor builds."""

    config: ParallelConfig
    order: str = DEFAULT_ORDER

    @cached_property
    def sizes(self) -> GridSizes:
        return GridSizes.of(self.config)

    @cached_property
    def dense(self) -> RankGrid:
        return _grid(self.order, self.sizes.axis_sizes("dense"))

    @cached_property
    def expert(self) -> RankGrid:
        return _grid(self.order, self.sizes.axis_sizes("expert"))

    def groups(self, name: str) -> list[list[int]]:
        """Groups by their field name: tp, cp, dp, dp_cp, tp_cp, pp, mp (tp-pp), etp, ep, edp, tp_ep (etp-ep),
        expert_pp (:data:`GROUP_KINDS`)."""
        kind = _group_kind(name)
        return (self.dense if kind.grid == "dense" else self.expert).groups(kind.along)

    def stride(self, name: str) -> GroupStride:
        """The group of kind ``name`` in closed form (:meth:`GridSizes.group`)."""
        return self.sizes.group(name, self.order)

    def group_of(self, name: str, rank: int) -> list[int]:
        for group in self.groups(name):
            if rank in group:
                return group
        raise InvalidConfigError(f"rank {rank} is outside a world of {self.config.world_size}")

    def cp_sub_groups(self, name: str) -> list[list[int]]:
        """The sub-groups of the CP groups that a2a+p2p splits them into (:mod:`spec.cp_comm_types`): ``cp_a2a``,
        runs of ``a`` consecutive members of each CP group (its nearest ranks, tp apart), and ``cp_p2p``, the
        members of the same index in those runs (the ring across them); ``a`` and ``p`` from
        ``config.cp_split``. Without a hierarchical split, groups of one rank each."""
        a2a, ring = self.config.cp_split if self.config.cp_comm_type == "a2a+p2p" else (1, 1)
        if a2a * ring != self.config.cp:
            a2a, ring = 1, 1
        out = []
        for cp_group in self.groups("cp"):
            if a2a * ring != len(cp_group) or a2a * ring == 1:
                out += [[r] for r in cp_group]
            elif name == "cp_a2a":
                out += [cp_group[g * a2a:(g + 1) * a2a] for g in range(ring)]
            elif name == "cp_p2p":
                out += [cp_group[t::a2a] for t in range(a2a)]
            else:
                raise InvalidConfigError(f"unknown CP sub-group {name!r}; known: cp_a2a, cp_p2p")
        return out


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


#: the sub-groups of the CP groups a hierarchical CP communication type uses (FoldedGroups.cp_sub_groups)
CP_SUB_GROUPS = ("cp_a2a", "cp_p2p")

