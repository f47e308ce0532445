"""Megatron's flex dispatcher (DeepEP / HybridEP) priced from the kernels' published bandwidths, by hand; the
rule book calls it Megatron-only; the planner ranks it under --megatron; Megatron's arguments select it; a GPU
holding many local experts pays Transformer Engine's per-expert GEMM launches when only Megatron runs the layout."""

from __future__ import annotations

import pytest

from costmodel.comm import LinkRates, Placement
from costmodel.dispatch import (DEEPEP_LOW_LATENCY, FlexPricing, dispatcher_pricing, low_latency_floor,
                                parts_reached, remote_nodes_per_token)
from costmodel.host import MOE_LAYER, layer_host_ops, local_expert_host_ops
from costmodel.uncertainty import DATASHEET, UNMEASURED_NETWORK, term_provenance
from planner.enumerate import SearchSpace
from planner.megatron_args import megatron_args
from planner.rank import explain_layout, plan
from spec.catalog import get_hardware, get_model
from spec.hardware import ClusterSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec
from spec.validity import check, executor_refusal

DSV3 = get_model("deepseek-v3")
# DeepEP's own benchmark link: H800 NVLink 200 GB/s per direction, CX7 400 Gb/s = 50 GB/s per GPU; no latency
H800 = LinkRates(intra_bandwidth=200e9, intra_latency=0.0, inter_bandwidth=50e9, inter_latency=0.0)
DEEPEP = dispatcher_pricing("flex_deepep")


def test_parts_reached_is_the_hypergeometric_expectation():
    # 8 experts on 2 parts, top-2: both on one part with chance 2·C(4,2)/C(8,2) = 12/28, else both parts
    assert parts_reached(8, 2, 2) == pytest.approx(1 * 12 / 28 + 2 * 16 / 28)
    assert parts_reached(8, 2, 1) == 1.0
    # one expert per part: every choice is its own part
    assert parts_reached(16, 4, 16) == pytest.approx(4.0)


def test_remote_nodes_dedup_top_k_per_node_and_respect_group_limited_routing():
    assert remote_nodes_per_token(8, 2, 2) == pytest.approx((12 / 28 + 2 * 16 / 28) / 2)
    assert remote_nodes_per_token(256, 8, 1) == 0.0
    # DeepSeek-V3: top-4 of 8 groups over 8 nodes reach at most 4 nodes, 3.5 of them remote on average
    assert remote_nodes_per_token(256, 8, 8, 8, 4) == pytest.approx(4 * 7 / 8)
    assert remote_nodes_per_token(256, 8, 8) > 4 * 7 / 8  # uniform top-8 would reach more


def test_an_intranode_pass_runs_at_deepeps_published_nvlink_bandwidth():
    """DeepEP's benchmark shape: 4096 tokens of hidden 7168, top-8 of 256 experts, EP8 in one node: the rows to
    the 7 other GPUs at 153 GB/s (its published dispatch bandwidth on H800)."""
    ep8 = Placement(size=8, nodes=1, ranks_per_node=8)
    rows = 4096 * parts_reached(256, 8, 8) * 7 / 8
    dispatch, combine = DEEPEP.pass_seconds(H800, DSV3, 2, 4096, ep8, etp=1)
    assert dispatch == combine == pytest.approx(rows * 7168 * 2 / 153e9)


def test_an_internode_pass_takes_the_slower_stage_and_never_beats_the_low_latency_kernel():
    ep16 = Placement(size=16, nodes=2, ranks_per_node=8)
    row = 7168 * 2
    nvlink = 4096 * parts_reached(256, 8, 16) * 15 / 16 * row / 153e9
    rdma = 4096 * remote_nodes_per_token(256, 8, 2, 8, 4) * row / 43e9
    dispatch, _ = DEEPEP.pass_seconds(H800, DSV3, 2, 4096, ep16, etp=1)
    assert dispatch == pytest.approx(max(nvlink, rdma))
    # one token: latency-bound, priced at the low-latency kernels' EP16 latencies (118 us, 195 us)
    assert DEEPEP.pass_seconds(H800, DSV3, 2, 1, ep16, etp=1) == pytest.approx((118e-6, 195e-6))
    assert low_latency_floor(20) == (155e-6, 273e-6) and low_latency_floor(1024) == DEEPEP_LOW_LATENCY[-1][1:]
    # a slower NIC makes the RDMA stage the bottleneck: 4x the seconds of the RDMA bytes
    slow = LinkRates(intra_bandwidth=200e9, intra_latency=0.0, inter_bandwidth=5e9, inter_latency=0.0)
    assert DEEPEP.pass_seconds(slow, DSV3, 2, 4096, ep16, etp=1)[0] == pytest.approx(rdma * 10)


def test_hybridep_is_priced_from_its_own_nvlink_figure():
    hybrid = dispatcher_pricing("flex_hybridep")
    assert isinstance(hybrid, FlexPricing) and hybrid.nvlink_efficiency == pytest.approx(531 / 900)
    ep8 = Placement(size=8, nodes=1, ranks_per_node=8)
    d, _ = hybrid.pass_seconds(H800, DSV3, 2, 4096, ep8, etp=1)
    assert d == pytest.approx(DEEPEP.pass_seconds(H800, DSV3, 2, 4096, ep8, etp=1)[0] * (153 / 200) / (531 / 900))


def test_the_rule_book_names_flex_megatron_only_and_keeps_megatrons_conditions():
    training = TrainingSpec(seq_length=4096, global_batch_size=1024)
    config = ParallelConfig(world_size=1024, tp=1, pp=16, ep=64, moe_token_dispatcher_type="flex_deepep")
    assert not [r for r in check(DSV3, training, config) if r.rule == "flex_dispatcher"]
    assert "[executor_dispatcher]" in executor_refusal(DSV3, training, config)
    lone = ParallelConfig(world_size=1024, tp=1, pp=16, ep=1, moe_token_dispatcher_type="flex_deepep")
    assert "flex_dispatcher" in {r.rule for r in check(DSV3, training, lone)}
    padded = TrainingSpec(seq_length=4096, global_batch_size=1024, routing_mode="capacity",
                          moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    assert "flex_dispatcher" in {r.rule for r in check(DSV3, padded, config)}
    hybrid = ParallelConfig(world_size=1024, tp=1, pp=16, ep=64, moe_token_dispatcher_type="flex_hybridep")
    assert "flex_dispatcher" not in {r.rule for r in check(DSV3, padded, hybrid)}


def test_megatron_args_select_the_flex_dispatcher_and_its_backend():
    training = TrainingSpec(seq_length=4096, global_batch_size=1024)
    for name, backend in (("flex_deepep", "deepep"), ("flex_hybridep", "hybridep")):
        args = megatron_args(ParallelConfig(world_size=64, ep=64, moe_token_dispatcher_type=name), DSV3, training)
        assert ["--moe-token-dispatcher-type", "flex"] in args
        assert ["--moe-flex-dispatcher-backend", backend] in args
    plain = megatron_args(ParallelConfig(world_size=64, ep=64), DSV3, training)
    assert ["--moe-token-dispatcher-type", "alltoall"] in plain
    assert not any(flag[0] == "--moe-flex-dispatcher-backend" for flag in plain)


def test_local_expert_launches_are_te_grouped_linears_on_megatron_and_none_on_the_executor():
    qwen = get_model("qwen3-30b-a3b")  # 128 experts: 16 local at ep8
    flex = ParallelConfig(world_size=8, ep=8, moe_token_dispatcher_type="flex_deepep")
    a2a = ParallelConfig(world_size=8, ep=8)
    assert local_expert_host_ops(qwen, flex).ops == 6 * 16
    assert local_expert_host_ops(qwen, a2a).ops == 0
    # the per-layer count: the MoE layer, the flex path's 9 ops and 4 kernel launches, 96 GEMM launches
    assert layer_host_ops(qwen, flex, True).ops == MOE_LAYER.ops + 9 + 96
    assert layer_host_ops(qwen, flex, True).collectives == 4
    fewer = ParallelConfig(world_size=32, ep=32, moe_token_dispatcher_type="flex_deepep")
    assert layer_host_ops(qwen, flex, True).ops - layer_host_ops(qwen, fewer, True).ops == 6 * (16 - 4)


def test_flex_exchange_provenance_is_published_not_measured():
    cluster = ClusterSpec(get_hardware("h100-sxm"), 1024)
    training = TrainingSpec(seq_length=4096, global_batch_size=1024)
    across = ParallelConfig(world_size=1024, pp=16, ep=64, moe_token_dispatcher_type="flex_deepep")
    within = ParallelConfig(world_size=1024, pp=16, ep=8, moe_token_dispatcher_type="flex_deepep")
    by_term = {p.term: p for p in term_provenance(DSV3, training, cluster, across)}
    assert by_term["ep_a2a"].provenance == UNMEASURED_NETWORK and by_term["ep_a2a"].source == "flex_deepep:inter"
    by_term = {p.term: p for p in term_provenance(DSV3, training, cluster, within)}
    assert by_term["ep_a2a"].provenance == DATASHEET


def test_explain_prices_a_published_flex_layout_and_labels_it_not_executable():
    cluster = ClusterSpec(get_hardware("h100-sxm"), 1024)
    training = TrainingSpec(seq_length=4096, global_batch_size=8192)
    verdict = explain_layout(DSV3, training, cluster, "tp2 pp8 vpp4 ep64 dispatcher=flex_deepep")
    alltoall = explain_layout(DSV3, training, cluster, "tp2 pp8 vpp4 ep64")
    assert verdict.valid and not verdict.estimate.executable
    assert verdict.estimate.executable_reason.startswith("[executor_dispatcher]")
    # top-k deduplicated per node over 8 nodes ships less over the NICs than the all-to-all's top-8 copies
    assert verdict.estimate.time.term("ep_a2a") < alltoall.estimate.time.term("ep_a2a")


@pytest.mark.slow
def test_a_megatron_plan_of_deepseek_v3_on_1024_h100s_ranks_flex_layouts_not_executable():
    cluster = ClusterSpec(get_hardware("h100-sxm"), 1024)
    training = TrainingSpec(seq_length=4096, global_batch_size=8192)
    # without the EP all-to-all overlap (which the fastest all-to-all layouts use) flex layouts are the fastest by point
    # estimate; the robust order draws from a shortlist of the fastest by point estimate, where they are not
    megatron = plan(DSV3, training, cluster, top=10, megatron=True, space=SearchSpace(ep_overlap=False),
                    rank_by="point")
    flex = [e for e in megatron.ranked if e.config.moe_token_dispatcher_type.startswith("flex_")]
    assert flex and all(not e.executable and e.executable_reason.startswith("[executor_dispatcher]") for e in flex)
    default = plan(DSV3, training, cluster, top=10)
    assert not any(e.config.moe_token_dispatcher_type.startswith("flex_") for e in default.ranked)
