"""The cost model's price of ``cuda_graphs``: the host launch work of the captured parts (attention half, router
logits, shared experts) replaced by two graph launches per layer and micro-batch and the copies in and out, at
the calibrated seconds per op; only the host floor moves, so a GPU-bound step is unchanged."""

from __future__ import annotations

import dataclasses

import pytest

from costmodel import host
from costmodel.step_time import estimate_step_time, host_seconds_per_micro_batch
from spec import ClusterSpec, ParallelConfig, TrainingSpec, get_hardware, get_model

H100 = get_hardware("h100-sxm")
TINY = get_model("tiny-moe")  # 2 MoE layers, no shared experts
SHARED = get_model("tiny-moe-shared")


def test_hand_worked_saving_per_layer():
    """MoE layer: attention half 101 + router 5 eager ops captured; replay 5, copies 9 + 2: 101 + 5 - 5 - 9 - 2
    = 90 ops saved per micro-batch. Shared experts add 19 captured less 4 copies (105); beside the dispatch they
    stay eager (90). A dense layer: 101 - 5 - 9 = 87."""
    on = ParallelConfig(world_size=1, cuda_graphs=True)
    assert host.cuda_graph_host_ops(TINY, on, moe=True).ops == 90
    assert host.cuda_graph_host_ops(SHARED, on, moe=True).ops == 105
    overlap = ParallelConfig(world_size=2, ep=2, moe_shared_expert_overlap=True, cuda_graphs=True)
    assert host.cuda_graph_host_ops(SHARED, overlap, moe=True).ops == 90
    assert host.cuda_graph_host_ops(TINY, on, moe=False).ops == 87
    assert host.cuda_graph_host_ops(TINY, on.replace(cuda_graphs=False), moe=True).ops == 0
    # the layer's count drops by exactly that
    off = on.replace(cuda_graphs=False)
    for model, moe in ((TINY, True), (SHARED, True), (TINY, False)):
        saved = host.layer_host_ops(model, off, moe).ops - host.layer_host_ops(model, on, moe).ops
        assert saved == host.cuda_graph_host_ops(model, on, moe).ops


def test_host_floor_drops_by_layers_times_ops_times_seconds_per_op():
    training = TrainingSpec(seq_length=256, global_batch_size=4)
    cluster = ClusterSpec(H100, 1)
    off = ParallelConfig(world_size=1)
    base_off, _ = host_seconds_per_micro_batch(SHARED, training, cluster, off)
    base_on, _ = host_seconds_per_micro_batch(SHARED, training, cluster, off.replace(cuda_graphs=True))
    pattern = SHARED.moe_layer_pattern()
    ops = sum(105 if moe else 87 for moe in pattern)
    assert base_off - base_on == pytest.approx(ops * host.seconds_per_op(H100), rel=1e-9)


def test_a_host_bound_step_gets_faster_and_a_gpu_bound_one_does_not():
    cluster = ClusterSpec(H100, 1)
    tiny = TrainingSpec(seq_length=256, global_batch_size=4)
    off = ParallelConfig(world_size=1)
    a = estimate_step_time(TINY, tiny, cluster, off).step_time
    b = estimate_step_time(TINY, tiny, cluster, off.replace(cuda_graphs=True)).step_time
    assert b < a
    # a real width at seq 4096: the GPU, not the host, sets each micro-batch's time
    model = get_model("qwen3-30b-a3b").with_layers(4)
    long = TrainingSpec(seq_length=4096, global_batch_size=4)
    a = estimate_step_time(model, long, cluster, off).step_time
    b = estimate_step_time(model, long, cluster, off.replace(cuda_graphs=True)).step_time
    assert b <= a and b == pytest.approx(a, rel=1e-3)


def test_recomputed_or_offloaded_moe_keeps_its_parts_eager():
    on = ParallelConfig(world_size=1, cuda_graphs=True)
    for knob in (dict(recompute_granularity="selective", recompute_modules=("moe",)),
                 dict(activation_offload_modules=("moe",))):
        assert host.cuda_graph_host_ops(dataclasses.replace(SHARED), on.replace(**knob), moe=True).ops == 87
