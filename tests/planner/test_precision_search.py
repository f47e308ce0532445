"""Precision as an opt-in planner knob (SearchSpace.precisions, planner.rank.plan_precisions)."""

from __future__ import annotations

import pytest

from spec.catalog import get_hardware, get_model
from spec.errors import InvalidConfigError
from spec.hardware import ClusterSpec
from spec.training_spec import TrainingSpec
from planner.enumerate import SearchSpace
from planner.rank import plan, plan_precisions

TINY = get_model("tiny-moe")
H100 = get_hardware("h100-sxm")
A100 = get_hardware("a100-80gb")
TRAINING = TrainingSpec(seq_length=64, global_batch_size=8)


def test_by_default_only_the_training_precision_is_planned():
    assert SearchSpace().precisions_for(TRAINING, H100.gpu) == ("bf16",)
    fp8 = TrainingSpec(seq_length=64, global_batch_size=8, precision="fp8")
    assert SearchSpace().precisions_for(fp8, H100.gpu) == ("fp8",)


def test_fp8_is_searched_only_where_the_gpu_has_an_fp8_peak():
    both = SearchSpace(precisions=("bf16", "fp8"))
    assert H100.gpu.supports_fp8 and not A100.gpu.supports_fp8
    assert both.precisions_for(TRAINING, H100.gpu) == ("bf16", "fp8")
    assert both.precisions_for(TRAINING, A100.gpu) == ("bf16",)
    assert SearchSpace(precisions=("fp8",)).precisions_for(TRAINING, A100.gpu) == ("bf16",)


@pytest.mark.parametrize("precisions", [("bf16", "int4"), ()])
def test_unknown_or_no_searched_precision_is_refused(precisions):
    with pytest.raises(InvalidConfigError, match="searched precisions"):
        SearchSpace(precisions=precisions)


def test_plan_precisions_plans_each_precision_and_puts_the_fastest_first():
    """On an H100 both precisions are planned, each with its own training spec; the list is ordered by the
    best layout's predicted step time, and each equals plan() of that precision alone."""
    cluster = ClusterSpec(H100, 2)
    space = SearchSpace(mbs_max=2, vpp_max=1, precisions=("bf16", "fp8"))
    results = plan_precisions(TINY, TRAINING, cluster, space=space, top=3, workers=1)
    assert sorted(r.training.precision for r in results) == ["bf16", "fp8"]
    best = [r.ranked[0].time.step_time for r in results]
    assert best == sorted(best)
    for r in results:
        alone = plan(TINY, r.training, cluster, space=space, top=3, workers=1)
        assert [e.config for e in alone.ranked] == [e.config for e in r.ranked]
    on_a100 = plan_precisions(TINY, TRAINING, ClusterSpec(A100, 2), space=space, top=3, workers=1)
    assert [r.training.precision for r in on_a100] == ["bf16"]
