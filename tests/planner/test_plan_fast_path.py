"""The planner's fast memory path (costmodel.memory.LayoutMemory, static-bytes pruning, answers shared between
dispatcher options) gives exactly the plan of the straightforward per-config estimates.

Reference: every valid config of a reduced search space priced on its own with ``estimate_memory`` and
``step_time``, filtered by the usable memory and sorted by step time. The fast plan must list the same layouts
with the same predicted step times and memory totals, to the float, and count the same fitting configs. The
per-config path of the ranker (an injected memory model) must agree too, closest config included when nothing fits.
"""

from __future__ import annotations

import pytest

from costmodel.estimate import step_time
from costmodel.memory import estimate_memory
from planner.enumerate import SearchSpace, enumerate_layouts
from planner.rank import plan
from spec.catalog import get_hardware, get_model
from spec.hardware import ClusterSpec
from spec.training_spec import TrainingSpec

H100 = get_hardware("h100-sxm")
OFFLOAD = {"optimizer_offload": (0.5,), "activation_offload": (("moe",),)}
CASES = [  # (model, GPUs, seq, global batch, mbs_max, vpp_max, more SearchSpace fields)
    ("qwen3-30b-a3b", 32, 4096, 128, 2, 2, {}),
    ("deepseek-v2-lite", 16, 4096, 64, 4, 2, {}),
    pytest.param("mixtral-8x7b", 32, 4096, 64, 2, 3, {}, marks=pytest.mark.slow),  # the slowest scan (~6 s)
    # a scan of every offload option, each with its own LayoutMemory knobs (optimizer offload 0.5, moe offloaded):
    # one model's scan covers them (deepseek-v2-lite's MLA keeps its case above, without offload)
    pytest.param("mixtral-8x7b", 16, 4096, 64, 2, 2, OFFLOAD, marks=pytest.mark.slow),
]


def _key(e):
    return e.config.label(), e.time.step_time, e.memory.total


@pytest.mark.parametrize("name,gpus,seq,gbs,mbs_max,vpp_max,more", CASES)
def test_fast_plan_equals_per_config_estimates(name, gpus, seq, gbs, mbs_max, vpp_max, more):
    model, cluster = get_model(name), ClusterSpec(H100, gpus)
    training = TrainingSpec(seq_length=seq, global_batch_size=gbs)
    space = SearchSpace(mbs_max=mbs_max, vpp_max=vpp_max, **more)
    rows = []
    for cfg in enumerate_layouts(model, training, cluster, space).configs():
        total = estimate_memory(model, training, cluster, cfg).total
        if total <= cluster.usable_hbm_bytes:
            rows.append((step_time(model, training, cluster, cfg).step_time, cfg.label(), total))
    top = 12
    result = plan(model, training, cluster, top=top, space=space, workers=1, rank_by="point")
    assert 0 < len(rows) and result.pruned_by_memory > 0  # the case prunes some configs, keeps others
    if more:  # configs of every offload option fit
        assert {("opt_offload" in label, "act_offload" in label) for _, label, _ in rows} == {
            (False, False), (True, False), (False, True), (True, True)}
    assert result.fitting == len(rows)
    assert result.order_violations == 0 and result.bound_violations == 0
    expected = sorted(rows)[:top]
    got = sorted((e.time.step_time, e.config.label(), e.memory.total) for e in result.ranked)
    assert got == expected  # exact floats, not approx
    assert [e.time.step_time for e in result.ranked] == sorted(e.time.step_time for e in result.ranked)
    # the ranker's per-config path (an injected memory model: no LayoutMemory, no pruning) agrees in every field
    slow = plan(model, training, cluster, top=top, space=space, workers=1, memory_fn=estimate_memory, rank_by="point")
    assert [_key(e) for e in slow.ranked] == [_key(e) for e in result.ranked]
    assert slow.fitting == result.fitting
    assert result.memory_calls < slow.memory_calls  # shared answers and pruned layouts: fewer memory estimates


def test_nothing_fits_names_the_same_closest_config():
    # DeepSeek-V3 on 16 GPUs: no layout fits, so the pruned layouts are scanned again for the closest one
    model, cluster = get_model("deepseek-v3"), ClusterSpec(H100, 16)
    training = TrainingSpec(seq_length=4096, global_batch_size=64)
    space = SearchSpace(mbs_max=2, vpp_max=1)
    fast = plan(model, training, cluster, top=5, space=space, workers=1)
    slow = plan(model, training, cluster, top=5, space=space, workers=1, memory_fn=estimate_memory)
    assert fast.best is None and slow.best is None and fast.fitting == 0
    assert fast.closest is not None
    assert _key(fast.closest) == _key(slow.closest)
