"""The planner labels every layout it ranks with whether foldtune's executor runs it (the rule book's executor
rules) and, by default, ranks those first; ``megatron=True`` ranks by step time alone."""

from __future__ import annotations

import dataclasses

from planner.rank import explain_layout, plan
from spec.catalog import get_hardware, get_model
from spec.dispatchers import MEGATRON_ONLY_DISPATCHERS
from spec.hardware import ClusterSpec
from spec.training_spec import TrainingSpec
from spec.validity import executor_refusal

# one KV head: Megatron replicates it over TP, the executor's attention splits KV heads over TP and so builds
# tp = 1 only (rule executor_heads_tp); on 4 CPU ranks some tp2 layouts rank among the fastest 20
MQA = dataclasses.replace(get_model("tiny-moe"), name="tiny-mqa", num_query_groups=1)
TRAINING = TrainingSpec(seq_length=64, global_batch_size=8)
CPU4 = ClusterSpec(get_hardware("cpu"), 4)


def test_megatron_ranking_is_by_step_time_and_labels_what_the_executor_does_not_run():
    result = plan(MQA, TRAINING, CPU4, top=20, megatron=True, workers=1)
    assert result.megatron
    times = [e.rank_time for e in result.ranked]  # robust by default: the step-time interval's high end
    assert times == sorted(times)
    point = plan(MQA, TRAINING, CPU4, top=20, megatron=True, workers=1, rank_by="point").ranked
    assert [e.time.step_time for e in point] == sorted(e.time.step_time for e in point)
    refused = [e for e in result.ranked if not e.executable]
    # Megatron's own dispatchers are ranked too, each refused by name
    flex = [e for e in refused if e.config.moe_token_dispatcher_type in MEGATRON_ONLY_DISPATCHERS]
    assert all("[executor_dispatcher] " in e.executable_reason for e in flex)
    refused = [e for e in refused if e not in flex]
    assert refused and all(e.config.tp > 1 for e in refused)
    assert all(e.executable_reason.startswith("[executor_heads_tp] ") for e in refused)
    assert all(e.executable and e.executable_reason is None for e in result.ranked
               if e.config.tp == 1 and e not in flex)


def test_default_ranking_is_the_fastest_executable_layouts():
    """The default top 20 are the 20 fastest layouts the executor runs: the Megatron ranking without the layouts
    it refuses, as deep as it takes."""
    # by the point estimate: the robust order's shortlist cap would make the two lists' depths differ
    megatron = plan(MQA, TRAINING, CPU4, top=60, megatron=True, workers=1, rank_by="point").ranked
    assert any(not e.executable for e in megatron[:20])  # the two top 20s differ
    result = plan(MQA, TRAINING, CPU4, top=20, workers=1, rank_by="point")
    assert not result.megatron and all(e.executable and e.executable_reason is None for e in result.ranked)
    executable = [e for e in megatron if e.executable][:20]
    assert [e.time.step_time for e in result.ranked] == [e.time.step_time for e in executable]
    assert {e.config for e in result.ranked} == {e.config for e in executable}
    # split over two processes, the slices' lists merge to the same answer
    two = plan(MQA, TRAINING, CPU4, top=20, workers=2, rank_by="point")
    assert [e.time.step_time for e in two.ranked] == [e.time.step_time for e in result.ranked]


def test_the_exhaustive_ranking_puts_executable_layouts_first_too():
    result = plan(MQA, TRAINING, CPU4, top=300, exhaustive=True, workers=1)
    flags = [e.executable for e in result.ranked]
    assert True in flags and False in flags
    assert flags == sorted(flags, reverse=True)  # every executable layout before every other
    assert all(e.executable is not None for e in result.pareto)


def test_a_model_the_executor_cannot_build_is_ranked_by_step_time_with_its_reason():
    layernorm = dataclasses.replace(get_model("tiny-moe"), name="tiny-layernorm", normalization="layernorm")
    result = plan(layernorm, TRAINING, CPU4, top=5, workers=1, rank_by="point")
    megatron = plan(layernorm, TRAINING, CPU4, top=40, megatron=True, workers=1, rank_by="point")
    # the same order, less the Megatron-only dispatchers that only --megatron searches
    executor_built = [e.config for e in megatron.ranked
                      if e.config.moe_token_dispatcher_type not in MEGATRON_ONLY_DISPATCHERS]
    assert [e.config for e in result.ranked] == executor_built[:5]
    assert all(not e.executable and "[executor_model]" in e.executable_reason and "normalization=layernorm"
               in e.executable_reason for e in result.ranked)


def test_explain_says_whether_the_executor_runs_the_layout():
    assert explain_layout(MQA, TRAINING, CPU4, "tp1 ep2").estimate.executable
    verdict = explain_layout(MQA, TRAINING, CPU4, "tp2 ep2")
    assert verdict.valid and not verdict.estimate.executable
    assert verdict.estimate.executable_reason == executor_refusal(MQA, TRAINING, verdict.config)
    assert "kv heads (1) must be divisible by tp (2)" in verdict.estimate.executable_reason
