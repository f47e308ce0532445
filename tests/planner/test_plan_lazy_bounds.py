"""The planner's floor-keyed queue (``costmodel.estimate.steady_state_floor``; a group's steady-state bound computed
only when the best-first queue reaches it) ranks exactly as the queue keyed by every group's bound computed up front.

The floor must be a lower bound: of the planner's steady-state bound on every single-stage config of a reduced
search space, and of the step time less its once-per-step terms, bubble and (with EP overlap) ep_a2a on every
config, with and without component factors (some below 1). Then whole plans with the floor and without it (the same
time model under another name, which turns the floor off) must list the same configs with the same floats, time the
same candidates and count the same fitting configs, on one process and on two.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.estimate import steady_state_floor, step_time
from costmodel.memory import LayoutMemory, estimate_memory, peak_memory_bytes
from planner.enumerate import ConfigMaker, SearchSpace, enumerate_layouts
from planner.rank import PER_STEP_TERMS, _Job, _steady_state_bound, _steady_state_floor, plan
from spec.catalog import get_hardware, get_model
from spec.hardware import ClusterSpec
from spec.training_spec import TrainingSpec

H100 = get_hardware("h100-sxm")
CASES = [  # (model, GPUs, seq, global batch, mbs_max, vpp_max)
    ("qwen3-30b-a3b", 32, 4096, 128, 2, 2),
    ("deepseek-v2-lite", 16, 4096, 64, 4, 2),
    pytest.param("mixtral-8x7b", 32, 4096, 64, 2, 3, marks=pytest.mark.slow),
]


def _with(extra_of):
    """CASES, each followed by every tuple ``extra_of(model name)`` gives (the case's marks kept)."""
    for case in CASES:
        values, marks = (case.values, case.marks) if hasattr(case, "values") else (case, ())
        for extra in extra_of(values[0]):
            yield pytest.param(*values, *extra, marks=marks)


# Every model with factors; without them the mixtral case (the slowest scan, there for vpp 3) would check the
# plain terms qwen3's and deepseek's cases check already.
FLOOR_CASES = list(_with(lambda name: [(True,)] if name == "mixtral-8x7b" else [(False,), (True,)]))
# Two workers share the one-worker path's ranking code: one model's plans on two cover them.
PLAN_CASES = list(_with(lambda name: [(f, w) for f in (False, True) for w in ((1, 2) if name == "qwen3-30b-a3b"
                                                                                else (1,))]))
# layer terms scaled both ways, and a host factor (which the floor does not read)
FACTORS = {"gemm": 0.5, "grouped_gemm": 1.5, "memory_bound": 0.8, "tp_comm": 2.0, "ep_a2a": 0.3, "host": 0.5}


def _hardware(name: str, factors: bool):
    return replace(H100, name="h100-factors", component_factors={f"{name}@seq4096": FACTORS}) if factors else H100


def _specs(name, gpus, seq, gbs, factors=False):
    return get_model(name), TrainingSpec(seq_length=seq, global_batch_size=gbs), ClusterSpec(_hardware(name, factors),
                                                                                                gpus)


def eager_step_time(model, training, cluster, config):
    """``step_time`` under another name: the planner keys its queue on every group's bound, computed up front."""
    return step_time(model, training, cluster, config)


@pytest.mark.parametrize("name,gpus,seq,gbs,mbs_max,vpp_max,factors", FLOOR_CASES)
def test_floor_is_below_the_bound_and_the_steady_state(name, gpus, seq, gbs, mbs_max, vpp_max, factors):
    model, training, cluster = _specs(name, gpus, seq, gbs, factors)
    enum = enumerate_layouts(model, training, cluster, SearchSpace(mbs_max=mbs_max, vpp_max=vpp_max))
    distopts, chain = enum.knobs_for(enum.offload[0])
    job = _Job(model, training, cluster, enum.layouts, chain, distopts, estimate_memory, peak_memory_bytes,
               step_time, False, layout_memory=LayoutMemory, floor_fn=steady_state_floor)
    maker = ConfigMaker(cluster.num_gpus, enum.pipeline)
    knob = ConfigMaker.knobs(distopts[0], *chain[0])
    groups = 0
    for lay in enum.layouts:
        for dispatcher in lay.dispatchers:
            base = maker.base(lay, dispatcher)
            for mbs in lay.micro_batch_sizes:
                floor, bound = _steady_state_floor(job, base, mbs, knob), _steady_state_bound(job, base, mbs, knob)
                assert 0.0 <= floor <= bound
                assert (floor > 0.0) == (bound > 0.0)  # a real bound has a real floor
                groups += 1
    assert groups
    overlap = 0
    for cfg in enum.configs():  # every pipeline and knob, not only the planner's single stages
        t = step_time(model, training, cluster, cfg)
        skip = PER_STEP_TERMS | {"ep_a2a"} if cfg.overlap_moe_expert_parallel_comm else PER_STEP_TERMS
        assert steady_state_floor(model, training, cluster, cfg) <= t.step_time - sum(
            v for term, v in t.terms if term in skip)
        overlap += cfg.overlap_moe_expert_parallel_comm
    assert overlap  # EP overlap configs are among them


def _key(e):
    return e.config.label(), e.time.step_time, e.memory.total


@pytest.mark.parametrize("name,gpus,seq,gbs,mbs_max,vpp_max,factors,workers", PLAN_CASES)
def test_floor_keyed_plan_equals_the_bound_keyed_plan(name, gpus, seq, gbs, mbs_max, vpp_max, factors, workers):
    model, training, cluster = _specs(name, gpus, seq, gbs, factors)
    space = SearchSpace(mbs_max=mbs_max, vpp_max=vpp_max)
    lazy = plan(model, training, cluster, top=12, space=space, workers=workers, rank_by="point")
    eager = plan(model, training, cluster, top=12, space=space, workers=workers, time_fn=eager_step_time)
    assert lazy.ranked and [_key(e) for e in lazy.ranked] == [_key(e) for e in eager.ranked]  # exact floats
    assert lazy.fitting == eager.fitting and lazy.memory_calls == eager.memory_calls
    # the same candidates timed; bounds only for the groups the queue reached
    assert lazy.time_calls - lazy.bound_calls == eager.time_calls - eager.bound_calls
    assert 0 < lazy.bound_calls < eager.bound_calls
    assert (lazy.order_violations, lazy.bound_violations) == (eager.order_violations, eager.bound_violations) == (0, 0)
