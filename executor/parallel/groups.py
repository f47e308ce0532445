"""The process groups of one folded layout, built from :class:`spec.rank_groups.FoldedGroups`.

Every rank creates every group of every kind in the same order (``torch.distributed.new_group`` is a
collective over the whole world) and keeps the one it belongs to. A group of size one needs no
communicator: collectives over it are skipped, so the same code runs as a single-process reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from spec.parallel_config import ParallelConfig
from spec.rank_groups import CP_SUB_GROUPS, FoldedGroups

# The groups the executor uses (cp and pp: context and pipeline parallelism; dp_cp: dense gradient reduction).
GROUP_NAMES = ("tp", "cp", "dp", "dp_cp", "pp", "etp", "ep", "edp", "tp_ep")
# and, under cp_comm a2a+p2p only, the CP group's sub-groups (spec.rank_groups.CP_SUB_GROUPS): the all-to-all's
# and the ring's
#: Megatron's embedding group: the first and the last rank of each pipeline group, which both hold the word
#: embedding when the last stage needs it too (MTP, tied output weights) and sum its gradient. Only those
#: ranks have it in ``ParallelState.groups``.
EMBEDDING_GROUP = "embedding"


class SlicePeers:
    """Stands in for the communicator of a group of size > 1 in a one-rank slice (:func:`slice_state`).

    A slice measures what one rank of a large layout computes, on one device: its collectives are priced by
    the cost model, not run. Collectives over a group whose ``pg`` is this (executor.parallel.collectives)
    move nothing: their outputs are allocated at the size a real exchange gives and, for floating-point
    payloads (activations and their gradients, whose values a timing does not depend on), zero-filled.
    Integer payloads (the dispatchers' routing counts, gathered expert ids) come back as if every member had
    sent what this rank sent: the world is taken to be symmetric, every rank routing as this one does, so the
    buffers a dispatcher sizes from them are those of the rank the slice stands for."""

    def __repr__(self) -> str:
        return "SlicePeers()"


SLICE_PEERS = SlicePeers()


@dataclass
class Group:
    """One process group as seen from a member rank: its ranks (global ids) and this rank's index."""

    name: str
    ranks: tuple[int, ...]
    rank: int  # index of this process inside ``ranks``
    pg: object | None = None  # torch ProcessGroup, None when size == 1; SLICE_PEERS in a one-rank slice

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class ParallelState:
    """This rank's view of a folded layout: global rank, the config and one :class:`Group` per name."""

    config: ParallelConfig
    rank: int
    groups: dict[str, Group] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Group:
        return self.groups[name]

    @property
    def tp(self) -> Group:
        return self.groups["tp"]

    @property
    def dp(self) -> Group:
        return self.groups["dp"]

    @property
    def ep(self) -> Group:
        return self.groups["ep"]

    @property
    def etp(self) -> Group:
        return self.groups["etp"]

    @property
    def edp(self) -> Group:
        return self.groups["edp"]

    @property
    def tp_ep(self) -> Group:
        return self.groups["tp_ep"]

    @property
    def sequence_parallel(self) -> bool:
        return bool(self.config.sequence_parallel)


def high_priority_stream(name: str, config: ParallelConfig) -> bool:
    """Whether group ``name`` gets a high-priority NCCL stream: the EP group when its all-to-alls run under
    other micro-batches' compute (``overlap_moe_expert_parallel_comm``), as Megatron's
    ``--high-priority-stream-groups``. A kernel already running keeps its SMs, but when one finishes the block
    scheduler places the waiting all-to-all before more blocks of the compute queued beside it; at normal
    priority the exchange can wait for whole GEMMs and stay exposed."""
    return name == "ep" and bool(config.overlap_moe_expert_parallel_comm)


def _group_options(name: str, config: ParallelConfig):
    """NCCL options for group ``name`` (None: the backend's defaults; always None on gloo)."""
    if not high_priority_stream(name, config) or not dist.is_nccl_available() or dist.get_backend() != "nccl":
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return options


def build_parallel_state(config: ParallelConfig, rank: int, communicators: bool = True) -> ParallelState:
    """Create every process group of ``config`` (collective over the world) and return this rank's view.

    With ``config.world_size == 1`` no communicator is created and ``torch.distributed`` need not be
    initialised; nor with ``communicators`` False, which gives the groups' ranks only: enough to build a
    rank's slice of the model (which shards by group rank), not to run it.
    """
    folded = FoldedGroups(config)
    state = ParallelState(config=config, rank=rank)
    for name in GROUP_NAMES:
        for ranks in folded.groups(name):
            pg = None
            if len(ranks) > 1 and communicators:
                # every rank must call this for every group, in order
                pg = dist.new_group(ranks, pg_options=_group_options(name, config))
            if rank in ranks:
                state.groups[name] = Group(name, tuple(ranks), ranks.index(rank), pg)
    if config.cp_comm_type == "a2a+p2p" and config.cp > 1:
        for name in CP_SUB_GROUPS:
            for ranks in folded.cp_sub_groups(name):
                pg = None
                if len(ranks) > 1 and communicators:
                    pg = dist.new_group(ranks)  # every rank must call this for every group, in order
                if rank in ranks:
                    state.groups[name] = Group(name, tuple(ranks), ranks.index(rank), pg)
    for ranks in folded.groups("pp"):
        ends = (ranks[0], ranks[-1]) if len(ranks) > 1 else (ranks[0],)
        pg = None
        if len(ranks) > 2 and communicators:
            pg = dist.new_group(list(ends))  # every rank must call this for every group, in order
        elif len(ranks) == 2 and rank in ranks:
            pg = state["pp"].pg  # pp == 2: the pipeline group is the embedding group
        if rank in ends:
            state.groups[EMBEDDING_GROUP] = Group(EMBEDDING_GROUP, ends, ends.index(rank), pg)
    return state


def single_process_state(config: ParallelConfig | None = None) -> ParallelState:
    """The trivial layout of one process: every group holds only rank 0."""
    return build_parallel_state(config or ParallelConfig(world_size=1), 0)


def slice_state(config: ParallelConfig, rank: int) -> ParallelState:
    """Rank ``rank``'s view of ``config`` for a one-rank slice: its groups with their real sizes and members,
    each of size > 1 standing in for its communicator with :data:`SLICE_PEERS` (no ``torch.distributed``
    needed). The modules built on it hold this rank's shards and run its local shapes; the collectives they
    call exchange nothing (:class:`SlicePeers`)."""
    state = build_parallel_state(config, rank, communicators=False)
    for group in state.groups.values():
        if group.size > 1:
            group.pg = SLICE_PEERS
    return state
