"""Pricing of the token dispatchers: one :class:`DispatcherPricing` per dispatcher, in one registry.

The names come from ``spec.dispatchers``; the executor's implementations of the same names are in
``executor/dispatcher.py``. Everything the cost model knows about a dispatcher is here, so the time model
(``costmodel.step_time``), the memory model (``costmodel.memory``), the host-op counts (``costmodel.host``)
and the explanation line (``costmodel.estimate``) ask :func:`dispatcher_pricing` and never branch on the
name. A name without a registered pricing is an error (:class:`~spec.errors.InvalidConfigError`), never
priced as another dispatcher.

Contract of a pricing, for one MoE layer, one micro-batch, on the busiest rank of the ETP·EP group:

==================  ===========================================================================================
``collectives``    every collective call the dispatcher issues per MoE layer and micro-batch (forward and
                    backward, :class:`~costmodel.comm.Call`), the split-size exchanges included.
``routed_time``     adds to the layer block the exposed forward and backward seconds of moving the routed
                    token copies to the experts and back (``ep_a2a`` / ``etp_comm`` slots: its
                    ``collectives``, each call at its own size) and the memory-bound passes the dispatcher
                    adds around the experts (``memory_bound``); router, permute, experts and unpermute are
                    priced by the caller, the same for every dispatcher.
``comm_buffer``     (name, bytes per local token) of the largest buffer the dispatcher holds at once.
``host_ops``        eager ops and collectives it issues per MoE layer and micro-batch (forward + backward),
                    counted as ``costmodel/host.py`` describes.
``describe``        the layout fact behind an 'all-to-all' bottleneck, for the explanation line.
``call_collectives`` collectives one dispatch + combine issues (forward + backward) at EP > 1: the rule of
                    thumb for its per-call cost when calibration did not measure it (``costmodel.fixed_costs``).
==================  ===========================================================================================

``routed_time`` also adds ``shape.dispatch_fixed`` (seconds per call beyond the bandwidth price, forward +
backward, resolved by ``costmodel.fixed_costs``) half forward and half backward to ``ep_a2a`` whenever the
dispatcher exchanges tokens (its ETP·EP group has more than one rank); the time model keeps those seconds
out of what EP overlap may hide (host work and host syncs do not run beside another micro-batch's compute).
"""

from __future__ import annotations

from typing import Protocol

from costmodel.comm import Call, GroupPlacements, LinkRates, Placement, call_time
from costmodel.host_ops import ZERO, HostOps
from costmodel.terms import LAYER_SLOT
from spec.errors import InvalidConfigError
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig

A2A, ETP, MEM = LAYER_SLOT["ep_a2a"], LAYER_SLOT["etp_comm"], LAYER_SLOT["memory_bound"]
# a routed token's top-k probability (fp32) and its one-byte routing-map entry, per expert
_PROB_AND_MAP_BYTES = 4 + 1
# what the allgather dispatcher gathers beside each token, per top-k choice: its fp32 probability and its
# int64 expert id (executor/dispatcher.py: AllGatherDispatcher.dispatch), one all-gather each
PROB_BYTES, EXPERT_ID_BYTES = 4, 8
ROUTING_BYTES_PER_CHOICE = PROB_BYTES + EXPERT_ID_BYTES
# the alltoall dispatcher's split sizes: int64 rows per (rank, local expert)
COUNT_BYTES = 8


def alltoall_dispatch_bytes(local: float, topk: int, hidden: int, act_bytes: int) -> float:
    """Bytes each rank holds for ONE of the alltoall dispatcher's four all-to-alls (dispatch and combine,
    forward and backward): its ``local`` tokens' ``topk`` routed copies of ``hidden`` elements. Only the
    copies routed to another rank's experts cross the link (``costmodel.comm.all_to_all_time``: 1/EP stay)."""
    return local * topk * hidden * act_bytes


def allgather_gather_bytes(local: float, topk: int, hidden: int, act_bytes: int, group: int) -> float:
    """The allgather dispatcher's gathered buffer: every token of the ETP·EP ``group`` (``local`` per rank)
    with its top-k probabilities and expert ids. All-gathered forward; its gradient (tokens and
    probabilities) reduce-scattered backward, priced at the same volume."""
    return local * group * (hidden * act_bytes + topk * ROUTING_BYTES_PER_CHOICE)


def allgather_scatter_bytes(local: float, hidden: int, act_bytes: int, group: int) -> float:
    """The allgather dispatcher's combine buffer: the weighted expert outputs of every token of the group,
    reduce-scattered back forward and all-gathered (its gradient) backward."""
    return local * group * hidden * act_bytes


class LayerBlock(Protocol):
    """Where a pricing adds seconds: step_time's per-layer block (``term`` is a LAYER_SLOT index)."""

    def add(self, term: int, fwd: float, bwd: float, module: str | tuple[str, ...] = ()) -> None: ...


class RoutedShape(Protocol):
    """What a pricing may read of the layer being priced (step_time's layer shape)."""

    model: ModelSpec
    link: LinkRates
    act_bytes: int
    etp: int
    imbalance: float  # busiest EP rank's load over the mean
    dispatch_fixed: float  # seconds per dispatch + combine beyond the bandwidth price, forward + backward
    permute_factor: float  # measured / priced seconds of the permutation (the profile's moe_permute_factor, else 1)
    places: GroupPlacements  # the layer's groups (ep, etp, tp_ep, ...)
    ep_place: Placement
    etp_place: Placement
    tp_ep_place: Placement

    def elementwise(self, block: LayerBlock, fwd_bytes: float, module: str | tuple[str, ...] = (),
                    bwd_bytes: float | None = None, term: int = MEM, scale: float = 1.0,
                    op: str = "elementwise") -> None: ...


class DispatcherPricing(Protocol):
    """One dispatcher as the cost model sees it (module docstring: the contract of each method)."""

    name: str
    call_collectives: float

    def collectives(self, model: ModelSpec, act_bytes: int, local: float, ep: int, etp: int,
                    imbalance: float = 1.0) -> tuple[Call, ...]:
        """The calls per MoE layer and micro-batch for ``local`` tokens entering the layer on this rank, in
        forward issue order; ``imbalance`` scales the routed copies' bytes (the busiest EP rank)."""
        ...

    def routed_time(self, shape: RoutedShape, block: LayerBlock, local: float, received: float,
                    local_experts: int) -> None:
        """Add dispatch + combine seconds for ``local`` tokens entering the layer on this rank, ``received``
        token copies its ``local_experts`` experts process."""
        ...

    def comm_buffer(self, model: ModelSpec, act_bytes: int, sp_split: int, ep: int, etp: int,
                    routed: float) -> tuple[str, float]:
        """(name, bytes per local token) of the dispatcher's largest live buffer; ``sp_split`` is tp with
        sequence parallelism else 1, ``routed`` the token copies per local token the experts process."""
        ...

    def host_ops(self, config: ParallelConfig) -> HostOps:
        """Ops and collectives per MoE layer and micro-batch that this dispatcher adds under ``config``."""
        ...

    def describe(self, config: ParallelConfig, gpus_per_node: int) -> str:
        """The layout fact behind an 'all-to-all' bottleneck, e.g. 'EP16 group spans 2 nodes'."""
        ...


def price_calls(shape: RoutedShape, block: LayerBlock, calls: tuple[Call, ...]) -> None:
    """Add each call's seconds at its own size (``costmodel.comm.call_time``) to the block: EP and ETP·EP
    calls in ``ep_a2a``, ETP ones in ``etp_comm``, under the 'moe' recompute module."""
    for call in calls:
        seconds = call_time(shape.link, call, shape.places.of(call.group))
        slot = ETP if call.group == "etp" else A2A
        if call.phase == "forward":
            block.add(slot, seconds, 0.0, "moe")
        else:
            block.add(slot, 0.0, seconds, "moe")


PRICING: dict[str, DispatcherPricing] = {}


def register_pricing(pricing: DispatcherPricing) -> DispatcherPricing:
    """Add ``pricing`` to :data:`PRICING` under its name (one pricing per name)."""
    if pricing.name in PRICING:
        raise ValueError(f"dispatcher pricing {pricing.name!r} is registered twice")
    PRICING[pricing.name] = pricing
    return pricing


def dispatcher_pricing(name: str) -> DispatcherPricing:
    """The pricing of dispatcher ``name``; InvalidConfigError when none is registered."""
    pricing = PRICING.get(name)
    if pricing is None:
        raise InvalidConfigError(f"no cost-model pricing for dispatcher {name!r}; priced: {', '.join(PRICING)}")
    return pricing


def _exchange_extras(shape: RoutedShape, block: LayerBlock, received: float, local_experts: int) -> None:
    """What a token exchange (all-to-all or flex) adds besides its passes: the dispatcher's fixed cost (seconds)
    once the TP·EP group spans ranks, and the sort of the received rows by expert and back (bytes moved)."""
    if shape.tp_ep_place.size > 1:
        block.add(A2A, shape.dispatch_fixed / 2, shape.dispatch_fixed / 2, "moe")
    if local_experts > 1:
        shape.elementwise(block, sort_bytes(received, shape.model.hidden_size, shape.act_bytes), "moe",
                          scale=shape.permute_factor, op="permute")


def sort_bytes(received: float, hidden: int, act_bytes: int) -> float:
    """Bytes moved forward by sorting the ``received`` rows by local expert and back (read and write, twice)."""
    return 2 * 2 * received * hidden * act_bytes


def _exchange_buffer(model: ModelSpec, act_bytes: int, ep: int, etp: int, routed: float) -> tuple[str, float]:
    """The exchange's receive buffer next to its permuted copy (bytes), named as the memory model books it."""
    return "comm.moe.dispatch_combine", (2 if ep * etp > 1 else 1) * routed * model.hidden_size * act_bytes


class AllToAllPricing:
    """``alltoall``: all-to-all of the routed copies over EP, uneven all-gather / reduce-scatter over ETP."""

    name = "alltoall"
    # Host counts (measured as costmodel/host.py describes). EP > 1: counts all-to-all, dispatch and combine
    # all-to-alls (and backward), the (source, expert) chunk reordering and its inverse.
    EP_OPS = HostOps(31.0, 5.0)
    # ETP > 1: count all-gather, uneven all-gather / reduce-scatter of rows.
    ETP_OPS = HostOps(46.0, 5.0)
    call_collectives = EP_OPS.collectives

    def collectives(self, model: ModelSpec, act_bytes: int, local: float, ep: int, etp: int,
                    imbalance: float = 1.0) -> tuple[Call, ...]:
        if ep * etp <= 1:
            return ()
        h, experts = model.hidden_size, model.num_experts or 1
        routed = alltoall_dispatch_bytes(local, model.moe_router_topk, h, act_bytes) * imbalance
        rows = etp * routed  # every ETP member's received copies, gathered
        counts: tuple[Call, ...] = ()  # rows per (peer, local expert): the split sizes, forward only
        a2a: tuple[str, ...] = ()
        etp_ops: tuple[str, ...] = ()
        if ep > 1:
            counts += (Call("all_to_all", "ep", experts * COUNT_BYTES, "forward"),)
            a2a = ("all_to_all",)
        if etp > 1:  # the ETP members' received counts; uneven all-gather of the rows, reduce-scatter back
            counts += (Call("all_gather", "etp", etp * experts * COUNT_BYTES, "forward"),)
            etp_ops = ("all_gather", "reduce_scatter")
        calls = list(counts)
        # backward runs the combine's transposes first: all-to-all, all-gather (of the reduce-scatter), ...
        for phase in ("forward", "backward"):
            calls += [Call(op, "ep", routed, phase) for op in a2a]
            calls += [Call(op, "etp", rows, phase) for op in etp_ops]
            calls += [Call(op, "ep", routed, phase) for op in a2a]
        return tuple(calls)

    def routed_time(self, shape: RoutedShape, block: LayerBlock, local: float, received: float,
                    local_experts: int) -> None:
        price_calls(shape, block, self.collectives(shape.model, shape.act_bytes, local, shape.ep_place.size,
                                                   shape.etp, shape.imbalance))
        _exchange_extras(shape, block, received, local_experts)

    def comm_buffer(self, model: ModelSpec, act_bytes: int, sp_split: int, ep: int, etp: int,
                    routed: float) -> tuple[str, float]:
        # a2a receive buffer next to its permuted copy (dispatch), and the mirror image on combine
        return _exchange_buffer(model, act_bytes, ep, etp, routed)

    def host_ops(self, config: ParallelConfig) -> HostOps:
        out = ZERO
        if config.ep > 1:
            out = out + self.EP_OPS
        if config.etp > 1:
            out = out + self.ETP_OPS
        return out

    def describe(self, config: ParallelConfig, gpus_per_node: int) -> str:
        c = config
        where = GroupPlacements.of_config(c, gpus_per_node).span_text("ep")
        return f"EP{c.ep} group {where}" + (f", ETP{c.etp}" if c.etp > 1 else "")


class AllGatherPricing:
    """``allgather``: all-gather of every token over ETP·EP, reduce-scatter of the weighted outputs back."""

    name = "allgather"
    # Host counts over TP·EP > 1: all-gather of tokens, probabilities and expert ids, the local selection,
    # the reduce-scatter of the output (and backward).
    OPS = HostOps(27.0, 7.0)
    call_collectives = OPS.collectives

    def collectives(self, model: ModelSpec, act_bytes: int, local: float, ep: int, etp: int,
                    imbalance: float = 1.0) -> tuple[Call, ...]:
        group = ep * etp
        if group <= 1:
            return ()
        tokens = group * local * model.hidden_size * act_bytes  # every token of the ETP·EP group
        choices = group * local * model.moe_router_topk
        return (Call("all_gather", "tp_ep", tokens, "forward"),
                Call("all_gather", "tp_ep", choices * PROB_BYTES, "forward"),
                Call("all_gather", "tp_ep", choices * EXPERT_ID_BYTES, "forward"),  # no gradient
                Call("reduce_scatter", "tp_ep", tokens, "forward"),  # the weighted outputs back
                Call("all_gather", "tp_ep", tokens, "backward"),
                Call("reduce_scatter", "tp_ep", choices * PROB_BYTES, "backward"),
                Call("reduce_scatter", "tp_ep", tokens, "backward"))

    def routed_time(self, shape: RoutedShape, block: LayerBlock, local: float, received: float,
                    local_experts: int) -> None:
        place = shape.tp_ep_place
        price_calls(shape, block, self.collectives(shape.model, shape.act_bytes, local, place.size // shape.etp,
                                                   shape.etp))
        if place.size > 1:
            block.add(A2A, shape.dispatch_fixed / 2, shape.dispatch_fixed / 2, "moe")
        # pick local experts' tokens
        shape.elementwise(block, (local * place.size + received) * shape.model.hidden_size * shape.act_bytes, "moe",
                          op="permute")

    def comm_buffer(self, model: ModelSpec, act_bytes: int, sp_split: int, ep: int, etp: int,
                    routed: float) -> tuple[str, float]:
        group = ep * etp
        return ("comm.moe.allgather",
                group * (2 * model.hidden_size * act_bytes + (model.num_experts or 0) * _PROB_AND_MAP_BYTES) / sp_split)

    def host_ops(self, config: ParallelConfig) -> HostOps:
        return self.OPS if config.tp * config.ep * config.etp > 1 else ZERO

    def describe(self, config: ParallelConfig, gpus_per_node: int) -> str:
        where = GroupPlacements.of_config(config, gpus_per_node).span_text("tp_ep")
        return f"allgather dispatcher over ETP·EP {config.etp * config.ep} ({where})"


register_pricing(AllToAllPricing())
register_pricing(AllGatherPricing())


# ---- Megatron's flex dispatcher (DeepEP / HybridEP kernels): priced from the kernels' published bandwidths ----
# DeepEP's normal kernels (deepseek-ai/DeepEP, docs/legacy.md "Performance", V1 on H800 with one CX7 400 Gb/s
# NIC per GPU, the DeepSeek-V3 pretraining shape: 4096 tokens, hidden 7168, top-4 groups, top-8 experts, fp8
# dispatch, bf16 combine): 153 GB/s dispatch and 158 GB/s combine over NVLink at EP8, of H800's 200 GB/s NVLink
# per direction (the README calls ~160 GB/s its maximum); 43 GB/s over RDMA at EP16 of the NIC's 50 GB/s line
# rate. EP32 and EP64 read 58 and 51 GB/s, above line rate because that figure counts the node-local share, so
# the EP16 row is the one that measures the NIC alone.
DEEPEP_NVLINK_EFFICIENCY = 153.0 / 200.0
DEEPEP_RDMA_EFFICIENCY = 43.0 / 50.0
# HybridEP (NVIDIA's Hybrid-EP in DeepEP's hybrid-ep branch, Hybrid-EP_Intra-node_Implementation.md): through
# the torch API with 16 SMs on B200, 4096 tokens, hidden 7168, top-8, 8 ranks: 536 GB/s bf16 dispatch and
# 531 GB/s combine of NVLink 5's 900 GB/s per direction (the lower, combine, priced). Its RDMA path had no
# published figure there, so it is priced at DeepEP's (the same per-node forwarding over the same NICs).
HYBRIDEP_NVLINK_EFFICIENCY = 531.0 / 900.0
HYBRIDEP_RDMA_EFFICIENCY = DEEPEP_RDMA_EFFICIENCY
# DeepEP's low-latency kernels (same page: pure RDMA, 128 tokens, hidden 7168, top-8, fp8 dispatch, bf16
# combine on H800): (EP, dispatch seconds, combine seconds). Small messages are latency-bound, so a pass across
# nodes is never priced below the latency of the smallest tabled EP at or above its own (the largest beyond).
DEEPEP_LOW_LATENCY: tuple[tuple[int, float, float], ...] = (
    (8, 77e-6, 114e-6), (16, 118e-6, 195e-6), (32, 155e-6, 273e-6), (64, 173e-6, 314e-6),
    (128, 192e-6, 369e-6), (256, 194e-6, 360e-6))


def low_latency_floor(group: int) -> tuple[float, float]:
    """(dispatch, combine) seconds below which a flex pass over ``group`` ranks across nodes is not priced:
    DeepEP's low-latency kernels at the smallest tabled EP >= ``group`` (the largest tabled beyond it)."""
    for ep, dispatch, combine in DEEPEP_LOW_LATENCY:
        if ep >= group:
            return dispatch, combine
    return DEEPEP_LOW_LATENCY[-1][1:]


def parts_reached(experts: int, topk: int, parts: int) -> float:
    """Expected number of ``parts`` (ranks or nodes, each holding experts / parts of the ``experts``) that one
    token's ``topk`` distinct uniform choices reach: a part holds none of them with the hypergeometric
    probability C(E - E/P, k) / C(E, k), so P·(1 - that)."""
    if parts <= 1:
        return 1.0
    per_part = experts / parts
    none = 1.0
    for i in range(topk):
        none *= max(0.0, (experts - per_part - i) / (experts - i))
    return parts * (1.0 - none)


def remote_nodes_per_token(experts: int, topk: int, nodes: int, groups: int | None = None,
                           group_topk: int | None = None) -> float:
    """Expected nodes other than its own that one token's ``topk`` routed copies reach: DeepEP sends a token
    once over RDMA per destination node and forwards it over NVLink inside that node, so this (not top-k) is
    its RDMA volume per token. Of the :func:`parts_reached` nodes, its own is one with the same chance as any,
    so (N - 1) / N of them are remote. Group-limited routing (``groups`` expert groups, top-``group_topk`` of
    them per token, the groups laid over the nodes) caps the nodes reached at group_topk·max(1, N / groups)."""
    if nodes <= 1:
        return 0.0
    reached = parts_reached(experts, topk, nodes)
    if groups and group_topk:
        reached = min(reached, group_topk * max(1.0, nodes / groups))
    return reached * (nodes - 1) / nodes


class FlexPricing:
    """Megatron's flex dispatcher on ``backend``'s kernels (``deepep`` or ``hybridep``) over the ETP·EP group:
    a token crosses NVLink once per other GPU its choices reach (the kernels send one row per destination rank
    and expand it to that rank's experts there; straight to a GPU of its node, or after its node's RDMA hop),
    and the network once per remote node they reach (:func:`remote_nodes_per_token`). One pass
    (dispatch or combine) takes the slower of its NVLink and RDMA stages, which the kernels pipeline, at the
    kernels' published efficiencies, plus the link latency; across nodes no less than DeepEP's low-latency
    kernel. Forward: dispatch and combine; backward: their transposes (a combine and a dispatch)."""

    # Host counts (Megatron's flex path, counted from its code, not measured: the executor does not build it).
    # Per micro-batch: the dispatch layout, dispatch, fused permute, fused unpermute and combine forward, their
    # four mirrors backward; the four DeepEP/HybridEP kernels each launched like a collective.
    OPS = HostOps(9.0, 4.0)
    call_collectives = OPS.collectives

    def __init__(self, name: str, backend: str, nvlink_efficiency: float, rdma_efficiency: float) -> None:
        self.name = name
        self.backend = backend
        self.nvlink_efficiency = nvlink_efficiency
        self.rdma_efficiency = rdma_efficiency

    def copies(self, model: ModelSpec, local: float, etp: int, imbalance: float = 1.0) -> float:
        """Routed copies of ``local`` tokens: Megatron's flex dispatcher routes over the ETP·EP group with
        top-k·etp choices (every ETP shard of each chosen expert)."""
        return local * model.moe_router_topk * etp * imbalance

    def rows_to_peers(self, model: ModelSpec, local: float, group: int, etp: int, imbalance: float = 1.0) -> float:
        """Rows one rank sends to other ranks of the ``group`` (= etp·ep) ranks per pass: per token, one per
        other rank holding one of its top-k·etp choices among num_experts·etp expert shards."""
        ranks = parts_reached((model.num_experts or 1) * etp, model.moe_router_topk * etp, group)
        return local * imbalance * ranks * (group - 1) / group

    def pass_seconds(self, link: LinkRates, model: ModelSpec, act_bytes: int, local: float, place: Placement,
                     etp: int, imbalance: float = 1.0) -> tuple[float, float]:
        """(dispatch, combine) seconds of one pass for ``local`` tokens on this rank over the ETP·EP group
        ``place``; 0 when the group is one rank."""
        n = place.size
        if n <= 1:
            return 0.0, 0.0
        row = model.hidden_size * act_bytes
        nvlink = self.rows_to_peers(model, local, n, etp, imbalance) * row
        seconds = nvlink / (link.intra_bandwidth * self.nvlink_efficiency)
        if not place.crosses_nodes:
            seconds += link.intra_latency
            return seconds, seconds
        remote = remote_nodes_per_token(model.num_experts or 1, model.moe_router_topk, place.nodes,
                                        model.moe_router_num_groups, model.moe_router_group_topk)
        rdma = local * imbalance * remote * row
        seconds = max(seconds, rdma / (link.inter_bandwidth * self.rdma_efficiency)) + link.inter_latency
        floor_dispatch, floor_combine = low_latency_floor(n)
        return max(seconds, floor_dispatch), max(seconds, floor_combine)

    def collectives(self, model: ModelSpec, act_bytes: int, local: float, ep: int, etp: int,
                    imbalance: float = 1.0) -> tuple[Call, ...]:
        if ep * etp <= 1:
            return ()
        routed = self.copies(model, local, etp, imbalance) * model.hidden_size * act_bytes
        # the inventory's view: four exchanges of the routed copies over ETP·EP (priced by routed_time instead)
        return tuple(Call("all_to_all", "tp_ep", routed, phase) for phase in ("forward",) * 2 + ("backward",) * 2)

    def routed_time(self, shape: RoutedShape, block: LayerBlock, local: float, received: float,
                    local_experts: int) -> None:
        place = shape.tp_ep_place
        dispatch, combine = self.pass_seconds(shape.link, shape.model, shape.act_bytes, local, place, shape.etp,
                                              shape.imbalance)
        block.add(A2A, dispatch + combine, dispatch + combine, "moe")
        _exchange_extras(shape, block, received, local_experts)

    def comm_buffer(self, model: ModelSpec, act_bytes: int, sp_split: int, ep: int, etp: int,
                    routed: float) -> tuple[str, float]:
        # the received copies next to their permuted copy, as the alltoall dispatcher; the kernels' own
        # registered NVLink/RDMA buffers are allocated once per process and not counted per token
        return _exchange_buffer(model, act_bytes, ep, etp, routed)

    def host_ops(self, config: ParallelConfig) -> HostOps:
        return self.OPS if config.ep * config.etp > 1 else ZERO

    def describe(self, config: ParallelConfig, gpus_per_node: int) -> str:
        where = GroupPlacements.of_config(config, gpus_per_node).span_text("tp_ep")
        return f"flex dispatcher ({self.backend}) over ETP·EP {config.etp * config.ep} ({where})"


register_pricing(FlexPricing("flex_deepep", "deepep", DEEPEP_NVLINK_EFFICIENCY, DEEPEP_RDMA_EFFICIENCY))
register_pricing(FlexPricing("flex_hybridep", "hybridep", HYBRIDEP_NVLINK_EFFICIENCY, HYBRIDEP_RDMA_EFFICIENCY))
