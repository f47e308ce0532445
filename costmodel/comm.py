"""Price collectives: byte volumes on the wire, the link a group uses, latency and bandwidth.

A group's placement (how many nodes it spans, how many of its ranks share a node) follows from its
rank stride in Megatron's ``tp-cp-ep-dp-pp`` order and ``gpus_per_node``
(:func:`spec.rank_groups.group_stride_span`), so no rank lists are built in the hot path. Callers name the
group (:class:`GroupPlacements`: ``places.of("dp_cp")``) and the stride and size come from the rank order's
closed form (:meth:`spec.rank_groups.GridSizes.group`), never from strides worked out at the call.

Conventions (bandwidths are bytes/s per GPU per direction, as in :class:`~spec.hardware.HardwareProfile`):

* ring all-gather / reduce-scatter of a ``buffer_bytes`` (gathered, i.e. full-size) buffer over n ranks:
  each rank sends ``(n-1)/n · buffer_bytes`` in ``n-1`` steps; all-reduce is twice that.
* the network between nodes is its own link, separate from NVLink: each GPU drives
  ``HardwareProfile.nic_bandwidth_per_gpu`` (its node's NICs over its GPUs) at the inter-node latency, with
  its own default efficiencies (:data:`INTER_NODE_EFFICIENCY`, assumptions until calibrate measures across
  nodes), never the NVLink-measured ones.
* a group inside one node runs its ring at ``intra_node_bandwidth``; each ring step pays the link latency.
* a ring collective over a group spanning N nodes with r ranks on each runs hierarchically: an NVLink stage
  among the r ranks of a node and a NIC stage among the N ranks of the same local index, each moving
  ``1/r`` of the buffer: all-reduce = reduce-scatter (NVLink, B over r) + all-reduce (NIC, B/r over N) +
  all-gather (NVLink); reduce-scatter = NVLink then NIC; all-gather = NIC then NVLink.
* all-to-all of ``buffer_bytes`` per rank over n ranks with r of them on this rank's node: ``(r-1)/n`` of
  the buffer goes over NVLink, ``(n-r)/n`` over the NIC, both stages at once; one latency of the slower link.
* a measured curve ``HardwareProfile.collective_curve(name, scope)`` (message bytes -> achieved/link
  bandwidth, latency included) replaces the default efficiency and the latency term; it is read as the time it
  implies (:func:`curve_efficiency`: linear in bytes between measured sizes, the smallest size's time below). Where calibration
  measured the group's own size (key ``'<name>:<scope>:<n>'``) that curve is used: on NVSwitch a 4-rank
  ring moves its wire bytes faster than a 2-rank one (4 x H200: 191 vs 154 GB/s for a 16 MiB all-gather).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property, lru_cache

from spec.hardware import HardwareProfile, MeasuredCurve
from spec.parallel_config import ParallelConfig
from spec.rank_groups import GridSizes, group_stride_span

# Default fraction of the datasheet link bandwidth a collective achieves.
# all-to-all: microbenchmark, 2-GPU NVLink all-to-all at 256 MiB moved 474 GB/s counted over both
# directions, against 900 GB/s bidirectional datasheet NVLink -> 0.527.
# Ring collectives and p2p: an assumption (NCCL ring bus bandwidth of ~80 % of the link), until
# `foldtune calibrate` measures them.
COLLECTIVE_EFFICIENCY = {"all_to_all": 474.0 / 900.0, "all_gather": 0.80, "reduce_scatter": 0.80,
                         "all_reduce": 0.80, "p2p": 0.80}
RING_COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
# Default fraction of the NIC's datasheet bandwidth a collective between nodes achieves: an assumption (NCCL
# over InfiniBand/RoCE reaches ~80 % of line rate on large ring messages, a little less for all-to-all's many
# peer-to-peer streams), not measured here; `foldtune calibrate` across nodes replaces it with 'inter' curves.
INTER_NODE_EFFICIENCY = {"all_to_all": 0.75, "all_gather": 0.80, "reduce_scatter": 0.80, "all_reduce": 0.80,
                         "p2p": 0.80}


@dataclass(frozen=True)
class Placement:
    """Where one group's ranks sit: ``size`` ranks over ``nodes`` nodes, ``ranks_per_node`` on each."""

    size: int
    nodes: int
    ranks_per_node: int

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


@lru_cache(maxsize=4096)
def group_placement(stride: int, size: int, gpus_per_node: int) -> Placement:
    """Placement of a group of ``size`` ranks spaced ``stride`` apart, nodes of ``gpus_per_node`` GPUs."""
    nodes = group_stride_span(stride, size, gpus_per_node)
    return Placement(size=size, nodes=nodes, ranks_per_node=max(1, size // nodes))


@lru_cache(maxsize=4096)
def _placement_of(sizes: GridSizes, name: str, gpus_per_node: int) -> Placement:
    group = sizes.group(name)
    return group_placement(group.stride, group.size, gpus_per_node)


@dataclass(frozen=True)
class GroupPlacements:
    """Where each named group (``spec.rank_groups.GROUP_KINDS``: tp, cp, dp_cp, pp, ep, etp, tp_ep, edp, ...) of
    the grids ``sizes`` sits on nodes of ``gpus_per_node`` GPUs: the stride and size come from the rank order's
    closed form (:meth:`spec.rank_groups.GridSizes.group`), never worked out by the caller."""

    sizes: GridSizes
    gpus_per_node: int

    @classmethod
    def of_config(cls, config: ParallelConfig, gpus_per_node: int) -> GroupPlacements:
        """The placements of ``config``'s groups."""
        return cls(GridSizes.of(config), gpus_per_node)

    def of(self, name: str) -> Placement:
        """The placement of one group of kind ``name``."""
        return _placement_of(self.sizes, name, self.gpus_per_node)

    def span_text(self, name: str) -> str:
        """Where a group of kind ``name`` sits, in words: 'spans N nodes' or 'within one node'."""
        nodes = self.of(name).nodes
        return f"spans {nodes} nodes" if nodes > 1 else "within one node"


@dataclass(frozen=True)
class LinkRates:
    """The network of one hardware profile with default efficiencies and any measured curves."""

    intra_bandwidth: float  # bytes/s per GPU per direction
    intra_latency: float  # seconds
    inter_bandwidth: float
    inter_latency: float
    curves: tuple[tuple[str, MeasuredCurve], ...] = ()  # 'collective:scope[:group size]' -> curve

    @cached_property
    def _by_key(self) -> dict[str, MeasuredCurve]:
        return dict(self.curves)

    def efficiency(self, collective: str, scope: str, message_bytes: float,
                   group_size: int | None = None) -> tuple[float, bool]:
        """(achieved/link bandwidth, measured?) for ``collective`` over ``scope`` at ``message_bytes``: the
        curve measured at ``group_size`` ranks if there is one, else the one over all measured sizes."""
        curves = self._by_key
        curve = (curves.get(f"{collective}:{scope}:{group_size}") if group_size else None) \
            or curves.get(f"{collective}:{scope}")
        if curve is not None:
            return curve_efficiency(curve, max(message_bytes, 1.0)), True
        return (INTER_NODE_EFFICIENCY if scope == "inter" else COLLECTIVE_EFFICIENCY)[collective], False


def curve_efficiency(curve: MeasuredCurve, message_bytes: float) -> float:
    """A measured collective curve's efficiency at ``message_bytes``, read as the time it implies.

    A curve point (x, e) says a message of x bytes took time proportional to x / e. Between measured points that
    time is interpolated linearly in bytes (latency plus bytes over bandwidth, piecewise), not the efficiency
    in log(bytes): between two latency-bound points (64 KiB and 1 MiB both ~35 us on 2 x H200) the latter
    dips to a third of the measured time. Below the smallest point the time stays that point's (the latency
    floor: a 4-byte all-reduce costs what 64 KiB did, not ~0 s); above the largest the efficiency stays the
    largest point's (bandwidth-bound)."""
    pts = curve.points
    x = message_bytes
    if x <= pts[0][0]:
        return pts[0][1] * x / pts[0][0]
    if x >= pts[-1][0]:
        return pts[-1][1]
    i = bisect.bisect_right([p[0] for p in pts], x)
    (x0, e0), (x1, e1) = pts[i - 1], pts[i]
    t0, t1 = x0 / e0, x1 / e1
    return x / (t0 + (x - x0) / (x1 - x0) * (t1 - t0))


@lru_cache(maxsize=64)
def link_rates(hardware: HardwareProfile) -> LinkRates:
    """The :class:`LinkRates` of ``hardware`` (datasheet bandwidths and latencies, measured curves)."""
    return LinkRates(intra_bandwidth=hardware.intra_node_bandwidth, intra_latency=hardware.intra_node_latency,
                     inter_bandwidth=hardware.nic_bandwidth_per_gpu, inter_latency=hardware.inter_node_latency,
                     curves=hardware.collective_efficiency)


def ring_wire_bytes(collective: str, buffer_bytes: float, n: int) -> float:
    """Bytes one rank sends for a ring ``collective`` over ``n`` ranks of a ``buffer_bytes`` buffer.

    ``buffer_bytes`` is the full-size buffer: the gathered output of an all-gather, the input of a
    reduce-scatter, the buffer of an all-reduce.
    """
    if n <= 1:
        return 0.0
    factor = 2.0 if collective == "all_reduce" else 1.0
    return factor * (n - 1) / n * buffer_bytes


def ring_time(link: LinkRates, collective: str, buffer_bytes: float, placement: Placement) -> float:
    """Seconds for a ring all-gather, reduce-scatter or all-reduce of ``buffer_bytes`` over a group."""
    n = placement.size
    if n <= 1 or buffer_bytes <= 0:
        return 0.0
    wire = ring_wire_bytes(collective, buffer_bytes, n)
    steps = (2 if collective == "all_reduce" else 1) * (n - 1)
    if not placement.crosses_nodes:  # at its own size's curve
        eff_i, measured_i = link.efficiency(collective, "intra", buffer_bytes, n)
        return wire / (link.intra_bandwidth * eff_i) + (0.0 if measured_i else steps * link.intra_latency)
    return hierarchical_ring_time(link, collective, buffer_bytes, placement.ranks_per_node, placement.nodes)


def hierarchical_ring_time(link: LinkRates, collective: str, buffer_bytes: float, ranks_per_node: int,
                           nodes: int) -> float:
    """Seconds of a ring collective over ``ranks_per_node`` ranks on each of ``nodes`` nodes: the NVLink stage
    among a node's ranks (the curve of that many ranks) plus the NIC stage among the nodes on ``1/r`` of the
    buffer (see the module docstring)."""
    r = ranks_per_node
    intra = 0.0
    if r > 1:
        eff_i, measured_i = link.efficiency(collective, "intra", buffer_bytes, r)
        stages = 2 if collective == "all_reduce" else 1  # all-reduce: reduce-scatter before, all-gather after
        intra = stages * ((r - 1) / r * buffer_bytes / (link.intra_bandwidth * eff_i)
                          + (0.0 if measured_i else (r - 1) * link.intra_latency))
    share = buffer_bytes / r
    eff_x, measured_x = link.efficiency(collective, "inter", share)
    steps = (2 if collective == "all_reduce" else 1) * (nodes - 1)
    inter = ring_wire_bytes(collective, share, nodes) / (link.inter_bandwidth * eff_x) + (
        0.0 if measured_x else steps * link.inter_latency)
    return intra + inter


def all_to_all_time(link: LinkRates, buffer_bytes: float, placement: Placement) -> float:
    """Seconds for an all-to-all in which every rank holds ``buffer_bytes`` to spread over the group.

    Of a rank's buffer, ``1/n`` stays local, ``(r-1)/n`` crosses NVLink to the ``r-1`` peers on its node
    and ``(n-r)/n`` leaves over the network; both links run concurrently.
    """
    n = placement.size
    if n <= 1 or buffer_bytes <= 0:
        return 0.0
    r = placement.ranks_per_node
    eff_i, measured_i = link.efficiency("all_to_all", "intra", buffer_bytes, r if placement.crosses_nodes else n)
    local = buffer_bytes * (r - 1) / n / (link.intra_bandwidth * eff_i)
    if not placement.crosses_nodes:
        return local + (0.0 if measured_i else link.intra_latency)
    eff_x, measured_x = link.efficiency("all_to_all", "inter", buffer_bytes)
    remote = buffer_bytes * (n - r) / n / (link.inter_bandwidth * eff_x)
    return max(local, remote) + (0.0 if measured_x else link.inter_latency)


def p2p_time(link: LinkRates, nbytes: float, crosses_nodes: bool) -> float:
    """Seconds to send ``nbytes`` from one rank to one other rank (pipeline activations/gradients)."""
    if nbytes <= 0:
        return 0.0
    scope = "inter" if crosses_nodes else "intra"
    eff, measured = link.efficiency("p2p", scope, nbytes)
    bandwidth = link.inter_bandwidth if crosses_nodes else link.intra_bandwidth
    latency = link.inter_latency if crosses_nodes else link.intra_latency
    return nbytes / (bandwidth * eff) + (0.0 if measured else latency)


#: the collectives a :class:`Call` can name (ring ones priced by :func:`ring_time`, 'all_to_all' by
#: :func:`all_to_all_time`, 'p2p' (one send to the next rank of a ring, all ranks at once) by :func:`p2p_time`)
CALL_OPS = RING_COLLECTIVES + ("all_to_all", "p2p")


@dataclass(frozen=True)
class Call:
    """One collective call as the executor issues it, over one of its process groups.

    ``group`` is the executor's group name ('tp', 'cp', 'ep', 'etp', 'tp_ep', 'dp_cp', 'edp', 'pp');
    ``nbytes`` the full-size buffer in bytes (the gathered output of an all-gather, the input of a
    reduce-scatter, the buffer of an all-reduce, the send buffer of an all-to-all); ``phase`` 'forward' or
    'backward' (where a micro-batch issues it; once-per-step calls say 'step')."""

    op: str
    group: str
    nbytes: float
    phase: str


def call_time(link: LinkRates, call: Call, placement: Placement) -> float:
    """Seconds of one :class:`Call` over a group placed as ``placement``: at the calibrated curve of its own
    message size (or the default efficiency and latency), so each call pays its latency once."""
    if call.op == "all_to_all":
        return all_to_all_time(link, call.nbytes, placement)
    if call.op == "p2p":  # a ring's hop: every rank sends to its next at once, the slowest hop sets the pace
        return p2p_time(link, call.nbytes, placement.crosses_nodes) if placement.size > 1 else 0.0
    return ring_time(link, call.op, call.nbytes, placement)
