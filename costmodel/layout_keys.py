"""What each of the time model's caches is keyed on: the fields of a layout a cached cost depends on, as named
tuples, each built from a :class:`~spec.parallel_config.ParallelConfig` by one method.

Two configs with equal keys share the cached value, so a key must name every field its value reads (and no
more, or the cache stops sharing). Keys are tuples underneath, built with ``tuple.__new__`` rather than the
named-tuple constructor: the planner derives several per priced layout, 10^5 layouts a plan.
"""

from __future__ import annotations

from typing import NamedTuple

from spec.dispatchers import EXECUTOR_DISPATCHERS
from spec.parallel_config import ParallelConfig
from spec.pipeline_layout import PipelineSplit
from spec.rank_groups import GridSizes

_new = tuple.__new__


class DenseKey(NamedTuple):
    """What the attention and TP-side layer parts (dense layer, the MoE layer's TP side, embedding, head, MTP
    block, chunk end) depend on."""

    tp: int
    cp: int
    micro_batch_size: int
    sequence_parallel: bool
    tp_comm_overlap: bool
    cp_comm: str
    cp_split: tuple[int, int]


class RoutedKey(NamedTuple):
    """What the routed experts' part depends on: MoE tokens per rank per micro-batch and the expert layout."""

    moe_tokens: float
    ep: int
    etp: int
    dispatcher: str


class LayerKey(NamedTuple):
    """What one layer's cost per micro-batch depends on (:class:`DenseKey` and :class:`RoutedKey` together)."""

    tp: int
    cp: int
    ep: int
    etp: int
    micro_batch_size: int
    sequence_parallel: bool
    dispatcher: str
    tp_comm_overlap: bool
    cp_comm: str  # the CP communication type (allgather when cp = 1: every type runs the same layer there)
    cp_split: tuple[int, int]  # its (a2a size, ring size), ParallelConfig.cp_split
    shared_overlap: bool  # moe_shared_expert_overlap: the shared experts under the dispatch all-to-all

    @classmethod
    def of(cls, c: ParallelConfig) -> LayerKey:
        """The key of ``c``'s layers."""
        comm = c.cp_comm_type if c.cp > 1 else "allgather"
        return _new(cls, (c.tp, c.cp, c.ep, c.etp, c.micro_batch_size, c.sequence_parallel,
                          c.moe_token_dispatcher_type, c.tp_comm_overlap, comm, c.cp_split,
                          c.moe_shared_expert_overlap))

    def dense(self) -> DenseKey:
        """The key of these layers' attention and TP-side parts."""
        return _new(DenseKey, (self.tp, self.cp, self.micro_batch_size, self.sequence_parallel, self.tp_comm_overlap,
                               self.cp_comm, self.cp_split))

    def routed(self, seq_length: int) -> RoutedKey:
        """The key of these layers' routed-expert part at ``seq_length`` tokens per sequence."""
        return _new(RoutedKey, (self.micro_batch_size * seq_length // self.cp / self.tp, self.ep, self.etp,
                                self.dispatcher))


class HostKey(NamedTuple):
    """What the host's kernel-issue seconds depend on: which groups exist (not their sizes), the dispatcher,
    the recomputation, the stages, the CP communication type (with its split: a ring's ops grow with its
    ranks); and ep where the runtime launches per local expert (``costmodel.host.local_expert_host_ops``: a
    Megatron-only dispatcher) or the profile measured the executor's seconds per local expert
    (``per_expert``), else 0."""

    tp_group: bool
    cp_group: bool
    ep_group: bool
    etp_group: bool
    dispatcher: str
    recompute_granularity: str
    recompute_modules: tuple[str, ...]
    recompute_num_layers: int
    pp: int
    vpp: int
    split: PipelineSplit
    cp_comm: str  # the CP communication type and its split (the ring's ops grow with its ranks)
    cp_split: tuple[int, int]
    per_expert_ep: int
    # cuda_graphs, with what decides the captured MoE parts beside the recomputation (spec.validity.cuda_graph_scope)
    cuda_graphs: tuple

    @classmethod
    def of(cls, c: ParallelConfig, per_expert: bool = False) -> HostKey:
        """The key of ``c``; ``per_expert``: the executor's host seconds depend on its local experts."""
        graphs = (True, c.moe_shared_expert_overlap, "moe" in c.activation_offload_modules) if c.cuda_graphs else ()
        return _new(cls, (c.tp > 1, c.cp > 1, c.ep > 1, c.etp > 1, c.moe_token_dispatcher_type,
                          c.recompute_granularity, c.recompute_modules, c.recompute_num_layers, c.pp, c.vpp,
                          c.pipeline_split, c.cp_comm_type if c.cp > 1 else "allgather", c.cp_split,
                          0 if c.moe_token_dispatcher_type in EXECUTOR_DISPATCHERS and not per_expert else c.ep,
                          graphs))


class StepStatKey(NamedTuple):
    """What the once-a-step statistics collectives depend on (``dp_cp``: the DP·CP group's size)."""

    tp: int
    dp_cp: int
    pp: int
    vpp: int
    split: PipelineSplit
    ep: int
    etp: int
    distributed_optimizer: bool

    @classmethod
    def of(cls, c: ParallelConfig) -> StepStatKey:
        """The key of ``c``."""
        return _new(cls, (c.tp, c.world_size // (c.tp * c.pp), c.pp, c.vpp, c.pipeline_split, c.ep, c.etp,
                          c.use_distributed_optimizer))


class DenseParamsKey(NamedTuple):
    """What the dense parameters of the most loaded pipeline rank depend on."""

    tp: int
    pp: int
    vpp: int
    split: PipelineSplit

    @classmethod
    def of(cls, c: ParallelConfig) -> DenseParamsKey:
        """The key of ``c``."""
        return _new(cls, (c.tp, c.pp, c.vpp, c.pipeline_split))


class ExpertParamsKey(NamedTuple):
    """What the expert parameters of the most loaded pipeline rank depend on."""

    ep: int
    etp: int
    pp: int
    vpp: int
    split: PipelineSplit

    @classmethod
    def of(cls, c: ParallelConfig) -> ExpertParamsKey:
        """The key of ``c``."""
        return _new(cls, (c.ep, c.etp, c.pp, c.vpp, c.pipeline_split))


class GemmWeightsKey(NamedTuple):
    """What the GEMM weights of the most loaded pipeline rank depend on."""

    tp: int
    pp: int
    vpp: int
    ep: int
    etp: int
    split: PipelineSplit

    @classmethod
    def of(cls, c: ParallelConfig) -> GemmWeightsKey:
        """The key of ``c``."""
        return _new(cls, (c.tp, c.pp, c.vpp, c.ep, c.etp, c.pipeline_split))


class GradGroupsKey(NamedTuple):
    """What the placements of the gradient-reduction groups (DP·CP and EDP) depend on: both grids' sizes below pp."""

    tp: int
    cp: int
    dp: int
    etp: int
    ep: int
    edp: int

    @classmethod
    def of(cls, c: ParallelConfig) -> GradGroupsKey:
        """The key of ``c``."""
        world, pp = c.world_size, c.pp
        return _new(cls, (c.tp, c.cp, world // (c.tp * c.cp * pp), c.etp, c.ep, world // (c.etp * c.ep * pp)))

    def grids(self) -> GridSizes:
        """The grid sizes these groups are placed by (``spec.rank_groups``)."""
        return GridSizes(tp=self.tp, cp=self.cp, dp=self.dp, etp=self.etp, ep=self.ep, edp=self.edp)
