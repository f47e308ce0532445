"""The cost model prices EP all-to-all overlap as the executor runs it (executor/ep_overlap.py, pp = 1):
F₀ with F₁, B_i with F_{i+2}, B_{m-2} with B_{m-1}, so with enough compute to hide behind every all-to-all
hides; where an exchange outlasts the compute beside it, the excess shows for every micro-batch; nothing
hides with one micro-batch. The schedule holds two micro-batches' activations, and the memory model says so."""

from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.memory import estimate_memory, in_flight_micro_batches
from costmodel.step_time import estimate_step_time
from spec.catalog import get_hardware, get_model
from spec.hardware import ClusterSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

MIXTRAL_2L = get_model("mixtral-8x7b").with_layers(2)
# no per-call dispatch cost: it never hides (tests/costmodel/test_exchange_fixed_costs.py); these check the rest
H100 = replace(get_hardware("h100"), dispatcher_fixed_s={"alltoall": 0.0})
CLUSTER = ClusterSpec(H100, 2)


def _estimate(micro: int, overlap: bool, cluster: ClusterSpec = CLUSTER):
    training = TrainingSpec(seq_length=4096, global_batch_size=2 * micro)  # dp2: ``micro`` per rank
    config = ParallelConfig(world_size=2, ep=2, overlap_moe_expert_parallel_comm=overlap)
    return estimate_step_time(MIXTRAL_2L, training, cluster, config)


@pytest.mark.parametrize("micro", [2, 4, 8])
def test_every_all_to_all_hides_behind_enough_compute(micro):
    off, on = _estimate(micro, False), _estimate(micro, True)
    a2a = off.term("ep_a2a")
    assert a2a > 0
    # Mixtral's experts (4 per rank at seq 4096) take far longer than the exchange, and the first forward and
    # the last backward have a partner too: nothing shows
    assert on.term("ep_a2a") == 0.0
    assert off.step_time - on.step_time == pytest.approx(a2a, rel=1e-6)


def test_an_exchange_longer_than_the_compute_beside_it_shows_its_excess_for_every_micro_batch():
    # NVLink at 1/20000 of its speed: one micro-batch's all-to-all outlasts its partner's forward and backward
    slow = ClusterSpec(replace(H100, intra_node_bandwidth=H100.intra_node_bandwidth / 20000), 2)
    for micro in (2, 4):
        off, on = _estimate(micro, False, slow), _estimate(micro, True, slow)
        per_micro = off.term("ep_a2a") / micro
        fast = _estimate(micro, False)  # compute does not depend on the link: an upper bound of one micro-batch's
        window = (fast.step_time - fast.term("ep_a2a")) / micro
        assert per_micro > window
        shown = on.term("ep_a2a")
        assert micro * (per_micro - window) <= shown < off.term("ep_a2a")
        assert shown / micro == pytest.approx(_estimate(2, True, slow).term("ep_a2a") / 2, rel=1e-6)


def test_nothing_hides_with_one_micro_batch():
    off, on = _estimate(1, False), _estimate(1, True)
    assert on.step_time == pytest.approx(off.step_time) and on.term("ep_a2a") == pytest.approx(off.term("ep_a2a"))


def test_the_overlap_holds_two_micro_batches_of_activations():
    def activations(micro: int, overlap: bool) -> float:
        training = TrainingSpec(seq_length=4096, global_batch_size=2 * micro)
        config = ParallelConfig(world_size=2, ep=2, overlap_moe_expert_parallel_comm=overlap)
        return estimate_memory(MIXTRAL_2L, training, CLUSTER, config).activations

    one = activations(4, False)
    assert one > 0
    # one micro-batch's layers more; the last stage's once-per-step tensors (head input, logits) stay once
    assert 0.9 * one < activations(4, True) - one < one
    assert activations(1, True) == pytest.approx(activations(1, False), rel=1e-9)  # one micro-batch: alone
    assert in_flight_micro_batches(1, 1, 0, 8, ep_overlap=True) == 2
    assert in_flight_micro_batches(1, 1, 0, 1, ep_overlap=True) == 1
    assert in_flight_micro_batches(1, 1, 0, 8) == 1
    assert in_flight_micro_batches(4, 2, 0, 8, ep_overlap=True) == in_flight_micro_batches(4, 2, 0, 8)  # a pipeline's


def test_etp_collectives_stay_exposed_under_the_overlap():
    """The executor's overlap hides the EP all-to-all only; its ETP all-gather / reduce-scatter run in line."""
    training = TrainingSpec(seq_length=4096, global_batch_size=8)  # ep2·etp2 on 4 GPUs, dp4: 2 per rank
    cluster = ClusterSpec(H100, 4)
    off, on = (estimate_step_time(MIXTRAL_2L, training, cluster,
                                  ParallelConfig(world_size=4, ep=2, etp=2, overlap_moe_expert_parallel_comm=o))
               for o in (False, True))
    assert off.term("etp_comm") > 0 and off.term("ep_a2a") > 0
    assert on.term("etp_comm") == pytest.approx(off.term("etp_comm"), rel=1e-9)
    assert on.term("ep_a2a") == 0.0  # 2 micro-batches, paired with each other
    assert off.step_time - on.step_time == pytest.approx(off.term("ep_a2a"), rel=1e-6)
