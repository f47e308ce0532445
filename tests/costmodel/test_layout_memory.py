"""LayoutMemory (the planner's sweep of one layout) against peak_memory_bytes, config by config, to the bit.

The planner prunes by ``LayoutMemory.peak_bytes`` and ``least_bytes``; a difference in the last bit could flip a
config at the memory limit, so equality here is exact (``==``), over uneven pipelines (chunks of different
sizes), full and selective recompute, both optimizer settings, fp32 and 16-bit weights, optimizer CPU offload and
activation offload, and more micro-batches than the pipeline holds as well as fewer.
"""

from __future__ import annotations

import itertools

import pytest

from costmodel.memory import LayoutMemory, peak_memory_bytes
from spec.catalog import get_hardware, get_model
from spec.hardware import ClusterSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

H100 = ClusterSpec(get_hardware("h100-sxm"), 64)
RECOMPUTE = (("none", (), 0), ("selective", ("layernorm", "moe_act"), 0),
             ("selective", ("core_attn", "moe_act", "layernorm"), 0), ("full", (), 0), ("full", (), 1))
LAYOUTS = (  # (tp, cp, pp, vpp, ep, etp, dispatcher)
    (1, 1, 1, 1, 8, 1, "alltoall"),
    (2, 1, 4, 1, 4, 1, "alltoall"),
    (1, 2, 2, 2, 2, 2, "allgather"),
    (2, 2, 4, 3, 8, 1, "alltoall"),  # uneven chunks for most layer counts
)


KNOB_FIELDS = ("recompute_granularity", "recompute_modules", "recompute_num_layers", "use_distributed_optimizer",
               "overlap_param_gather", "optimizer_cpu_offload_fraction", "activation_offload_modules")


def _knobs(granularity, modules, layers, distopt, fraction=0.0, offloaded=()):
    return ParallelConfig(world_size=64, recompute_granularity=granularity, recompute_modules=modules,
                          recompute_num_layers=layers,
                          use_distributed_optimizer=distopt, overlap_param_gather=distopt,
                          optimizer_cpu_offload_fraction=fraction, activation_offload_modules=offloaded)


def _check_layouts(model, training, knob_sets) -> int:
    """Asserts peak_bytes == peak_memory_bytes and least_bytes <= it for every layout, knob set and mbs."""
    checked = 0
    for tp, cp, pp, vpp, ep, etp, dispatcher in LAYOUTS:
        if model.num_layers < pp * vpp:
            continue
        layout = ParallelConfig(world_size=64, tp=tp, cp=cp, pp=pp, vpp=vpp, ep=ep, etp=etp,
                                sequence_parallel=tp > 1, moe_token_dispatcher_type=dispatcher)
        sweep = LayoutMemory(model, training, H100, layout)
        for knobs in knob_sets:
            least = sweep.least_bytes(knobs)
            for mbs in (1, 2, 4, 8):  # dp·mbs up to the whole batch: from 32 micro-batches down to one
                config = layout.replace(micro_batch_size=mbs, **{name: getattr(knobs, name) for name in KNOB_FIELDS})
                expected = peak_memory_bytes(model, training, H100, config)
                assert sweep.peak_bytes(mbs, knobs) == expected, (config.label(), mbs)
                assert least <= expected
                checked += 1
    return checked


@pytest.mark.parametrize("model_name,precision", [("qwen3-30b-a3b", "bf16"), ("deepseek-v2-lite", "bf16"),
                                                  ("small-moe", "fp32"), ("mixtral-8x7b", "bf16")])
def test_peak_bytes_equals_peak_memory_bytes_to_the_bit(model_name, precision):
    model = get_model(model_name)
    training = TrainingSpec(seq_length=1024, global_batch_size=64, precision=precision)
    knob_sets = [_knobs(g, m, n, d) for (g, m, n), d in itertools.product(RECOMPUTE, (True, False))]
    assert _check_layouts(model, training, knob_sets) >= 3 * len(knob_sets) * 4


@pytest.mark.parametrize("model_name,precision", [("qwen3-30b-a3b", "bf16"), ("deepseek-v2-lite", "bf16"),
                                                  ("small-moe", "fp32")])
def test_peak_bytes_with_offload_equals_peak_memory_bytes_to_the_bit(model_name, precision):
    # the planner's offload options: optimizer offload only with the distributed optimizer; activation offload of
    # moe with the recompute options that leave it alone (no full recompute)
    model = get_model(model_name)
    training = TrainingSpec(seq_length=1024, global_batch_size=64, precision=precision)
    selective = [r for r in RECOMPUTE if r[0] != "full"]
    knob_sets = ([_knobs(g, m, n, True, 0.5) for g, m, n in RECOMPUTE]
                 + [_knobs(g, m, n, d, 0.0, ("moe",)) for (g, m, n), d in itertools.product(selective, (True, False))]
                 + [_knobs(g, m, n, True, 0.5, ("moe",)) for g, m, n in selective]
                 + [_knobs(g, m, n, True, 1.0, ("core_attn", "moe")) for g, m, n in selective[:2]])
    # the same knob values without offload, mixed in: one LayoutMemory serves both, each with its own answer
    knob_sets += [_knobs(g, m, n, True) for g, m, n in RECOMPUTE]
    assert _check_layouts(model, training, knob_sets) >= 3 * len(knob_sets) * 4


def test_offload_lowers_the_peak_and_the_static_bound():
    model = get_model("qwen3-30b-a3b")
    training = TrainingSpec(seq_length=1024, global_batch_size=64)
    layout = ParallelConfig(world_size=64, tp=2, pp=4, ep=4, sequence_parallel=True)
    sweep = LayoutMemory(model, training, H100, layout)
    plain, half = _knobs("none", (), 0, True), _knobs("none", (), 0, True, 0.5)
    moe = _knobs("none", (), 0, True, 0.0, ("moe",))
    assert sweep.least_bytes(half) < sweep.least_bytes(plain)
    assert sweep.least_bytes(moe) == sweep.least_bytes(plain)  # activation offload leaves the static bytes
    assert sweep.peak_bytes(2, half) < sweep.peak_bytes(2, plain)
    assert sweep.peak_bytes(2, moe) < sweep.peak_bytes(2, plain)


def test_layouts_that_differ_only_in_ep_overlap_share_a_key():
    base = ParallelConfig(world_size=64, tp=2, pp=2, vpp=2, ep=8, sequence_parallel=True)
    assert LayoutMemory.key(base) == LayoutMemory.key(base.replace(overlap_moe_expert_parallel_comm=True))
    assert LayoutMemory.key(base) != LayoutMemory.key(base.replace(moe_token_dispatcher_type="allgather"))
    assert LayoutMemory.key(base) != LayoutMemory.key(base.replace(cp=2, pp=1, vpp=1))
