"""TP communication overlap (``tp_comm_overlap``, Megatron's ``--tp-comm-overlap``) on 2 gloo processes: the step
equals the single-process reference and the in-line run, its all-gathers and reduce-scatters are started
asynchronously with a GEMM issued before each is waited for, and the rule book lets the executor run it."""

from __future__ import annotations

import pytest
import torch

from executor.buildable import check_buildable, training_for
from executor.launch_local import launch
from executor.parallel import tensor_parallel
from executor.parallel.groups import single_process_state
from executor.verify import compare
from spec.catalog import get_model
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec
from spec.validity import executor_refusal
from tests.executor.test_equivalence import SCENARIOS
from tests.executor.test_equivalence import runs_with_and_without, traced_layout_worker
from tests.executor.test_equivalence import two_rank_config as _config

OVERLAP = {"tp_comm_overlap": True}
# (layout, scenario, extra fields) on 2 ranks: TP·SP attention and MLPs (dense layer, shared experts), MLA's output
# projection, and TP folded onto EP
RUNS = [
    ("tp2", "shared", {}),
    ("tp2", "mla", {}),
    ("tp2", "gptoss", {}),  # biases, windows, sinks
    ("tp2 ep2 etp1", "shared", {}),
    ("tp2 ep2 etp1", "shared", {"moe_shared_expert_overlap": True}),  # both overlaps
    ("tp2", "shared", {"recompute_granularity": "selective",
                       "recompute_modules": ("core_attn", "moe_act", "layernorm", "shared_experts")}),
]


def test_the_executor_runs_tp_overlap():
    """The layouts are built (no executor rule refuses the knob), and the planner's executable flag is set."""
    for label, scenario, extra in RUNS:
        check_buildable(SCENARIOS[scenario].model, training_for(16, 4, None, False), _config(label, extra).replace(
            **OVERLAP))
    model = get_model("qwen3-30b-a3b")
    training = TrainingSpec(seq_length=4096, global_batch_size=64)
    assert executor_refusal(model, training, ParallelConfig(16, tp=2, ep=8, tp_comm_overlap=True)) is None


def test_gathered_and_scattered_are_enter_tp_and_leave_tp_over_one_rank():
    """Over a group of one the helpers are fn(x) and leave_tp(fn(x)) (the single-process path)."""
    state = single_process_state()
    x = torch.randn(8, 2, 4)
    w = torch.randn(6, 4)
    assert torch.equal(tensor_parallel.gathered(x, lambda r: r @ w.t(), state), x @ w.t())
    q, k = tensor_parallel.gathered(x, lambda r: (r + 1, r * 2), state)
    assert torch.equal(q, x + 1) and torch.equal(k, x * 2)


def _helpers_worker(rank: int, world: int) -> list[float]:
    """max |plain - overlapped| of (output, input grad, column weight grad, row weight grad) of a column-parallel
    then a row-parallel linear over tp 2 (the row part's pieces reduce-scattered while the next is computed)."""
    from executor.parallel.groups import build_parallel_state

    state = build_parallel_state(ParallelConfig(world_size=2, tp=2, tp_comm_overlap=True), rank)
    torch.manual_seed(0)
    full, w1, w2 = torch.randn(8, 2, 4), torch.randn(6, 4), torch.randn(4, 6)
    out = {}
    for overlapped in (False, True):
        x = full[rank * 4:(rank + 1) * 4].clone().requires_grad_(True)
        a, b = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
        if overlapped:
            y = tensor_parallel.scattered(tensor_parallel.gathered(x, lambda r: r @ a.t(), state),
                                          lambda r: r @ b.t(), state)
        else:
            y = tensor_parallel.leave_tp(tensor_parallel.enter_tp(x, state) @ a.t() @ b.t(), state)
        (y * torch.arange(y.numel()).view_as(y)).sum().backward()
        out[overlapped] = (y.detach(), x.grad, a.grad, b.grad)
    return [float((p - q).abs().max()) for p, q in zip(out[False], out[True])]


def test_gathered_and_scattered_equal_the_inline_collectives_with_their_gradients():
    """Forward and every gradient of the overlapped helpers on 2 gloo ranks equal the in-line ones (gloo ends its
    asynchronous reduce-scatter with a copy into the output: outside autograd, else it cut the graph)."""
    launched = launch(_helpers_worker, 2, (), backend="gloo", timeout_s=120, start_method="fork")
    assert launched.ok, launched.failure_reason
    for errors in launched.results:
        assert errors[0] == 0.0 and max(errors[1:]) < 1e-4, errors


_TRACE: list = []  # the order of events in this process (a forked rank appends to its own copy)


def _logged(name, plain):
    def start(x, group):
        pending = plain(x, group)
        _TRACE.append((name, pending.work is not None))
        wait = pending.wait

        def logged_wait():
            if pending.work is not None:  # the wait that ends the collective (a second call returns its output)
                _TRACE.append(("wait", name))
            return wait()
        pending.wait = logged_wait
        return pending
    return start


@pytest.mark.slow
def test_overlapped_step_equals_reference_and_inline_run(monkeypatch):
    monkeypatch.setattr(tensor_parallel, "all_gather_async",
                        _logged("all_gather", tensor_parallel.all_gather_async))
    monkeypatch.setattr(tensor_parallel, "reduce_scatter_async",
                        _logged("reduce_scatter", tensor_parallel.reduce_scatter_async))
    linear = torch.nn.functional.linear

    def logged_linear(*args, **kwargs):
        _TRACE.append(("gemm",))
        return linear(*args, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "linear", logged_linear)
    references, results, reports = runs_with_and_without(RUNS, OVERLAP, traced_layout_worker(_TRACE))
    failures = {}
    for i, (label, scenario, extra) in enumerate(RUNS):
        overlapped, inline = results[i]
        # the in-line run at the reference's tolerance: the overlap adds the input gradient of a gathered slice in
        # another order (this rank's own rows directly, the others' through the reduce-scatter), fp32 noise that
        # Adam's 1/sqrt(v) magnifies in the embedding rows of near-zero gradient (2.5e-4 relative after 3 steps)
        problems = compare(references[i], overlapped) + compare(inline, overlapped)
        if problems:
            failures[f"{label}/{scenario}/{extra}"] = problems[:6]
    assert not failures, failures
    for got in reports:
        for run, (overlapped, inline) in enumerate(zip(got["traces"][::2], got["traces"][1::2])):
            starts = [i for i, e in enumerate(overlapped) if e[0] in ("all_gather", "reduce_scatter")]
            assert starts and all(overlapped[i][1] for i in starts)  # every one asynchronous
            assert len([e for e in overlapped if e[0] == "wait"]) == len(starts)  # and waited for: none left over
            assert not any(e[0] in ("all_gather", "reduce_scatter") for e in inline)
            if "recompute_granularity" in RUNS[run][2]:
                continue  # a recomputed forward waits at once and may stop early (torch's checkpoint)
            # a GEMM issued between each start and its wait: the GEMMs of this rank's slice under an all-gather,
            # the second piece's under the first piece's reduce-scatter
            gathers = [i for i in starts if overlapped[i][0] == "all_gather"]
            assert gathers and all(overlapped[i + 1] == ("gemm",) for i in gathers)
            scatters = [i for i in starts if overlapped[i][0] == "reduce_scatter"]
            pair = [("reduce_scatter", True), ("gemm",), ("reduce_scatter", True), ("wait", "reduce_scatter"),
                    ("wait", "reduce_scatter")]
            pairs = [i for i in scatters if overlapped[i:i + 5] == pair]
            assert scatters and 2 * len(pairs) == len(scatters), run


