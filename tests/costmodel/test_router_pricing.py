"""What the router options change in the cost model: padding to capacity adds expert GEMM rows (and dispatch
bytes) up to the capacity factor, token dropping under CP gathers the choices over CP, the global aux loss
all-reduces the tokens per expert over DP·CP (costmodel/collective_inventory.py, step_time.py, memory.py)."""

from __future__ import annotations

import math

import pytest

from costmodel import collective_inventory as inv
from costmodel.comm import Call, GroupPlacements, call_time, link_rates
from costmodel.memory import estimate_memory, routed_tokens_per_token
from costmodel.step_time import estimate_step_time
from planner.megatron_args import megatron_args
from spec import ClusterSpec, TrainingSpec, get_hardware
from spec.catalog import get_model
from spec.parallel_config import ParallelConfig
from spec.router_options import RouterOptions

MIXTRAL = get_model("mixtral-8x7b")
TINY = get_model("tiny-moe")
CAPACITY = dict(routing_mode="capacity", moe_expert_capacity_factor=1.5)


def test_expert_rows_factor_is_the_capacity_factor_when_padded():
    def factor(ep: int, **fields) -> float:
        return TrainingSpec(4096, 256, **fields).expert_rows_factor(ep)

    assert factor(8, moe_routing_imbalance=1.2) == 1.2  # dropless: the imbalance
    assert factor(8, moe_routing_imbalance=2.0, **CAPACITY) == 1.5  # capped by the capacity
    assert factor(8, moe_routing_imbalance=1.2, **CAPACITY) == 1.2
    assert factor(8, moe_routing_imbalance=1.2, **CAPACITY, moe_pad_expert_input_to_capacity=True) == 1.5
    assert factor(1, **CAPACITY, moe_pad_expert_input_to_capacity=True) == 1.5  # padded rows even with all local


def test_padding_is_priced_as_routing_at_the_capacity_factor():
    """Every expert computes its capacity: the expert GEMMs, the dispatch and the routed activations of a padded
    run are those of a dropless run whose busiest EP rank gets capacity-factor times the mean."""
    cluster = ClusterSpec(get_hardware("h100-sxm"), 64)
    config = ParallelConfig(world_size=64, tp=2, pp=4, ep=8)
    padded = TrainingSpec(4096, 256, **CAPACITY, moe_pad_expert_input_to_capacity=True)
    dropping = TrainingSpec(4096, 256, **CAPACITY)
    skewed = TrainingSpec(4096, 256, moe_routing_imbalance=1.5)
    t_pad, t_drop, t_skew = (estimate_step_time(MIXTRAL, t, cluster, config) for t in (padded, dropping, skewed))
    for term in ("grouped_gemm", "ep_a2a"):
        assert t_pad.term(term) == pytest.approx(t_skew.term(term))
        assert t_pad.term(term) > t_drop.term(term)  # balanced routing: dropping computes the mean, padding 1.5x
    assert routed_tokens_per_token(MIXTRAL, padded, 2, True, 8, 1) == pytest.approx(2 * 1 * 1.5 / 2)
    m_pad, m_skew = (estimate_memory(MIXTRAL, t, cluster, config) for t in (padded, skewed))
    assert m_pad.activations == pytest.approx(m_skew.activations)
    flags = [f for arg in megatron_args(config, MIXTRAL, padded) for f in arg]
    assert "--moe-pad-expert-input-to-capacity" in flags
    assert "--moe-pad-expert-input-to-capacity" not in [f for a in megatron_args(config, MIXTRAL, dropping) for f in a]


def test_router_calls_of_dropping_under_cp_and_the_global_aux_loss():
    """tp2 cp2 dp2, micro-batch 1 of 64 tokens: each rank holds n = 64 / 2 / 2 = 16 tokens, top-2 of 8 experts."""
    config = ParallelConfig(world_size=8, tp=2, cp=2, ep=2, sequence_parallel=True)
    training = TrainingSpec(64, 8, routing_mode="capacity", moe_expert_capacity_factor=1.0)
    g = inv.geometry(TINY, training, config)
    choices = 16 * 2
    assert inv.router_calls(g) == (
        Call("all_gather", "tp", 2 * choices * 8, "forward"), Call("all_gather", "cp", 4 * choices * 8, "forward"),
        Call("all_gather", "tp", 2 * choices * 4, "forward"), Call("all_gather", "cp", 4 * choices * 4, "forward"))
    router = RouterOptions(moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="global_aux_loss")
    g = inv.geometry(TINY, TrainingSpec(64, 8), config, router)
    assert inv.router_calls(g) == (Call("all_reduce", "tp", 8 * 8, "forward"),
                                   Call("all_reduce", "dp_cp", 8 * 8, "forward"))
    local = inv.geometry(TINY, TrainingSpec(64, 8), config, RouterOptions(moe_aux_loss_coeff=1e-2))
    assert [c.group for c in inv.router_calls(local)] == ["tp", "cp"]


def test_padding_with_the_allgather_dispatcher_gathers_every_ranks_zero_rows():
    config = ParallelConfig(world_size=4, ep=4, moe_token_dispatcher_type="allgather")
    padded = TrainingSpec(64, 8, routing_mode="capacity", moe_expert_capacity_factor=1.0,
                          moe_pad_expert_input_to_capacity=True)
    calls = inv.dispatch_calls(inv.geometry(TINY, padded, config))
    plain = inv.dispatch_calls(inv.geometry(TINY, TrainingSpec(64, 8, routing_mode="capacity",
                                                                 moe_expert_capacity_factor=1.0), config))
    assert calls == plain[:3] + (Call("all_gather", "tp_ep", 4 * 8 * 8, "forward"),) + plain[3:]


def test_the_global_aux_loss_adds_one_dp_cp_all_reduce_per_moe_layer_and_micro_batch():
    """Mixtral-8x7B, 64 H100s, tp2 pp4 ep8 (dp 8): each rank holds 8 MoE layers and runs 256 / 8 = 32
    micro-batches a step; each MoE layer's forward all-reduces 8 int64 over the 8 ranks of its DP·CP group."""
    cluster = ClusterSpec(get_hardware("h100-sxm"), 64)
    config = ParallelConfig(world_size=64, tp=2, pp=4, ep=8)
    training = TrainingSpec(4096, 256)
    base = estimate_step_time(MIXTRAL, training, cluster, config)
    router = RouterOptions(moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="global_aux_loss")
    with_global = estimate_step_time(MIXTRAL, training, cluster, config, router=router)
    place = GroupPlacements.of_config(config, cluster.gpus_per_node).of("dp_cp")
    one = call_time(link_rates(cluster.hardware), Call("all_reduce", "dp_cp", 8 * 8, "forward"), place)
    assert with_global.term("dp_grad") - base.term("dp_grad") == pytest.approx(32 * 8 * one)
    assert with_global.step_time - base.step_time == pytest.approx(32 * 8 * one)
    # the per-micro-batch aux loss (the executor's default router calls) adds nothing here
    aux = estimate_step_time(MIXTRAL, training, cluster, config, router=RouterOptions(moe_aux_loss_coeff=1e-2))
    assert aux.step_time == base.step_time
    alone = ParallelConfig(world_size=8, tp=2, pp=4, ep=2)  # dp·cp = 1: nothing to sum over
    assert math.isclose(estimate_step_time(MIXTRAL, TrainingSpec(4096, 8), ClusterSpec(get_hardware("h100-sxm"), 8),
                                           alone, router=router).step_time,
                        estimate_step_time(MIXTRAL, TrainingSpec(4096, 8), ClusterSpec(get_hardware("h100-sxm"), 8),
                                           alone).step_time)
