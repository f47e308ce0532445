"""Offload in the search space (planner/enumerate.py SearchSpace.optimizer_offload / activation_offload, and the
ranker's one scan per offload option)."""

from __future__ import annotations

import pytest

from costmodel.memory import estimate_memory
from planner.enumerate import NO_OFFLOAD, KnobOption, SearchSpace, enumerate_layouts
from planner.megatron_args import megatron_args
from planner.rank import plan
from spec.layout_codec import optuna_key
from spec import ClusterSpec, TrainingSpec, get_hardware
from spec.catalog import get_model
from spec.errors import InvalidConfigError
from spec.parallel_config import ParallelConfig

MIXTRAL = get_model("mixtral-8x7b")
TRAIN = TrainingSpec(seq_length=4096, global_batch_size=16)
EIGHT = ClusterSpec(get_hardware("h100-sxm"), 8)


def test_default_space_has_no_offload_and_options_multiply_out():
    assert SearchSpace().offload_options() == (NO_OFFLOAD,)
    space = SearchSpace(optimizer_offload=(1.0,), activation_offload=(("moe", "core_attn"),))
    assert space.offload_options() == (NO_OFFLOAD, KnobOption(0.0, ("core_attn", "moe")), KnobOption(1.0, ()),
                                       KnobOption(1.0, ("core_attn", "moe")))
    assert "offload" not in SearchSpace().describe()
    assert "optimizer offload 1 tried, activation offload moe+core_attn tried" in space.describe()
    with pytest.raises(InvalidConfigError, match="fractions"):
        SearchSpace(optimizer_offload=(0.0,))
    with pytest.raises(InvalidConfigError, match="unknown activation offload"):
        SearchSpace(activation_offload=(("attn",),))


def test_offload_options_count_as_valid_and_considered_configs():
    small = ClusterSpec(get_hardware("h100-sxm"), 4)
    training = TrainingSpec(seq_length=1024, global_batch_size=8)
    base = enumerate_layouts(MIXTRAL, training, small, SearchSpace(mbs_max=2, vpp_max=2))
    space = SearchSpace(mbs_max=2, vpp_max=2, optimizer_offload=(0.5,), activation_offload=(("moe",),))
    enum = enumerate_layouts(MIXTRAL, training, small, space)
    assert enum.rejected == base.rejected
    assert enum.considered == enum.valid + sum(enum.rejected.values())
    configs = list(enum.configs())
    assert len(configs) == enum.valid > base.valid
    for cfg in configs:  # built unchecked: every one must pass the constructor's checks
        assert ParallelConfig.from_dict(cfg.to_dict()) == cfg
    with_opt = [c for c in configs if c.optimizer_cpu_offload_fraction]
    assert with_opt and all(c.use_distributed_optimizer for c in with_opt)
    with_act = [c for c in configs if c.activation_offload_modules]
    assert with_act and all(c.recompute_granularity != "full" and "moe" not in c.recompute_modules
                            for c in with_act)
    plain = [c for c in configs if not c.optimizer_cpu_offload_fraction and not c.activation_offload_modules]
    assert len(plain) == base.valid


def test_a_layout_that_fits_only_with_optimizer_offload_is_found():
    without = plan(MIXTRAL, TRAIN, EIGHT, top=3, workers=1)
    assert without.ranked == [] and without.fitting == 0  # Mixtral 8x7B does not fit 8 H100s here
    found = plan(MIXTRAL, TRAIN, EIGHT, top=3, workers=1, space=SearchSpace(optimizer_offload=(0.5, 1.0)))
    assert found.ranked and found.fitting > 0
    for est in found.ranked:
        cfg = est.config
        assert cfg.optimizer_cpu_offload_fraction in (0.5, 1.0) and est.fits
        assert estimate_memory(MIXTRAL, TRAIN, EIGHT, cfg).total <= EIGHT.usable_hbm_bytes
        assert estimate_memory(MIXTRAL, TRAIN, EIGHT, cfg.replace(optimizer_cpu_offload_fraction=0.0)).total \
            > EIGHT.usable_hbm_bytes
        flags = [f[0] for f in megatron_args(cfg, MIXTRAL, TRAIN)]
        assert "--optimizer-cpu-offload" in flags and "--use-distributed-optimizer" in flags
    times = [e.rank_time for e in found.ranked]  # ranked by the step-time intervals' pessimistic ends
    assert times == sorted(times)



def test_trials_recorded_before_offload_was_searched_keep_their_key():
    cfg = ParallelConfig(world_size=4, ep=4)
    old = {k: v for k, v in cfg.to_optuna_params().items() if k not in ("opt_offload", "act_offload")}
    assert optuna_key(old) == optuna_key(cfg.to_optuna_params())
    assert optuna_key(cfg.replace(optimizer_cpu_offload_fraction=1.0).to_optuna_params()) != optuna_key(old)
