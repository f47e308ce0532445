"""The CP communication types priced (costmodel.context_parallel): the ring's blocks and its overlap, the all-to-alls'
message sizes and seconds, and what a step reports for each type, against hand-worked examples."""

import pytest

from costmodel import collective_inventory as inv
from costmodel.comm import Call, group_placement, link_rates
from costmodel.compute import compute_rates
from costmodel.context_parallel import (CP_PRICING, ChunkKernel, chunk_attention_time, CP_FLASH_KERNEL_SLOWDOWN,
                                        ring_blocks, ring_overlap, ring_price)
from costmodel.step_time import estimate_step_time
from costmodel.uncertainty import term_provenance
from spec import ClusterSpec, ParallelConfig, TrainingSpec, get_hardware, get_model
from spec.cp_comm_types import CP_COMM_TYPES

H100 = get_hardware("h100-sxm")
RATES = compute_rates(H100, "bf16")
LINK = link_rates(H100)
MIXTRAL = get_model("mixtral-8x22b")  # 48 query heads, 8 KV heads, head dim 128


def test_every_type_is_priced():
    assert tuple(CP_PRICING) == CP_COMM_TYPES


def test_ring_blocks_are_equal_causal_work_after_the_first():
    # seq 64 on a ring of 4: chunks of c = 8; rank 1 holds chunks 1 and 6. Step 0: its own pair, causal
    # (16 x 16, half the scores); step 1: rank 0's pair (chunks 0, 7): both its chunks see chunk 0 whole
    # (16 queries x 8 keys); steps 2, 3: ranks 3 and 2 (chunks 3|4, 2|5): only chunk 6 sees them (8 x 16)
    assert ring_blocks(64, 4, 1) == (ChunkKernel(16, 16), ChunkKernel(16, 8, False), ChunkKernel(8, 16, False),
                                     ChunkKernel(8, 16, False))
    assert ring_blocks(64, 4, 0) == (ChunkKernel(16, 16),) + (ChunkKernel(8, 16, False),) * 3
    for ring in (2, 4, 8):
        for rank in range(ring):
            scores = [b.queries * b.keys * b.work for b in ring_blocks(1024, ring, rank)]
            assert len(set(scores)) == 1  # every step the same work: the load balance
            assert sum(scores) == pytest.approx(1024 ** 2 / 2 / ring)  # 1/ring of the causal s²/2


def test_ring_overlap_by_hand():
    # hops of 1 s beside four blocks: forward 0.6 s each, backward 1.5 s each
    (exposed_f, exposed_b), (hidden_f, hidden_b) = ring_overlap(1.0, [0.6] * 4, [1.5] * 4)
    # forward: the hops of steps 0..2 behind their blocks, 0.4 s of each exposed
    assert (exposed_f, hidden_f) == pytest.approx((1.2, 1.8))
    # backward: step 0 the next pair (1 s), steps 1, 2 the next pair and the last dK/dV (2 s), step 3 the last
    # dK/dV (1 s): exposed 0 + 0.5 + 0.5 + 0, then the final dK/dV hop home (1 s)
    assert (exposed_b, hidden_b) == pytest.approx((2.0, 5.0))
    assert ring_overlap(1.0, [0.6], [1.5]) == ((0.0, 0.0), (0.0, 0.0))  # a ring of one sends nothing


@pytest.mark.parametrize("ring", [2, 3, 4, 8])
def test_ring_price_is_the_busiest_ranks_blocks_and_exposed_hops(ring):
    place = group_placement(1, ring, 8)  # on one node
    pair = 8192 // ring * 8 * 256 * 2  # the local tokens, 8 KV heads, K and V of 128, bf16
    price = ring_price(RATES, LINK, place, 1, 8192, 32, 128, 128, pair)
    hop = pair / (LINK.intra_bandwidth * 0.80) + LINK.intra_latency  # p2p at its default efficiency
    best = None
    for rank in range(ring):
        times = [chunk_attention_time(RATES, 1, b, 32, 128, 128, CP_FLASH_KERNEL_SLOWDOWN)
                 for b in ring_blocks(8192 // (2 * ring) * 2 * ring, ring, rank)]
        exposed, hidden = ring_overlap(hop, [t[0] for t in times], [t[1] for t in times])
        total = sum(t[0] + t[1] for t in times) + sum(exposed)
        if best is None or total > best[0]:
            best = (total, exposed, hidden)
    assert sum(price.core) + sum(price.exposed) == pytest.approx(best[0])
    assert price.exposed == pytest.approx(best[1]) and price.hidden == pytest.approx(best[2])
    # across nodes the same hop goes over the network and hides less
    wide = ring_price(RATES, LINK, group_placement(8, ring, 8), 1, 8192, 32, 128, 128, pair)
    assert sum(wide.exposed) > sum(price.exposed) and wide.core == price.core


def _geometry(comm: str, cp: int = 4, **fields) -> inv.Geometry:
    config = ParallelConfig(world_size=8 * cp, tp=2, cp=cp, sequence_parallel=True, cp_comm_type=comm, **fields)
    return inv.geometry(MIXTRAL, TrainingSpec(seq_length=8192, global_batch_size=64), config)


def test_cp_calls_message_sizes_by_hand():
    # tp 2, cp 4, seq 8192, mbs 1, bf16: 2048 local tokens, 24 query heads and 4 KV heads of 128 on a TP rank
    q = o = 2048 * 24 * 128 * 2
    k = v = 2048 * 4 * 128 * 2
    cp = lambda g: [c for c in inv.attention_calls(g) if c.group.startswith("cp")]  # noqa: E731
    a2a = cp(_geometry("a2a"))
    assert a2a == [Call("all_to_all", "cp", n, phase) for phase in ("forward", "backward") for n in (q, k, v, o)]
    ring = cp(_geometry("p2p"))
    assert ring == [Call("p2p", "cp", k + v, "forward")] * 3 + [Call("p2p", "cp", k + v, "backward")] * 7
    gathered = cp(_geometry("allgather"))
    assert [(c.op, c.nbytes, c.phase) for c in gathered] == [
        ("all_gather", 4 * k, "forward"), ("reduce_scatter", 4 * k, "backward"),
        ("all_gather", 4 * v, "forward"), ("reduce_scatter", 4 * v, "backward")]
    hier = cp(_geometry("a2a+p2p", hierarchical_context_parallel_sizes=(2, 2)))
    assert [c for c in hier if c.op == "all_to_all"] == [Call("all_to_all", "cp_a2a", c.nbytes, c.phase) for c in a2a]
    # the ring's pair after the all-to-all: twice the tokens, half the KV heads, the same bytes
    assert [c for c in hier if c.op == "p2p"] == [Call("p2p", "cp_p2p", k + v, "forward")] + [
        Call("p2p", "cp_p2p", k + v, "backward")] * 3


def _layout(comm: str, **fields) -> ParallelConfig:
    return ParallelConfig(world_size=8, tp=2, cp=4, sequence_parallel=True, cp_comm_type=comm, **fields)


TRAIN = TrainingSpec(seq_length=8192, global_batch_size=2)
CLUSTER = ClusterSpec(H100, 8)
TWO = MIXTRAL.with_layers(2)


def test_a2a_step_term_is_eight_all_to_alls_per_layer_by_hand():
    # tp 2, cp 4 on one node: the CP group is 4 ranks 2 apart, inside the node; 2 layers, 2 micro-batches
    q = 2048 * 24 * 128 * 2
    k = 2048 * 4 * 128 * 2
    bandwidth = LINK.intra_bandwidth * 474.0 / 900.0  # the all-to-all's default efficiency on NVLink
    per_call = [n * 3 / 4 / bandwidth + LINK.intra_latency for n in (q, k, k, q)]  # 3 of 4 parts leave the rank
    got = estimate_step_time(TWO, TRAIN, CLUSTER, _layout("a2a"))
    assert got.term("cp_comm") == pytest.approx(2 * 2 * 2 * sum(per_call))
    assert dict(got.hidden)["cp_comm"] == 0.0


def test_ring_step_term_is_its_exposed_hops_and_reports_the_hidden_ones():
    got = estimate_step_time(TWO, TRAIN, CLUSTER, _layout("p2p"))
    price = ring_price(RATES, LINK, group_placement(2, 4, 8), 1, 8192, 24, 128, 128, 2048 * 4 * 256 * 2)
    assert got.term("cp_comm") == pytest.approx(2 * 2 * sum(price.exposed))  # 2 micro-batches, 2 layers
    assert dict(got.hidden)["cp_comm"] == pytest.approx(2 * 2 * sum(price.hidden)) and sum(price.hidden) > 0
    # the ring's attention is its blocks; allgather's is its two chunk kernels: both one rank's causal work
    assert got.term("attention_core") > 0


def test_every_type_prices_the_same_layout_differently_and_cp1_alike():
    steps = {comm: estimate_step_time(TWO, TRAIN, CLUSTER, _layout(comm, **fields)).step_time
             for comm, fields in (("allgather", {}), ("p2p", {}), ("a2a", {}),
                                  ("a2a+p2p", {"hierarchical_context_parallel_sizes": (2, 2)}))}
    assert len(set(steps.values())) == 4
    one = [estimate_step_time(TWO, TRAIN, CLUSTER, ParallelConfig(world_size=8, tp=8, sequence_parallel=True,
                                                                  cp_comm_type=comm)).step_time
           for comm in ("allgather", "p2p", "a2a")]
    assert one[0] == one[1] == one[2]


def test_interval_provenance_follows_the_cp_comm_type():
    """cp_comm's interval is drawn from the collective its type runs: the all-gather, the ring's p2p hops or the
    all-to-all; a2a+p2p's all-to-all over its 2 nearest CP ranks stays inside a node (datasheet intra-node
    rates) while the whole CP group of 8 ranks tp 2 apart spans two nodes of an unmeasured network."""
    training = TrainingSpec(seq_length=32768, global_batch_size=64)

    def cp_source(label: str, world: int) -> str:
        config = ParallelConfig.parse(label, world_size=world)
        return {p.term: p for p in term_provenance(MIXTRAL, training, ClusterSpec(H100, world), config)}[
            "cp_comm"].source

    assert [cp_source(f"cp8 cp_comm={kind}", 8) for kind in ("allgather", "p2p", "a2a", "a2a+p2p:2x4")] == [
        "all_gather:intra", "p2p:intra", "all_to_all:intra", "all_to_all:intra"]
    assert cp_source("tp2 cp8 cp_comm=a2a", 16) == "network"
    assert cp_source("tp2 cp8 cp_comm=a2a+p2p:2x4", 16) == "all_to_all:intra"
