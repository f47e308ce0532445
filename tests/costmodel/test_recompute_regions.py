"""Activation-checkpoint regions: how many a layout opens (costmodel.host.recompute_regions) and what the time
model charges for them (HardwareProfile.recompute_region_s): the host floor everywhere, the device on CPU ranks."""

from dataclasses import replace

import pytest

from costmodel.host import recompute_regions
from costmodel.step_time import estimate_step_time, host_seconds_per_micro_batch
from spec.catalog import get_hardware, get_model
from spec.hardware import ClusterSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

TINY = get_model("tiny-moe")  # 2 MoE layers, no shared experts
SHARED = get_model("tiny-moe-shared")  # 4 layers, the first dense, shared experts


def _selective(*modules: str, **kw) -> ParallelConfig:
    return ParallelConfig(world_size=kw.pop("world_size", 1), recompute_granularity="selective",
                          recompute_modules=modules, **kw)


def test_regions_per_layer_hand_counted():
    # two norms a layer, the experts' activation in MoE layers only
    assert recompute_regions(TINY, _selective("layernorm", "moe_act"), moe=True) == 3
    assert recompute_regions(TINY, _selective("layernorm", "moe_act"), moe=False) == 2
    # a dense layer's MLP is one region, an MoE layer has none by that name; core attention one in both
    assert recompute_regions(SHARED, _selective("mlp", "core_attn"), moe=False) == 2
    assert recompute_regions(SHARED, _selective("mlp", "core_attn"), moe=True) == 1
    # shared experts exist only where the model has them
    assert recompute_regions(SHARED, _selective("shared_experts", "moe"), moe=True) == 2
    assert recompute_regions(TINY, _selective("shared_experts", "moe"), moe=True) == 1
    # MLA: the kv latent's norm, and the q latent's where the model has a q down-projection (deepseek-v3 has,
    # deepseek-v2-lite has not); the up projections with the core are one region
    assert recompute_regions(get_model("deepseek-v3"), _selective("layernorm", "mla_up_proj"), moe=True) == 5
    assert recompute_regions(get_model("deepseek-v2-lite"), _selective("layernorm"), moe=True) == 3
    # full recomputation is counted per layer by the time model, not per module
    assert recompute_regions(TINY, ParallelConfig(world_size=1, recompute_granularity="full"), moe=True) == 0


def _cpu(region_s):
    return replace(get_hardware("cpu"), recompute_region_s=region_s)


def test_cpu_ranks_pay_every_region_in_the_recompute_term():
    # pp2 dp2 on 4 ranks, mbs 4, gbs 16: 2 micro-batches per step; one MoE layer per stage, 3 regions each
    training = TrainingSpec(seq_length=128, global_batch_size=16, precision="fp32")
    config = _selective("layernorm", "moe_act", world_size=4, pp=2, micro_batch_size=4)
    without = estimate_step_time(TINY, training, ClusterSpec(_cpu(None), 4), config)
    priced = estimate_step_time(TINY, training, ClusterSpec(_cpu(1e-3), 4), config)
    assert priced.term("recompute") - without.term("recompute") == pytest.approx(2 * 3 * 1e-3)
    # no recomputation: no region, nothing charged
    plain = ParallelConfig(world_size=4, pp=2, micro_batch_size=4)
    assert (estimate_step_time(TINY, training, ClusterSpec(_cpu(1e-3), 4), plain).step_time
            == estimate_step_time(TINY, training, ClusterSpec(_cpu(None), 4), plain).step_time)


def test_a_gpu_pays_regions_in_its_host_floor_only():
    training = TrainingSpec(seq_length=256, global_batch_size=1, precision="bf16")
    h200 = get_hardware("h200")
    for config, regions in ((_selective("layernorm", "moe_act"), 2 * 3),
                            (ParallelConfig(world_size=1, recompute_granularity="full", recompute_num_layers=1), 1)):
        base = host_seconds_per_micro_batch(TINY, training, ClusterSpec(h200, 1), config)
        priced = host_seconds_per_micro_batch(TINY, training, ClusterSpec(replace(h200, recompute_region_s=2e-4), 1),
                                              config)
        assert priced[0] == pytest.approx(base[0])
        assert priced[1] - base[1] == pytest.approx(regions * 2e-4)
        device = [estimate_step_time(TINY, training, ClusterSpec(hw, 1), config).term("recompute")
                  for hw in (h200, replace(h200, recompute_region_s=2e-4))]
        assert device[0] == device[1]


def test_catalog_profiles_price_no_region():
    assert get_hardware("cpu").recompute_region_s is None and get_hardware("h200").recompute_region_s is None
