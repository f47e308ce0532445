"""The cost model prices EP all-to-all overlap as the executor runs it (executor/ep_overlap.py, pp = 1):
F₀ alone, F_{i+1} with B_i, B_last alone, so with enough compute to hide behind, exactly one micro-batch's
all-to-all (half in the first forward, half in the last backward) stays exposed, and nothing hides with
one micro-batch."""

from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.step_time import estimate_step_time
from spec.catalog import get_hardware, get_model
from spec.hardware import ClusterSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

MIXTRAL_2L = get_model("mixtral-8x7b").with_layers(2)
# no per-call dispatch cost: it never hides (tests/costmodel/test_exchange_fixed_costs.py); these check the rest
H100 = replace(get_hardware("h100"), dispatcher_fixed_s={"alltoall": 0.0})
CLUSTER = ClusterSpec(H100, 2)


def _estimate(micro: int, overlap: bool):
    training = TrainingSpec(seq_length=4096, global_batch_size=2 * micro)  # dp2: ``micro`` per rank
    config = ParallelConfig(world_size=2, ep=2, overlap_moe_expert_parallel_comm=overlap)
    return estimate_step_time(MIXTRAL_2L, training, CLUSTER, config)


@pytest.mark.parametrize("micro", [2, 4, 8])
def test_one_micro_batch_of_all_to_all_stays_exposed(micro):
    off, on = _estimate(micro, False), _estimate(micro, True)
    a2a = off.term("ep_a2a")
    assert a2a > 0
    # Mixtral's experts (4 per rank at seq 4096) take far longer than the exchange: every all-to-all but
    # the first forward's and the last backward's hides
    assert on.term("ep_a2a") == pytest.approx(a2a / micro, rel=1e-6)
    assert off.step_time - on.step_time == pytest.approx(a2a * (micro - 1) / micro, rel=1e-6)


def test_nothing_hides_with_one_micro_batch():
    off, on = _estimate(1, False), _estimate(1, True)
    assert on.step_time == pytest.approx(off.step_time) and on.term("ep_a2a") == pytest.approx(off.term("ep_a2a"))


def test_etp_collectives_stay_exposed_under_the_overlap():
    """The executor's overlap hides the EP all-to-all only; its ETP all-gather / reduce-scatter run in line."""
    training = TrainingSpec(seq_length=4096, global_batch_size=8)  # ep2·etp2 on 4 GPUs, dp4: 2 per rank
    cluster = ClusterSpec(H100, 4)
    off, on = (estimate_step_time(MIXTRAL_2L, training, cluster,
                                  ParallelConfig(world_size=4, ep=2, etp=2, overlap_moe_expert_parallel_comm=o))
               for o in (False, True))
    assert off.term("etp_comm") > 0 and off.term("ep_a2a") > 0
    assert on.term("etp_comm") == pytest.approx(off.term("etp_comm"), rel=1e-9)
    assert on.term("ep_a2a") == pytest.approx(off.term("ep_a2a") / 2, rel=1e-6)  # 2 micro-batches: one a2a shows
    assert off.step_time - on.step_time == pytest.approx(off.term("ep_a2a") / 2, rel=1e-6)
