"""The precision-aware optimizer in the search space (SearchSpace.optimizer_dtypes: one knob option per dtype
triple, beside offload), its configs' rules, and its Megatron arguments."""

from __future__ import annotations

import pytest

from planner.enumerate import NO_OFFLOAD, KnobOption, SearchSpace, enumerate_layouts
from planner.megatron_args import megatron_args
from planner.rank import plan
from spec import ClusterSpec, TrainingSpec, get_hardware
from spec.catalog import get_model
from spec.errors import InvalidConfigError
from spec.parallel_config import ParallelConfig
from spec.validity import check

MIXTRAL = get_model("mixtral-8x7b")
MOMENTS = ("bf16", "bf16", "fp32")
LEAN = ("bf16", "bf16", "fp16")


def test_dtype_triples_are_knob_options_and_bad_ones_are_refused():
    space = SearchSpace(optimizer_dtypes=(MOMENTS,), optimizer_offload=(1.0,))
    assert space.offload_options() == (NO_OFFLOAD, KnobOption(1.0, ()), KnobOption(0.0, (), MOMENTS),
                                       KnobOption(1.0, (), MOMENTS))
    assert "optimizer state bf16+bf16+fp32 (exp_avg+exp_avg_sq+main_params) tried" in space.describe()
    # fp32 training has no master weights to narrow: the fp16-master triple is dropped, bf16 moments stay
    lean = SearchSpace(optimizer_dtypes=(MOMENTS, LEAN))
    assert [o.optimizer_dtypes for o in lean.offload_options(TrainingSpec(1024, 8, precision="fp32"))] == [
        ("fp32", "fp32", "fp32"), MOMENTS]
    with pytest.raises(InvalidConfigError, match="main_params_dtype 'bf16'"):
        SearchSpace(optimizer_dtypes=(("bf16", "bf16", "bf16"),))
    with pytest.raises(InvalidConfigError, match="exp_avg_dtype must be one of"):
        SearchSpace(optimizer_dtypes=(("int8", "bf16", "fp32"),))


def test_each_triple_adds_the_distributed_optimizer_configs_and_every_one_is_valid():
    cluster = ClusterSpec(get_hardware("h100-sxm"), 4)
    training = TrainingSpec(seq_length=1024, global_batch_size=8)
    base = enumerate_layouts(MIXTRAL, training, cluster, SearchSpace(mbs_max=2, vpp_max=2))
    enum = enumerate_layouts(MIXTRAL, training, cluster, SearchSpace(mbs_max=2, vpp_max=2, optimizer_dtypes=(LEAN,)))
    configs = list(enum.configs())
    assert enum.considered == enum.valid + sum(enum.rejected.values())
    lean = [c for c in configs if c.optimizer_dtypes == LEAN]
    with_distopt = [c for c in configs if c.optimizer_dtypes != LEAN and c.use_distributed_optimizer]
    assert len(lean) == len(with_distopt) and len(configs) == base.valid + len(lean)
    for cfg in lean[:: max(1, len(lean) // 50)]:  # built unchecked: the rule book and the constructor agree
        assert ParallelConfig.from_dict(cfg.to_dict()) == cfg
        assert [r.rule for r in check(MIXTRAL, training, cfg) if not r.rule.startswith("executor_")] == []


def test_a_layout_that_fits_only_with_narrower_optimizer_state_is_found_and_exported():
    """Mixtral-8x7B on 8 H100s (seq 4096, global batch 16) fits no layout with fp32 Adam state; bf16 moments
    and fp16 master weights (6 bytes a parameter instead of 12) make it fit."""
    training = TrainingSpec(seq_length=4096, global_batch_size=16)
    cluster = ClusterSpec(get_hardware("h100-sxm"), 8)
    assert plan(MIXTRAL, training, cluster, top=3, workers=1).fitting == 0
    found = plan(MIXTRAL, training, cluster, top=3, workers=1, space=SearchSpace(optimizer_dtypes=(MOMENTS, LEAN)))
    assert found.ranked and all(e.config.optimizer_dtypes != ("fp32",) * 3 for e in found.ranked)
    best = found.ranked[0].config
    assert ParallelConfig.parse(best.label(), world_size=8) == best
    flags = [f for arg in megatron_args(best, MIXTRAL, training) for f in arg]
    assert "--use-precision-aware-optimizer" in flags and "--use-distributed-optimizer" in flags
    for flag, value in zip(("--exp-avg-dtype", "--exp-avg-sq-dtype", "--main-params-dtype"), best.optimizer_dtypes):
        assert (flag in flags) == (value != "fp32")
        if value != "fp32":
            assert flags[flags.index(flag) + 1] == value


def test_megatron_args_of_the_optimizer_knobs():
    model, training = MIXTRAL, TrainingSpec(4096, 256)
    plain = [f for a in megatron_args(ParallelConfig(world_size=8), model, training) for f in a]
    assert "--use-precision-aware-optimizer" not in plain and "--exp-avg-dtype" not in plain
    offload = megatron_args(ParallelConfig(world_size=8, optimizer_cpu_offload_fraction=0.5), model, training)
    assert ["--use-precision-aware-optimizer"] in offload and ["--optimizer-offload-fraction", "0.5"] in offload
    lean = megatron_args(ParallelConfig(world_size=8, exp_avg_dtype="bf16", exp_avg_sq_dtype="fp16"), model, training)
    assert lean.count(["--use-precision-aware-optimizer"]) == 1
    assert ["--exp-avg-dtype", "bf16"] in lean and ["--exp-avg-sq-dtype", "fp16"] in lean
    assert not any(a[0] == "--main-params-dtype" for a in lean)
