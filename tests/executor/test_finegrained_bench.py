"""bench/finegrained_moe.py's measurement code at tiny sizes on the CPU: the rank of an EP layout holding L local
experts runs its real router over all experts and receives every top-k copy its peers route to it, the per-expert
launch loop computes what the grouped experts compute, and a run's record feeds the calibration. No timing is
asserted (CPU wall clocks of a shared machine). The script itself: tests/bench/test_finegrained_moe_bench.py."""

from __future__ import annotations

import pytest
import torch

from costmodel.calibrate import finegrained as calib
from costmodel.finegrained import routed_proxy
from executor.kernels import get_backend
from executor.microbench import finegrained
from executor.microbench.finegrained import ExpertLoop, FinePlan, measure_point, run_plan, slice_layer
from executor.moe import GroupedExperts
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from executor.timing import NULL_TIMER
from spec.catalog import get_hardware


@pytest.mark.parametrize("local", [2, 4])
def test_a_slice_rank_holds_its_local_experts_and_receives_every_copy_routed_to_them(local):
    spec = routed_proxy("deepseek-v3@tiny")  # 8 experts, top-4, sigmoid group routing
    layer = slice_layer(spec, local, 16, torch.device("cpu"), torch.float32, NULL_TIMER)
    assert layer.experts.w2.shape[0] == local
    assert layer.router.router.weight.shape[0] == spec.num_experts  # the router scores every expert
    point = measure_point(spec, local, 16, "cpu", torch.float32, steps=1, warmup=1)
    assert point["ep"] == spec.num_experts // local
    # a symmetric world: the peers send this rank's experts what it routes to theirs, all 16 x top-4 copies
    assert point["received_rows"] == 16 * spec.moe_router_topk
    assert {"router", "dispatch", "ep_alltoall", "experts", "combine"} <= set(point["phases_s"])
    assert point["permutation_s"] == point["phases_s"]["dispatch"] + point["phases_s"]["combine"]


def test_the_per_expert_launch_loop_computes_what_the_grouped_experts_compute():
    spec = routed_proxy("qwen3-30b-a3b@tiny")
    experts = GroupedExperts(spec, ExecutorOptions(), single_process_state(), 0, get_backend("torch"),
                             torch.device("cpu"), torch.float64)
    loop = ExpertLoop(spec.num_experts, spec.hidden_size, spec.expert_ffn_hidden_size, torch.device("cpu"),
                      torch.float64)
    with torch.no_grad():
        for e in range(spec.num_experts):
            loop.fc1[e].copy_(experts.w13[e].flatten(0, 1))  # gate rows, then up rows
            loop.fc2[e].copy_(experts.w2[e])
    rows = [3, 0, 5, 1, 2, 4, 1, 2]
    x = torch.randn(sum(rows), spec.hidden_size, dtype=torch.float64)
    expected = experts(x, torch.tensor(rows))
    torch.testing.assert_close(loop(x, rows), expected)


def test_a_tiny_plan_writes_a_record_the_calibration_reads():
    plan = FinePlan((routed_proxy("qwen3-30b-a3b@tiny"),), (2, 3, 4), (8,), 8, steps=1, host_repeats=1)
    out = run_plan(plan, "cpu", torch.float32, progress=lambda line: None)
    assert [p["local_experts"] for p in out["points"]] == [2, 4]
    assert [h["local_experts"] for h in out["host"]] == [2, 4]
    assert len(out["router"]) == 1 and out["router"][0]["router_s"] > 0
    assert out["skipped"] == ["qwen3-30b-a3b@tiny@1L: 3 local experts do not divide 8"]
    record = calib.check_record({"kind": calib.RECORD_KIND, **out}, "run")
    found = calib.derive(record, get_hardware("cpu"))
    assert found.moe_router_factor > 0 and found.moe_permute_factor > 0
    assert found.local_expert_host_s is not None and found.local_expert_host_s >= 0
    rows = calib.comparison(record, get_hardware("cpu"))
    assert len(rows["points"]) == 2 and all(r["router_priced_s"] > 0 for r in rows["points"])


def test_past_its_budget_a_plan_starts_no_further_point():
    plan = FinePlan((routed_proxy("qwen3-30b-a3b@tiny"),), (2, 4), (8,), 8, steps=1, host_repeats=1)
    out = run_plan(plan, "cpu", torch.float32, progress=lambda line: None, budget_s=0.0)
    assert out["points"] == [] and len(out["skipped"]) == 2 and len(out["host"]) == 2


def test_a_point_that_fails_is_listed_and_the_run_goes_on(monkeypatch):
    real = finegrained.measure_point

    def fails_at_two(spec, local, *args, **kwargs):
        if local == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB")
        return real(spec, local, *args, **kwargs)

    monkeypatch.setattr(finegrained, "measure_point", fails_at_two)
    plan = FinePlan((routed_proxy("qwen3-30b-a3b@tiny"),), (2, 4), (8,), 8, steps=1, host_repeats=1)
    out = run_plan(plan, "cpu", torch.float32, progress=lambda line: None)
    assert [p["local_experts"] for p in out["points"]] == [4]
    assert out["skipped"] == ["qwen3-30b-a3b@tiny@1L: 2 local experts, 8 tokens: OutOfMemoryError: CUDA out of "
                              "memory. Tried to allocate 9 GiB"]
