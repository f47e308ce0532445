"""Packed sequences' loss is Megatron's per-token loss over the global batch (executor/documents.py): the sum of the
cross-entropy over every real (labelled) token of the global batch divided by their global count, whatever the
layout cuts the batch into (DP ranks, micro-batches, CP shares). The reference is one process computing that
quotient directly, row by row; micro-batches hold unequal numbers of real tokens, so a mean of per-micro-batch
means would differ from it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from executor.data import packed_global_batch
from executor.dataset.packing import IGNORE, split_rows
from executor.launch_local import launch
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from executor.parallel.sharding import gather_model
from executor.verify import Scenario, compare, layout_worker, reference
from spec.catalog import get_model
from spec.parallel_config import ParallelConfig

TINY = get_model("tiny-moe")
NO_AUX = ExecutorOptions(moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)
LOSSES = ExecutorOptions(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
# 8 rows of 32 tokens, documents of 2 to 11 tokens: rows end in padding of different lengths. Without router
# losses the whole loss is the cross-entropy, whose gradient the reference takes directly.
SCENARIO = Scenario("packed-per-token", TINY, NO_AUX, seq_length=32, global_batch_size=8, micro_batch_size=1,
                    steps=1, packed=True)
# with router losses (a mean over micro-batches): the loss against the reference's value, the gradients against
# the single-process trainer
WITH_ROUTER = dataclasses.replace(SCENARIO, name="packed-per-token-router", options=LOSSES)


def _rows(scenario: Scenario):
    rows, flags = packed_global_batch(scenario.model.vocab_size, scenario.seq_length, scenario.global_batch_size,
                                      scenario.options.seed, 0)
    return split_rows(rows, flags)


def whole_batch_reference(scenario: Scenario) -> tuple[float, dict[str, torch.Tensor], list[int]]:
    """(loss, gradients, real tokens per row) of the first step's global batch on one process: Σ over rows of
    (row's mean CE × its real tokens) / all real tokens, plus the router losses' mean over the micro-batches
    (gradients: only without router losses)."""
    torch.manual_seed(0)  # the layouts' initialisation (executor.verify.train_and_gather)
    model = MoEGPT(scenario.model, single_process_state(), scenario.options, scenario.seq_length)
    ids, labels, segments = _rows(scenario)
    counts = [int((row != IGNORE).sum()) for row in labels]
    total, mbs = sum(counts), scenario.micro_batch_size
    micro = range(0, ids.shape[0], mbs)
    loss = torch.zeros(())
    for i in micro:
        rows = slice(i, i + mbs)
        out = model(ids[rows], labels[rows], segments[rows])  # its own per-token mean (tests/test_packed_model)
        # out.ce is detached: without router losses out.loss is the cross-entropy with its gradient
        ce = out.loss if not (scenario.options.moe_aux_loss_coeff or scenario.options.moe_z_loss_coeff) else out.ce
        loss = loss + ce * sum(counts[rows]) / total + out.router_loss / len(micro)
    if loss.requires_grad:
        loss.backward()
    return float(loss.detach()), gather_model(model, model.state, grads=True), counts


def _mean_of_means(scenario: Scenario) -> float:
    torch.manual_seed(0)
    model = MoEGPT(scenario.model, single_process_state(), scenario.options, scenario.seq_length)
    ids, labels, segments = _rows(scenario)
    with torch.no_grad():
        return float(sum(model(ids[i:i + 1], labels[i:i + 1], segments[i:i + 1]).loss for i in range(ids.shape[0]))
                     / ids.shape[0])


def _layouts_match(world: int, runs: list[tuple[str, Scenario]]):
    configs = [ParallelConfig.parse(label, world_size=world) for label, _ in runs]
    launched = launch(layout_worker, world, ([(c, s) for c, (_, s) in zip(configs, runs)],), backend="gloo",
                      timeout_s=300, start_method="fork")
    assert launched.ok, launched.failure_reason
    for config, (label, scenario), got in zip(configs, runs, launched.results[0]["results"]):
        loss, grads, _ = whole_batch_reference(scenario)
        assert got["loss"][0] == pytest.approx(loss, rel=1e-5), label
        if scenario.options.moe_aux_loss_coeff:
            assert not compare(reference(config, scenario), got), label
            continue
        assert set(grads) == set(got["grads"]), label
        for name, grad in grads.items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=f"{label} {name}")


def test_the_scenario_has_unequal_real_tokens_so_a_mean_of_means_differs():
    loss, _, counts = whole_batch_reference(SCENARIO)
    assert len(set(counts)) >= 3, counts
    # random weights put every token's CE near log(vocab), so the two differ by little (~5e-4 relative), yet 50
    # times the layouts' tolerance below and far above fp32 noise: the layout test can fail
    assert abs(_mean_of_means(SCENARIO) - loss) > 1e-4 * loss


def test_dp2_with_several_micro_batches_and_cp2_give_the_global_per_token_loss():
    """dp2 (4 micro-batches of one row on each rank), dp2 with micro-batches of two rows, cp2 with the ring
    (8 micro-batches): loss and every gradient equal the whole-batch per-token reference."""
    two = dataclasses.replace(SCENARIO, micro_batch_size=2)
    _layouts_match(2, [("dp2", SCENARIO), ("dp2", two), ("cp2 dp1 cp_comm=p2p", SCENARIO), ("dp2", WITH_ROUTER)])


@pytest.mark.slow
def test_dp2_cp2_with_ep_gives_the_global_per_token_loss():
    _layouts_match(4, [("dp2 cp2 ep2 cp_comm=allgather", SCENARIO), ("dp2 tp2 ep2", SCENARIO),
                       ("dp2 cp2 cp_comm=p2p", WITH_ROUTER)])
