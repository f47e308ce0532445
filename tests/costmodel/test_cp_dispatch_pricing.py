"""CP attention, the K/V exchange and the dispatchers' volumes, priced as the executor runs them: hand-worked."""

import pytest

from costmodel.comm import ring_time, group_placement, link_rates
from costmodel.compute import KERNEL_OVERHEAD_S, attention_efficiency, attention_time, compute_rates
from costmodel.context_parallel import (
    CP_FLASH_KERNEL_SLOWDOWN,
    ChunkKernel,
    chunk_attention_time,
    chunk_kernels,
    cp_attention_time,
    kv_exchange_bytes,
    kv_exchange_time,
)
from costmodel.dispatch import (
    ROUTING_BYTES_PER_CHOICE,
    allgather_gather_bytes,
    allgather_scatter_bytes,
    alltoall_dispatch_bytes,
)
from costmodel.step_time import estimate_step_time, layer_times
from spec import ClusterSpec, ParallelConfig, TrainingSpec, get_hardware, get_model
from spec.flops import ATTENTION_BWD_FLOP_RATIO

H100 = get_hardware("h100-sxm")
RATES = compute_rates(H100, "bf16")


def test_chunk_kernels_are_the_executors_load_balanced_chunks():
    # seq 4096, cp 2: chunks of 1024; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert chunk_kernels(4096, 2, 0) == (ChunkKernel(1024, 1024), ChunkKernel(1024, 4096))
    assert chunk_kernels(4096, 2, 1) == (ChunkKernel(1024, 2048), ChunkKernel(1024, 3072))
    assert chunk_kernels(4096, 1, 0) == (ChunkKernel(4096, 4096),)
    # bottom-right causal share: the diagonal chunk computes half its scores, chunk 3 (4096 keys) 7/8
    assert [c.work for c in chunk_kernels(4096, 2, 0)] == [0.5, 0.875]
    # every rank holds the same causal work, 1/cp of the whole sequence's s²/2 scores
    for cp in (2, 4, 8):
        for rank in range(cp):
            scores = sum(c.queries * c.keys * c.work for c in chunk_kernels(8192, cp, rank))
            assert scores == pytest.approx(8192 ** 2 / 2 / cp)


def test_a_chunk_is_priced_at_its_own_key_length():
    chunk = ChunkKernel(1024, 4096)
    fwd, bwd = chunk_attention_time(RATES, 1, chunk, 32, 128, 128)
    flops = 2 * 1024 * 4096 * 32 * 256 * 0.875
    fe, be = attention_efficiency(RATES, 4096)
    assert fe == pytest.approx(0.60 * 4096 / (4096 + 512))  # the default curve's saturation at 4096 keys
    assert fwd == pytest.approx(flops / (RATES.bf16_peak * fe) + KERNEL_OVERHEAD_S)
    assert bwd == pytest.approx(ATTENTION_BWD_FLOP_RATIO * flops / (RATES.bf16_peak * be) + KERNEL_OVERHEAD_S)


def test_cp_attention_is_the_busiest_ranks_chunks_and_cp1_the_plain_kernel():
    assert cp_attention_time(RATES, 2, 4096, 1, 32, 128, 128) == attention_time(RATES, 2 * 4096, 4096, 32, 128, 128)
    slow = CP_FLASH_KERNEL_SLOWDOWN  # the chunks run on the flash kernel, 1.6x the calibrated SDPA's time
    assert slow == pytest.approx(1.60, abs=0.005)
    per_rank = [tuple(map(sum, zip(*(chunk_attention_time(RATES, 1, c, 32, 128, 128, slow)
                                      for c in chunk_kernels(4096, 2, r))))) for r in (0, 1)]
    got = cp_attention_time(RATES, 1, 4096, 2, 32, 128, 128)
    assert got == max(per_rank, key=sum)
    # default saturation L/(L+512): rank 0 runs 0.5 c² scores at 1024 keys (2/3) and 3.5 c² at 4096 (8/9):
    # 0.75 + 3.94 = 4.69 c²-units; rank 1 1.5 c² at 2048 (4/5) and 2.5 c² at 3072 (6/7): 1.875 + 2.92 = 4.79
    assert got == per_rank[1] and sum(per_rank[1]) > sum(per_rank[0])
    # CP2 does half the work, at shorter key lengths, with two kernels, on the slower flash kernel: at 4096
    # keys (default curve) about 0.86 of the CP1 time, not 0.5
    ratio = sum(got) / sum(cp_attention_time(RATES, 1, 4096, 1, 32, 128, 128))
    assert 0.8 < ratio < 0.9


def test_kv_exchange_is_an_all_gather_forward_and_a_reduce_scatter_backward():
    # Mixtral at CP2, seq 4096, mbs 1, TP1: 2048 local tokens x 8 KV heads x (128 + 128) x 2 bytes = 8 MiB
    local = kv_exchange_bytes(2048, 8, 256, 2)
    assert local == 8 * 2 ** 20
    place = group_placement(1, 2, 8)
    link = link_rates(H100)
    fwd, bwd = kv_exchange_time(link, local, place)
    # datasheet NVLink 450 GB/s per direction at the default ring efficiency 0.8; one step's latency
    wire = 8 * 2 ** 20  # (cp - 1)/cp of the 16 MiB gathered buffer
    assert fwd == pytest.approx(wire / (H100.intra_node_bandwidth * 0.8) + H100.intra_node_latency)
    assert fwd == ring_time(link, "all_gather", 2 * local, place)
    assert bwd == ring_time(link, "reduce_scatter", 2 * local, place)
    assert kv_exchange_time(link, local, group_placement(1, 1, 8)) == (0.0, 0.0)


def test_cp_exchange_is_exposed_in_the_layer():
    model = get_model("mixtral-8x7b")
    training = TrainingSpec(seq_length=4096, global_batch_size=8)
    cluster = ClusterSpec(H100, 8)
    config = ParallelConfig(world_size=8, cp=2, ep=4)
    layer = layer_times(model, training, cluster, config)["attention"]
    link, place = link_rates(H100), group_placement(1, 2, 8)
    # K and V are gathered by one call each (8 KV heads of 128 dims each), each paying its own latency
    fwd, bwd = (2 * t for t in kv_exchange_time(link, kv_exchange_bytes(2048, 8, 128, 2), place))
    # plus the exchange's per-call cost, half each way: not measured on the datasheet profile, so the rule of
    # thumb, 4 collectives (K, V all-gathers; their reduce-scatters) at 25 us
    per_call = 4 * 25e-6
    fwd, bwd = fwd + per_call / 2, bwd + per_call / 2
    assert dict(layer.fwd)["cp_comm"] == pytest.approx(fwd)
    assert dict(layer.bwd)["cp_comm"] == pytest.approx(bwd)
    # the attention core of the layer is the chunked kernels' (32 heads, head dim 128)
    core = cp_attention_time(compute_rates(H100, "bf16"), 1, 4096, 2, 32, 128, 128)
    assert dict(layer.fwd)["attention_core"] == pytest.approx(core[0])
    # nothing hides it: the step's cp_comm term is all of it: 32 layers x 2 micro-batches (gbs 8, dp 4)
    step = estimate_step_time(model, training, cluster, config)
    assert dict(step.hidden).get("cp_comm", 0.0) == 0.0
    assert step.term("cp_comm") == pytest.approx(2 * 32 * (fwd + bwd))


def test_dispatcher_volumes():
    # 4096 tokens a rank, top-2, hidden 4096, bf16
    assert alltoall_dispatch_bytes(4096, 2, 4096, 2) == 4096 * 2 * 4096 * 2  # 64 MiB of routed copies
    # allgather over EP 8: every token of the group, with its 2 probabilities (fp32) and ids (int64)
    assert ROUTING_BYTES_PER_CHOICE == 12
    assert allgather_gather_bytes(4096, 2, 4096, 2, 8) == 8 * 4096 * (4096 * 2 + 2 * 12)
    assert allgather_scatter_bytes(4096, 4096, 2, 8) == 8 * 4096 * 4096 * 2
    # on the wire at EP2 (top-2): the same token rows each way: a2a sends half its copies (n rows) per
    # all-to-all, allgather n rows per ring collective; at EP8 the all-gather sends 7n rows, the a2a 1.75n
    n, h, ab = 4096, 4096, 2
    for ep, a2a_rows, ag_rows in ((2, n, n), (8, 1.75 * n, 7 * n)):
        a2a_wire = alltoall_dispatch_bytes(n, 2, h, ab) * (ep - 1) / ep
        ag_wire = allgather_scatter_bytes(n, h, ab, ep) * (ep - 1) / ep
        assert a2a_wire == pytest.approx(a2a_rows * h * ab) and ag_wire == pytest.approx(ag_rows * h * ab)
