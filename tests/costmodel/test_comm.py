"""Collective pricing against hand-worked figures."""

from dataclasses import replace

import pytest

from spec import MeasuredCurve, ParallelConfig, get_hardware
from costmodel.comm import (
    COLLECTIVE_EFFICIENCY,
    INTER_NODE_EFFICIENCY,
    GroupPlacements,
    Placement,
    all_to_all_time,
    group_placement,
    link_rates,
    p2p_time,
    ring_time,
    ring_wire_bytes,
)

H100 = get_hardware("h100-sxm")  # NVLink 450 GB/s, NIC 50 GB/s per GPU per direction; 5 / 10 us latency
MIB = 2**20


def test_named_groups_are_placed_by_the_rank_order():
    # world 64 on nodes of 8: TP4 · DP8 · PP2, the experts ETP2 · EP8 · EDP2
    places = GroupPlacements.of_config(ParallelConfig(world_size=64, tp=4, pp=2, ep=8, etp=2), 8)
    assert places.of("tp") == Placement(4, 1, 4)
    assert places.of("dp_cp") == Placement(8, 4, 2)  # ranks 0, 4, ..., 28
    assert places.of("ep") == Placement(8, 2, 4)  # ranks 0, 2, ..., 14
    assert places.of("edp") == Placement(2, 2, 1)  # ranks 0 and 16
    assert places.of("pp") == Placement(2, 2, 1)  # ranks 0 and 32
    assert places.span_text("tp") == "within one node" and places.span_text("dp_cp") == "spans 4 nodes"


def test_placement_from_stride():
    assert group_placement(1, 8, 8) == group_placement(1, 8, 8)
    p = group_placement(1, 8, 8)
    assert (p.nodes, p.ranks_per_node, p.crosses_nodes) == (1, 8, False)
    p = group_placement(8, 4, 8)  # DP over 4 nodes behind TP8
    assert (p.nodes, p.ranks_per_node) == (4, 1)
    p = group_placement(2, 8, 8)  # EP8 behind ETP2: ranks 0,2,..,14
    assert (p.nodes, p.ranks_per_node) == (2, 4)


def test_ring_wire_bytes():
    assert ring_wire_bytes("all_reduce", 1000.0, 4) == pytest.approx(2 * 1000 * 3 / 4)
    assert ring_wire_bytes("all_gather", 1000.0, 4) == pytest.approx(1000 * 3 / 4)
    assert ring_wire_bytes("reduce_scatter", 1000.0, 1) == 0.0


def test_ring_all_reduce_inside_a_node():
    link = link_rates(H100)
    size = 256 * MIB
    t = ring_time(link, "all_reduce", size, group_placement(1, 8, 8))
    expected = 2 * 7 / 8 * size / (450e9 * 0.80) + 2 * 7 * 5e-6
    assert t == pytest.approx(expected)


def test_ring_across_nodes_is_limited_by_the_nics():
    link = link_rates(H100)
    size = 256 * MIB
    one_per_node = ring_time(link, "reduce_scatter", size, group_placement(8, 4, 8))
    assert one_per_node == pytest.approx(3 / 4 * size / (50e9 * 0.80) + 3 * 10e-6)
    # four ranks per node (EP8 behind ETP2 over 2 nodes): reduce-scatter over NVLink among the 4, then each
    # rank's quarter over its own NIC among the 2 nodes
    four_per_node = ring_time(link, "reduce_scatter", size, group_placement(2, 8, 8))
    assert four_per_node == pytest.approx(3 / 4 * size / (450e9 * 0.80) + 3 * 5e-6
                                          + 1 / 2 * size / 4 / (50e9 * 0.80) + 10e-6)


def test_hierarchical_all_reduce_hand_worked():
    """DP16 over 2 nodes of 8 (stride 1): NVLink reduce-scatter of 1 GiB over 8 (7/8 GiB at 450·0.8 GB/s, 7
    steps of 5 us), NIC all-reduce of the 1/8 GiB shard over 2 nodes (2·1/2·1/8 GiB at 50·0.8 GB/s, 2 steps of
    10 us), NVLink all-gather back (as the reduce-scatter)."""
    link = link_rates(H100)
    size = 2**30
    nvlink = 7 / 8 * size / (450e9 * 0.8) + 7 * 5e-6
    nic = 2 * (1 / 2) * (size / 8) / (50e9 * 0.8) + 2 * 10e-6
    t = ring_time(link, "all_reduce", size, group_placement(1, 16, 8))
    assert t == pytest.approx(2 * nvlink + nic)
    assert t == pytest.approx(8.665e-3, rel=1e-3)  # 5.29 ms in the two NVLink stages, 3.38 ms on the NICs
    # all-gather: the NIC stage first (1/8 of the buffer), then NVLink
    assert ring_time(link, "all_gather", size, group_placement(1, 16, 8)) == pytest.approx(
        1 / 2 * size / 8 / (50e9 * 0.8) + 10e-6 + nvlink)


def test_nics_per_node_set_each_gpus_network_share():
    """Four 400 Gb/s NICs shared by eight GPUs: 25 GB/s a GPU when all send; the network is labelled as the
    datasheet's until calibrate measures it."""
    assert H100.nic_bandwidth_per_gpu == 50e9 and "not measured here" in H100.network_source
    half = replace(H100, nics_per_node=4)
    assert half.nic_bandwidth_per_gpu == 25e9
    assert link_rates(half).inter_bandwidth == 25e9
    size = 256 * MIB
    assert ring_time(link_rates(half), "reduce_scatter", size, group_placement(8, 4, 8)) == pytest.approx(
        3 / 4 * size / (25e9 * 0.80) + 3 * 10e-6)
    assert type(H100).from_dict(half.to_dict()) == half
    with pytest.raises(Exception, match="nics_per_node"):
        replace(H100, nics_per_node=0)


def test_all_to_all_two_nodes_vs_one():
    link = link_rates(H100)
    size = 64 * MIB
    eff = COLLECTIVE_EFFICIENCY["all_to_all"]
    assert eff == pytest.approx(474 / 900)
    inside = all_to_all_time(link, size, group_placement(1, 8, 8))
    assert inside == pytest.approx(size * 7 / 8 / (450e9 * eff) + 5e-6)
    across = all_to_all_time(link, size, group_placement(1, 16, 8))
    # 7/16 of the buffer over NVLink, 8/16 over the network, concurrently; the NIC at its own efficiency
    # (an assumption), not the one measured over NVLink
    nic_eff = INTER_NODE_EFFICIENCY["all_to_all"]
    assert nic_eff == 0.75 != eff
    assert across == pytest.approx(max(size * 7 / 16 / (450e9 * eff), size * 8 / 16 / (50e9 * nic_eff)) + 10e-6)
    assert across > 3 * inside


def test_p2p_and_trivial_groups():
    link = link_rates(H100)
    assert p2p_time(link, 1e9, True) == pytest.approx(1e9 / (50e9 * 0.8) + 10e-6)
    assert p2p_time(link, 1e9, False) == pytest.approx(1e9 / (450e9 * 0.8) + 5e-6)
    assert ring_time(link, "all_gather", 1e9, group_placement(1, 1, 8)) == 0.0
    assert all_to_all_time(link, 1e9, group_placement(1, 1, 8)) == 0.0


def test_measured_collective_curve_replaces_efficiency_and_latency():
    curve = MeasuredCurve(((1.0, 0.9),))
    hw = replace(H100, collective_efficiency={"all_to_all:intra": curve, "all_gather:inter": curve})
    link = link_rates(hw)
    size = 64 * MIB
    assert all_to_all_time(link, size, group_placement(1, 8, 8)) == pytest.approx(size * 7 / 8 / (450e9 * 0.9))
    assert ring_time(link, "all_gather", size, group_placement(8, 2, 8)) == pytest.approx(
        size / 2 / (50e9 * 0.9))
    # collectives without a curve keep the defaults
    assert ring_time(link, "all_gather", size, group_placement(1, 2, 8)) == pytest.approx(
        size / 2 / (450e9 * 0.8) + 5e-6)


def test_a_curve_measured_at_the_groups_own_size_is_preferred():
    """4 x H200 (10:19 calibration): 16 MiB all-gathers moved their wire bytes at 154 GB/s over 2 ranks and
    191 GB/s over 4. A TP4 group uses the 4-rank curve, a TP2 group the 2-rank one, an unmeasured size (8)
    the curve over all sizes; a group spanning nodes rings through its ranks on one node (here 4)."""
    per_size = {2: MeasuredCurve(((1.0, 154 / 450),)), 4: MeasuredCurve(((1.0, 191 / 450),))}
    merged = MeasuredCurve(((1.0, 172.5 / 450),))
    hw = replace(H100, intra_node_bandwidth=450e9, collective_efficiency={
        "all_gather:intra": merged, "all_gather:intra:2": per_size[2], "all_gather:intra:4": per_size[4]})
    link = link_rates(hw)
    size = 16 * MIB
    for n, gbps in ((2, 154), (4, 191), (8, 172.5)):
        assert ring_time(link, "all_gather", size, group_placement(1, n, 8)) == pytest.approx(
            (n - 1) / n * size / (gbps * 1e9)), n
    crossing = group_placement(1, 8, 4)  # 8 ranks on 2 nodes of 4: the NVLink part rings through 4
    assert crossing.ranks_per_node == 4
    assert link.efficiency("all_gather", "intra", size, crossing.ranks_per_node)[0] == pytest.approx(191 / 450)


def test_ring_and_all_to_all_across_nodes_read_the_curve_of_their_ranks_per_node():
    """The calling paths, not just LinkRates.efficiency: a ring or an all-to-all over 8 ranks on 2 nodes of 4
    prices its NVLink part at the 4-rank curve (the network made fast enough that NVLink binds), and an
    all-to-all inside a node at its own size's curve."""
    hw = replace(H100, intra_node_bandwidth=450e9, inter_node_bandwidth=1e15, gpus_per_node=4,
                 collective_efficiency={
                     "all_gather:intra": MeasuredCurve(((1.0, 0.5),)),
                     "all_gather:intra:4": MeasuredCurve(((1.0, 0.25),)),
                     "all_gather:inter": MeasuredCurve(((1.0, 1.0),)),
                     "all_to_all:intra": MeasuredCurve(((1.0, 0.5),)),
                     "all_to_all:intra:2": MeasuredCurve(((1.0, 0.4),)),
                     "all_to_all:intra:4": MeasuredCurve(((1.0, 0.2),)),
                     "all_to_all:inter": MeasuredCurve(((1.0, 1.0),))})
    link = link_rates(hw)
    size = 16 * MIB
    crossing = group_placement(1, 8, 4)
    assert (crossing.nodes, crossing.ranks_per_node) == (2, 4)
    # NVLink stage among 4 at the 4-rank curve; the NIC stage (a quarter over 2 nodes) at PB/s is ~free
    assert ring_time(link, "all_gather", size, crossing) == pytest.approx(
        3 / 4 * size / (450e9 * 0.25) + 1 / 2 * size / 4 / hw.nic_bandwidth_per_gpu)
    assert all_to_all_time(link, size, crossing) == pytest.approx(size * 3 / 8 / (450e9 * 0.2))
    for n, eff in ((2, 0.4), (4, 0.2)):
        assert all_to_all_time(link, size, group_placement(1, n, 4)) == pytest.approx(
            size * (n - 1) / n / (450e9 * eff)), n


def test_a_curve_prices_small_calls_at_their_latency():
    """2 x H200 calibration (bench/results/issue16/h200-0457/h200-calibrated.json, raw timings): a 2-rank
    all-gather of 64 KiB took 38.2 us, of 1 MiB 30.9 us, of 16 MiB 54.5 us, of 256 MiB 562 us. Each measured size
    is priced at its own time; between sizes the time is linear in bytes (a 196 KiB gather of the allgather
    dispatcher's probabilities costs about the latency, not a third of it); below 64 KiB the time stays 64 KiB's
    (a 4-byte all-reduce is no free call); above 256 MiB the bandwidth stays the largest size's."""
    measured = {65536: 38.19e-6, 1048576: 30.90e-6, 16777216: 54.50e-6, 268435456: 562.4e-6}
    place = group_placement(1, 2, 8)
    # efficiency = the model's wire bytes (half the gathered buffer) / seconds / link bandwidth
    curve = MeasuredCurve(tuple((x, x / 2 / t / 450e9) for x, t in measured.items()))
    link = link_rates(replace(H100, intra_node_bandwidth=450e9, collective_efficiency={"all_gather:intra": curve}))
    for size, seconds in measured.items():
        assert ring_time(link, "all_gather", size, place) == pytest.approx(seconds)
    assert ring_time(link, "all_gather", 4, place) == pytest.approx(measured[65536])
    small = ring_time(link, "all_gather", 196608, place)
    assert measured[1048576] < small < measured[65536]
    assert small == pytest.approx(38.19e-6 + (196608 - 65536) / (1048576 - 65536) * (30.90e-6 - 38.19e-6))
    mid = ring_time(link, "all_gather", 32 * MIB, place)  # one TP all-gather of DeepSeek-V2-Lite's hidden states
    assert mid == pytest.approx(54.50e-6 + 16 * MIB / (240 * MIB) * (562.4e-6 - 54.50e-6))
    assert ring_time(link, "all_gather", 1024 * MIB, place) == pytest.approx(4 * measured[268435456])
