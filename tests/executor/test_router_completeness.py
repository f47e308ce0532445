"""Router completeness (executor/router.py, dispatcher.py): token dropping under context parallelism, padding
the experts' input to capacity, and Megatron's global aux loss, each equal to the single-process run on gloo."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from spec.catalog import get_model
from spec.errors import InvalidConfigError
from spec.parallel_config import ParallelConfig
from executor.dispatcher import make_dispatcher, pad_rows, unpad_rows
from executor.launch_local import launch
from executor.options import ExecutorOptions
from executor.parallel.context_parallel import cp_positions
from executor.parallel.groups import single_process_state
from executor.router import Router, group_token_order
from executor.verify import Scenario, compare, layout_worker, reference, run_scenario

TINY = get_model("tiny-moe")
PRE_SOFTMAX = dataclasses.replace(TINY, name="tiny-moe-presoftmax", moe_router_pre_softmax=True)
LOSSES = ExecutorOptions(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
PROBS = dataclasses.replace(LOSSES, moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs")
POSITION = dataclasses.replace(LOSSES, moe_expert_capacity_factor=0.75, moe_token_drop_policy="position")
PADDED = dataclasses.replace(PROBS, moe_pad_expert_input_to_capacity=True)
GLOBAL = ExecutorOptions(moe_aux_loss_coeff=1e-1, moe_router_load_balancing_type="global_aux_loss")


def test_group_token_order_puts_cp_chunks_back_in_sequence_order():
    # seq 8, micro-batch 2, cp2, tp2: CP rank r holds positions (2r, 2r+1, 7-2r-1, 7-2r) as chunks of 2, each TP
    # rank a slice of 2 positions; a row's index in the micro-batch is position · 2 + sequence
    order = group_token_order(n=4, micro_batch_size=2, tp=2, cp=2, device=torch.device("cpu"))
    positions = torch.cat([cp_positions(8, 2, r) for r in range(2)])
    assert positions.tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert order.tolist() == [p * 2 + j for p in positions.tolist() for j in range(2)]
    assert sorted(order.tolist()) == list(range(16))
    assert group_token_order(4, 2, 2, 1, torch.device("cpu")).tolist() == list(range(8))  # no CP: as gathered


def test_padding_rows_go_after_each_experts_rows_and_come_back_out():
    rows = torch.arange(5.0).repeat_interleave(2).view(5, 2).requires_grad_()
    padded, counts, positions = pad_rows(rows, torch.tensor([2, 0, 3]), torch.tensor([1, 2, 0]))
    assert counts.tolist() == [3, 2, 3]
    assert padded[:, 0].tolist() == [0, 1, 0, 0, 0, 2, 3, 4]
    back = unpad_rows(padded * 3, positions)
    back.sum().backward()
    assert torch.equal(back.detach(), rows.detach() * 3) and torch.equal(rows.grad, torch.full((5, 2), 3.0))


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_every_expert_computes_exactly_its_capacity_when_padded(dispatcher):
    torch.manual_seed(0)
    state = single_process_state(ParallelConfig(world_size=1, moe_token_dispatcher_type=dispatcher))
    router = Router(TINY, PADDED, state, 0, torch.device("cpu"), torch.float32)
    x = torch.randn(32, TINY.hidden_size)
    routing = router(x, micro_batch_size=2)
    capacity = math.ceil(32 * TINY.moe_router_topk / TINY.num_experts * PADDED.moe_expert_capacity_factor)
    kept = (routing.experts_NK < TINY.num_experts).sum()
    assert 0 < int(kept) < 32 * TINY.moe_router_topk  # some copies dropped: the padding fills them up
    dispatched = make_dispatcher(dispatcher, state, TINY.num_experts, TINY.moe_router_topk).dispatch(x, routing)
    assert dispatched.tokens_per_expert.tolist() == [capacity] * TINY.num_experts
    assert dispatched.x_MH.shape[0] == capacity * TINY.num_experts


def test_padding_without_capacity_is_refused_naming_the_rule():
    with pytest.raises(InvalidConfigError, match=r"\[pad_to_capacity\]"):
        Router(TINY, dataclasses.replace(LOSSES, moe_pad_expert_input_to_capacity=True),
               single_process_state(), 0, torch.device("cpu"), torch.float32)


def _launched(world: int, runs: list[tuple[ParallelConfig, Scenario]]) -> list[dict]:
    launched = launch(layout_worker, world, (runs,), backend="gloo", timeout_s=300, start_method="fork")
    assert launched.ok, launched.failure_reason
    return launched.results[0]["results"]


@pytest.mark.slow  # two ranks, five scenarios (~30 s)
def test_token_dropping_and_padding_under_cp_and_ep_equal_the_single_process_run():
    scenarios = [(ParallelConfig(world_size=2, cp=2), Scenario("cp_probs", PRE_SOFTMAX, PROBS)),
                 (ParallelConfig(world_size=2, cp=2), Scenario("cp_position", TINY, POSITION)),
                 (ParallelConfig(world_size=2, cp=2, ep=2), Scenario("cp_ep_padded", TINY, PADDED)),
                 (ParallelConfig(world_size=2, ep=2), Scenario("ep_padded", PRE_SOFTMAX, PADDED)),
                 (ParallelConfig(world_size=2, ep=2, moe_token_dispatcher_type="allgather"),
                  Scenario("ep_padded_allgather", TINY, PADDED))]
    failures, results = {}, _launched(2, scenarios)
    for (config, scenario), got in zip(scenarios, results):
        problems = compare(reference(config, scenario), got)
        if problems:
            failures[scenario.name] = problems[:4]
    assert not failures, failures
    # padding changes no number: the padded runs equal the unpadded single-process run too (the ep_padded run
    # above, read again)
    padded = results[3]
    assert scenarios[3][1].name == "ep_padded"
    assert compare(reference(ParallelConfig(world_size=1), Scenario("probs", PRE_SOFTMAX, PROBS)), padded) == []


@pytest.mark.slow  # four ranks (~30 s)
def test_token_dropping_with_tp_and_cp_folded_with_ep_equals_the_single_process_run():
    scenarios = [(ParallelConfig(world_size=4, tp=2, cp=2, ep=4, sequence_parallel=True),
                  Scenario("tp_cp_position", TINY, POSITION)),
                 (ParallelConfig(world_size=4, tp=2, cp=2, ep=2, sequence_parallel=True),
                  Scenario("tp_cp_padded", PRE_SOFTMAX, PADDED))]
    for (config, scenario), got in zip(scenarios, _launched(4, scenarios)):
        assert compare(reference(config, scenario), got) == [], scenario.name


def test_the_global_aux_loss_averages_the_steps_micro_batches():
    """One process, four micro-batches a step: the global aux loss (counts averaged over the step so far) trains
    differently from the per-micro-batch aux loss, and equals it with one micro-batch a step."""
    runs = {}
    for kind in ("aux_loss", "global_aux_loss"):
        options = dataclasses.replace(GLOBAL, moe_router_load_balancing_type=kind)
        for mbs in (1, 4):
            runs[kind, mbs] = run_scenario(ParallelConfig(world_size=1),
                                           Scenario(kind, TINY, options, micro_batch_size=mbs, steps=1))
    assert compare(runs["aux_loss", 4], runs["global_aux_loss", 4]) == []
    assert compare(runs["aux_loss", 1], runs["global_aux_loss", 1])  # the running average differs


@pytest.mark.slow  # two ranks, four scenarios (~30 s)
def test_the_global_aux_loss_sums_over_dp_and_cp_like_the_single_process_run():
    """dp2 (and dp2 with ep2) with one micro-batch per replica: the wave is the whole global batch, which one
    process holds as one micro-batch of both replicas' sequences; cp2 (dp 1) with four micro-batches a step: the
    running average over the step's micro-batches, as one process keeps it."""
    # eps as in test_equivalence's "shared": the reference sums its gradients in another order (one micro-batch
    # of two sequences), and Adam's first step turns that noise on ~1e-9 gradients into visible differences
    one_wave = Scenario("global_dp", TINY, GLOBAL, global_batch_size=2, micro_batch_size=1, adam_eps=1e-5)
    waves = Scenario("global_cp", TINY, GLOBAL, global_batch_size=4, micro_batch_size=1, adam_eps=1e-5)
    scenarios = [(ParallelConfig(world_size=2), one_wave), (ParallelConfig(world_size=2, ep=2), one_wave),
                 (ParallelConfig(world_size=2, cp=2), waves), (ParallelConfig(world_size=2, cp=2, ep=2), waves)]
    # the per-micro-batch aux loss of dp2 (checked last) runs in the same launch as the rest
    local = dataclasses.replace(one_wave, options=dataclasses.replace(GLOBAL, moe_router_load_balancing_type="aux_loss"))
    *results, local_run = _launched(2, [*scenarios, (ParallelConfig(world_size=2), local)])
    whole = reference(ParallelConfig(world_size=1), dataclasses.replace(one_wave, micro_batch_size=2))
    for (config, scenario), got in zip(scenarios, results):
        ref = whole if scenario is one_wave else reference(config, scenario)
        assert compare(ref, got) == [], (config.label(), compare(ref, got)[:4])
    # the per-micro-batch aux loss of dp2 is not the whole batch's: the global one is what made them equal
    assert compare(whole, local_run)
