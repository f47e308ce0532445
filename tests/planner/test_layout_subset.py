"""planner.subset.diverse_subset over planner.runnable.executable_space: the layouts a capped accuracy run
measures."""

from __future__ import annotations

import dataclasses

import pytest

from planner.enumerate import SearchSpace
from planner.runnable import executable_space
from planner.subset import _features, diverse_subset
from spec.catalog import get_hardware, get_model
from spec.errors import SpecError
from spec.hardware import ClusterSpec
from spec.training_spec import TrainingSpec


def _space():
    model = get_model("tiny-moe")
    training = TrainingSpec(seq_length=64, global_batch_size=8, precision="fp32", distributed_optimizer=True)
    space = SearchSpace(mbs_max=2, recompute=(("none", ()), ("full", ())), dispatchers=("alltoall", "allgather"),
                        cp_min_chunk_tokens=16)
    return executable_space(model, training, ClusterSpec(get_hardware("cpu"), 4), space)


def test_subset_is_deterministic_ordered_and_covers_every_value():
    configs = _space()
    values = {f for c in configs for f in _features(c)}
    k = len(values)  # one new value per pick at worst, so k picks reach every value of every dimension
    assert len(configs) > k
    subset = diverse_subset(configs, k)
    assert subset == diverse_subset(configs, k) and len(subset) == k
    assert {f for c in subset for f in _features(c)} == values
    positions = [configs.index(c) for c in subset]
    assert positions == sorted(positions)  # enumeration order kept


def test_subset_larger_than_the_space_is_the_space():
    configs = _space()
    assert diverse_subset(configs, len(configs) + 5) == configs


def test_a_model_the_executor_cannot_build_is_refused_not_an_empty_space():
    model = dataclasses.replace(get_model("tiny-moe"), normalization="layernorm")
    training = TrainingSpec(seq_length=64, global_batch_size=8, precision="fp32", distributed_optimizer=True)
    with pytest.raises(SpecError, match="normalization=layernorm"):
        executable_space(model, training, ClusterSpec(get_hardware("cpu"), 4), SearchSpace())
