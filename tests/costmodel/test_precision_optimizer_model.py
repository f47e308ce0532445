"""The precision-aware optimizer in the memory and time models: hand-worked bytes per parameter of Adam state,
the saving on a sharded layout, and the optimizer step's traffic (costmodel/memory.py, step_time.py)."""

from __future__ import annotations

import math

import pytest

from costmodel.compute import compute_rates
from costmodel.memory import (OPT_STATE_BLOCK_ELEMENTS, LayoutMemory, estimate_memory, optimizer_state_bytes,
                              peak_memory_bytes)
from costmodel.params import stage_param_counts
from costmodel.step_time import OPTIMIZER_BYTES_PER_PARAM, estimate_step_time, optimizer_traffic
from spec import ClusterSpec, TrainingSpec, get_hardware
from spec.catalog import get_model
from spec.parallel_config import ParallelConfig

TINY = get_model("tiny-moe")
MIXTRAL = get_model("mixtral-8x7b")
BF16 = TrainingSpec(seq_length=64, global_batch_size=8)
MOMENTS = {"exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}


@pytest.mark.parametrize("dtypes,precision,expected", [
    (("fp32", "fp32", "fp32"), "bf16", 12),  # 4 + 4 moments + 4 master
    (("bf16", "bf16", "fp32"), "bf16", 8),   # 2 + 2 + 4
    (("bf16", "bf16", "fp16"), "bf16", 6),   # 2 + 2 + 2
    (("bf16", "fp32", "fp32"), "fp8", 10),   # fp8 training keeps bf16 weights and a master copy
    (("bf16", "bf16", "fp32"), "fp32", 4),   # fp32 weights are their own master: the moments only
    (("fp8", "fp8", "fp32"), "bf16", 6),     # Megatron's fp8 moments: 1 + 1 + 4
])
def test_adam_state_bytes_per_parameter(dtypes, precision, expected):
    config = ParallelConfig(world_size=1, exp_avg_dtype=dtypes[0], exp_avg_sq_dtype=dtypes[1],
                            main_params_dtype=dtypes[2])
    assert optimizer_state_bytes(TrainingSpec(64, 8, precision=precision), config) == expected


@pytest.mark.parametrize("world,ep", [(1, 1), (2, 2), (4, 2)])
def test_bf16_moments_save_four_bytes_per_local_parameter(world, ep):
    """Sharded over DP·CP (dense) and EDP (experts) by the distributed optimizer: the GPU keeps its shard's
    states (12 -> 8 bytes an element) and the reduce-scatter's fp32 gradient shard (4 bytes, unchanged)."""
    cluster = ClusterSpec(get_hardware("h100-sxm"), world)
    base = ParallelConfig(world_size=world, ep=ep)
    lean = base.replace(**MOMENTS)
    plain, bf16 = estimate_memory(TINY, BF16, cluster, base), estimate_memory(TINY, BF16, cluster, lean)
    counts = stage_param_counts(TINY, base, 0)
    dense_shard, expert_shard = base.dp * base.cp, base.edp
    local = counts.dense / dense_shard + counts.expert / expert_shard
    kept = 4 * ((counts.dense / dense_shard if dense_shard > 1 else 0) + (counts.expert / expert_shard
                                                                          if expert_shard > 1 else 0))
    assert plain.optimizer == pytest.approx(12 * local + kept)
    assert bf16.optimizer == pytest.approx(8 * local + kept)
    # on one GPU the tiny model's peak is its optimizer step: each bf16 moment widens one fp32 block (here the
    # whole unit), beyond the activations
    excess = bf16.detail("allocator.grad_reduce_peak_excess") - plain.detail("allocator.grad_reduce_peak_excess")
    assert excess > 0 if world == 1 else excess >= 0
    assert plain.total - bf16.total == pytest.approx(4 * local - excess)
    assert sum(v for _, v in bf16.details) == pytest.approx(bf16.total, rel=1e-12)
    # the planner's fast paths give the same bytes
    assert peak_memory_bytes(TINY, BF16, cluster, lean) == pytest.approx(bf16.total, rel=1e-12)
    sweep = LayoutMemory(TINY, BF16, cluster, base)
    assert sweep.peak_bytes(1, lean) == pytest.approx(bf16.total, rel=1e-12)
    assert sweep.peak_bytes(1, base) == pytest.approx(plain.total, rel=1e-12)
    assert sweep.least_bytes(lean) <= bf16.total  # still a lower bound


def test_a_mixtral_layout_saves_what_the_formula_says():
    """Mixtral-8x7B on 64 GPUs, ep8 pp4: the most loaded rank's saving is 4 B per local parameter with bf16
    moments and 6 B with fp16 master weights as well."""
    cluster = ClusterSpec(get_hardware("h100-sxm"), 64)
    training = TrainingSpec(seq_length=4096, global_batch_size=256)
    base = ParallelConfig(world_size=64, tp=2, pp=4, ep=8)
    plain = estimate_memory(MIXTRAL, training, cluster, base)
    counts = stage_param_counts(MIXTRAL, base, plain.stage)
    local = counts.dense / (base.dp * base.cp) + counts.expert / base.edp
    for extra, saved in ((MOMENTS, 4), ({**MOMENTS, "main_params_dtype": "fp16"}, 6)):
        lean = estimate_memory(MIXTRAL, training, cluster, base.replace(**extra))
        assert lean.stage == plain.stage
        assert plain.optimizer - lean.optimizer == pytest.approx(saved * local)
        assert plain.total - lean.total == pytest.approx(saved * local)  # the peak is the activations' here


def test_optimizer_step_traffic_hand_worked():
    # fp32 states: the fused kernel's 34 bytes an element, nothing per block
    assert optimizer_traffic(("fp32", "fp32", "fp32"), False) == (1.0, 0)
    # bf16 moments: each widened (read 2, write 4) and narrowed (read 4, write 2): 12 more each; 1 + 2·2 kernels
    assert optimizer_traffic(("bf16", "bf16", "fp32"), False) == (pytest.approx((34 + 24) / 34), 5)
    # an fp16 master adds its widening (2·2 + 8) and its scaling (24); with fp32 weights it is ignored
    assert optimizer_traffic(("bf16", "bf16", "fp16"), False) == (pytest.approx((34 + 24 + 36) / 34), 12)
    assert optimizer_traffic(("bf16", "bf16", "fp16"), True) == optimizer_traffic(("bf16", "bf16", "fp32"), False)


def test_the_step_time_prices_the_wider_optimizer_traffic():
    """Mixtral-8x7B, 64 H100s, tp2 pp4 ep8: the first stage's rank steps 29.2 M dense (its DP·CP shard) and
    704.6 M expert (EDP 1) elements. fp32 states: their bytes at the HBM rate plus four launches; bf16 moments:
    58/34 of the bytes plus five kernels per block of 4 M elements."""
    cluster = ClusterSpec(get_hardware("h100-sxm"), 64)
    training = TrainingSpec(seq_length=4096, global_batch_size=256)
    base = ParallelConfig(world_size=64, tp=2, pp=4, ep=8)
    rates = compute_rates(cluster.hardware, "bf16")
    counts = stage_param_counts(MIXTRAL, base, 0)
    local = counts.dense / (base.dp * base.cp) + counts.expert / base.edp
    assert local == 29_204_480 + 704_643_072
    per_element = OPTIMIZER_BYTES_PER_PARAM / rates.hbm_bandwidth
    plain = estimate_step_time(MIXTRAL, training, cluster, base)
    lean = estimate_step_time(MIXTRAL, training, cluster, base.replace(**MOMENTS))
    assert plain.term("optimizer") == pytest.approx(local * per_element + 4 * rates.kernel_overhead)
    blocks = math.ceil(local / OPT_STATE_BLOCK_ELEMENTS)  # 175
    assert lean.term("optimizer") == pytest.approx(local * per_element * 58 / 34
                                                   + (4 + 5 * blocks) * rates.kernel_overhead)
    assert lean.step_time - plain.step_time == pytest.approx(lean.term("optimizer") - plain.term("optimizer"))
