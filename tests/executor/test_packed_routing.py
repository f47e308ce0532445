"""Padding in packed micro-batches has no part in routing (executor/router.py, RealTokens): the z and aux losses,
the tokens they count, capacity and its ranking, the expert bias's load and the reported tokens per expert are
those of the same documents packed without padding; padding rows may pass through the experts but change no loss
or gradient."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from executor.data import packed_global_batch
from executor.dataset.packing import PADDING, split_rows
from executor.launch_local import launch
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from executor.parallel.sharding import gather_model
from executor.verify import Scenario, compare, layout_worker, reference
from spec.catalog import get_model
from spec.parallel_config import ParallelConfig

TINY = get_model("tiny-moe")
SIGMOID = dataclasses.replace(TINY, name="tiny-moe-sigmoid", moe_router_score_function="sigmoid")
SEQ = 32
LOSSES = ExecutorOptions(moe_aux_loss_coeff=1e-1, moe_z_loss_coeff=1e-2)
CASES = {  # (model, options, rows per micro-batch)
    "aux+z": (TINY, LOSSES, 2),
    "seq_aux": (TINY, dataclasses.replace(LOSSES, moe_router_load_balancing_type="seq_aux_loss"), 1),
    "global_aux": (TINY, dataclasses.replace(LOSSES, moe_router_load_balancing_type="global_aux_loss"), 2),
    "capacity": (TINY, dataclasses.replace(LOSSES, moe_expert_capacity_factor=0.5, moe_token_drop_policy="position",
                                           moe_pad_expert_input_to_capacity=True), 1),
    "expert_bias": (SIGMOID, dataclasses.replace(LOSSES, moe_router_enable_expert_bias=True), 2),
}


def _padded_rows(count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``count`` packed rows of SEQ tokens, each ending in at least 3 tokens of padding."""
    rows, flags = packed_global_batch(TINY.vocab_size, SEQ, 16, seed=5, step=0)
    ids, labels, segments = split_rows(rows, flags)
    chosen = [r for r in range(ids.shape[0]) if int((segments[r] == PADDING).sum()) >= 3][:count]
    assert len(chosen) == count
    return ids[chosen], labels[chosen], segments[chosen]


def _unpadded(ids, labels, segments):
    """The same documents in one row without padding (rows' segment ids kept apart): one micro-batch holds the
    same tokens, so micro-batch-wide statistics must agree."""
    keep = segments != PADDING
    offsets = torch.cumsum(segments.max(1).values, 0) - segments.max(1).values
    seg = [segments[r][keep[r]] + offsets[r] for r in range(ids.shape[0])]
    return (torch.cat([ids[r][keep[r]] for r in range(ids.shape[0])]).view(1, -1),
            torch.cat([labels[r][keep[r]] for r in range(ids.shape[0])]).view(1, -1), torch.cat(seg).view(1, -1))


def _run(spec, options, batch, padding_as_document: bool = False) -> dict:
    ids, labels, segments = batch
    if padding_as_document:  # what the router saw before: padding a segment like any other
        segments = torch.where(segments == PADDING, segments.max() + 1, segments)
    torch.manual_seed(0)
    model = MoEGPT(spec, single_process_state(), options, ids.shape[1])
    out = model(ids, labels, segments)
    out.loss.backward()
    moe = model.moe_layers()
    return {"loss": float(out.loss.detach()), "router": float(out.router_loss),
            "grads": gather_model(model, model.state, grads=True),
            "tokens": [m.last_tokens_per_expert.tolist() for m in moe],
            "bias_load": [m.router.step_counts.tolist() for m in moe if m.router.expert_bias is not None]}


@pytest.mark.parametrize("case", list(CASES))
def test_padding_changes_no_routing_statistic_loss_or_gradient(case):
    spec, options, rows = CASES[case]
    padded = _padded_rows(rows)
    got, want = _run(spec, options, padded), _run(spec, options, _unpadded(*padded))
    assert got["router"] > 0 and got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["router"] == pytest.approx(want["router"], rel=1e-5)
    assert got["tokens"] == want["tokens"]
    assert got["bias_load"] == want["bias_load"]
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-7, msg=name)
    # the same padding taken for a document changes the router loss: the comparison above can fail
    as_document = _run(spec, options, padded, padding_as_document=True)
    assert as_document["router"] != pytest.approx(want["router"], rel=1e-3)
    assert sum(map(sum, as_document["tokens"])) > sum(map(sum, want["tokens"]))


# by position: ranking by probabilities can flip near-ties between layouts' fp32 sums over later steps
CAPACITY = dataclasses.replace(LOSSES, moe_expert_capacity_factor=1.0, moe_token_drop_policy="position")
BIAS = dataclasses.replace(LOSSES, moe_router_enable_expert_bias=True)


def test_layouts_mask_the_same_padding_as_one_process():
    """tp2 (sequence parallel: each rank a slice of the real-token mask) and cp2 (load-balanced chunks), with
    capacity and with the expert bias, on packed rows ending in padding: equal to the single-process run."""
    runs = [("tp2 ep2 dp1", Scenario("packed-capacity", TINY, CAPACITY, packed=True, seq_length=SEQ)),
            ("cp2 dp1 cp_comm=p2p", Scenario("packed-capacity", TINY, CAPACITY, packed=True, seq_length=SEQ)),
            ("cp2 dp1 cp_comm=allgather", Scenario("packed-bias", SIGMOID, BIAS, packed=True, seq_length=SEQ))]
    configs = [ParallelConfig.parse(label, world_size=2) for label, _ in runs]
    launched = launch(layout_worker, 2, ([(c, s) for c, (_, s) in zip(configs, runs)],), backend="gloo",
                      timeout_s=300, start_method="fork")
    assert launched.ok, launched.failure_reason
    for config, (label, scenario), got in zip(configs, runs, launched.results[0]["results"]):
        assert not compare(reference(config, scenario), got), label
