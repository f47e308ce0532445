"""EP all-to-all overlap under a pipeline: the combined 1F1B schedule of executor/pipeline.py (its stages and tick
table, worked by hand) and the overlapped step on 4 gloo processes (EP2 folded with PP2, with and without virtual
stages) against the single-process reference and the in-line pipelined run."""

from __future__ import annotations

import functools

import pytest
import torch.distributed as dist

from executor.data import global_batch, micro_batches
from executor.launch_local import launch
from executor.model import MoEGPT
from executor.parallel.groups import build_parallel_state
from executor.pipeline import MergedOp, Op, build_schedule, ops_of, rank_order, rank_stages
from executor.train_step import Trainer
from executor.verify import compare, reference, run_scenario, train_and_gather
from spec.catalog import get_model
from spec.errors import InvalidConfigError
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec
from spec.validity import check
from tests.executor.test_equivalence import SCENARIOS

OVERLAP = {"overlap_moe_expert_parallel_comm": True}


def F(micro: int, chunk: int = 0) -> Op:
    return Op("F", micro, chunk)


def B(micro: int, chunk: int = 0) -> Op:
    return Op("B", micro, chunk)


def test_without_a_pipeline_the_combined_order_pairs_each_forward_with_the_previous_backward():
    stages = rank_stages(1, 1, 3, 0, combined=True)
    assert stages.warmup == (F(0),)
    assert stages.steady == (MergedOp(F(1), B(0)), MergedOp(F(2), B(1)))
    assert stages.cooldown == (B(2),)
    assert rank_order(1, 1, 1, 0, combined=True) == [F(0), B(0)]  # one micro-batch: nothing to pair


def test_combined_1f1b_runs_one_warmup_forward_more_and_merges_the_steady_pairs():
    # pp2, 4 micro-batches: plain 1F1B warms up with pp - rank - 1 forwards (1 and 0)
    plain = [rank_stages(2, 1, 4, r) for r in range(2)]
    assert [len(s.warmup) for s in plain] == [1, 0]
    assert plain[1].steady[:2] == (F(0), B(0))  # the last rank: a forward and then its own backward
    combined = [rank_stages(2, 1, 4, r, combined=True) for r in range(2)]
    assert combined[0].warmup == (F(0), F(1)) and combined[0].cooldown == (B(2), B(3))
    assert combined[0].steady == (MergedOp(F(2), B(0)), MergedOp(F(3), B(1)))
    assert combined[1].warmup == (F(0),) and combined[1].cooldown == (B(3),)
    assert combined[1].steady == (MergedOp(F(1), B(0)), MergedOp(F(2), B(1)), MergedOp(F(3), B(2)))
    # interleaved (Megatron's warmup: 2·(pp - rank - 1) + (vpp - 1)·pp, here + 1), 4 micro-batches, 2 chunks
    stages = rank_stages(2, 2, 4, 1, combined=True)
    assert stages.warmup == (F(0, 0), F(1, 0), F(0, 1))
    assert stages.steady[0] == MergedOp(F(1, 1), B(0, 1))
    assert len(stages.steady) == 5 and stages.cooldown == (B(3, 1), B(2, 0), B(3, 0))
    with pytest.raises(InvalidConfigError, match="vpp_microbatches"):
        rank_stages(2, 2, 3, 0, combined=True)


def test_combined_tick_table_worked_by_hand():
    """pp2, 4 micro-batches: a merged op waits for both its inputs (the forward's activation from rank 0, the
    backward's gradient from rank 1); every message leaves at the end of its tick."""
    schedule = build_schedule(2, 1, 4, combined=True)
    M = MergedOp
    assert schedule.ticks[0] == [F(0), F(1), None, M(F(2), B(0)), None, M(F(3), B(1)), None, B(2), B(3)]
    assert schedule.ticks[1] == [None, F(0), M(F(1), B(0)), None, M(F(2), B(1)), None, M(F(3), B(2)), B(3), None]
    # tick 3: rank 0's merged op sends F2's activation forward; the gradient of B0 has nowhere to go (chunk 0)
    assert [(m.kind, m.micro, m.src, m.dst) for m in schedule.messages[3]] == [("F", 2, 0, 1)]
    # tick 2: rank 1's merged op sends B0's gradient back (its forward F1 ends in the loss)
    assert [(m.kind, m.micro, m.src, m.dst) for m in schedule.messages[2]] == [("B", 0, 1, 0)]


@pytest.mark.parametrize("pp,vpp", [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (2, 3), (4, 2), (8, 4)])
def test_every_combined_schedule_runs_to_its_end_with_independent_halves(pp, vpp):
    for micro in range(pp if vpp > 1 else 1, 4 * pp + 1, pp if vpp > 1 else 1):
        schedule = build_schedule(pp, vpp, micro, combined=True)  # raises when stuck
        for rank in range(pp):
            entries = [e for e in schedule.ticks[rank] if e is not None]
            assert entries == rank_order(pp, vpp, micro, rank, combined=True)
            ops = [op for e in entries for op in ops_of(e)]
            # every forward and every backward once, each forward before its backward
            assert sorted(ops, key=repr) == sorted(rank_order(pp, vpp, micro, rank), key=repr)
            for e in entries:
                if isinstance(e, MergedOp):
                    assert ops.index(F(e.backward.micro, e.backward.chunk)) < ops.index(e.forward)
            # the last entry is a backward alone: the gradient reduction may start there
            assert isinstance(entries[-1], Op) and entries[-1].kind == "B"
            assert sum(isinstance(e, MergedOp) for e in entries) == len(rank_stages(pp, vpp, micro, rank, True).steady)


# --- the overlapped step on 4 processes ------------------------------------------------------------------------
# tiny-moe-shared: 4 layers, the first dense; pp2·vpp2 puts one layer in each chunk (rank 0: layers 0 and 2,
# rank 1: layers 1 and 3). "shared8": 8 sequences, 4 micro-batches per rank under dp2; "shared" / "mtp": 4
# sequences, 4 micro-batches per rank under tp2 (dp1).
# (layout, scenario, judged by the rule book): pp2 without virtual stages is Megatron's rule's to refuse
# (ep_overlap: its combined 1F1B runs in the interleaved schedule only), so its run skips the rule book
RUNS = [
    ("pp2 vpp2 ep2", "shared8", True),  # EP over the dense DP ranks
    ("tp2 pp2 vpp2 ep2 etp1", "shared", True),  # EP over the attention's TP ranks
    ("tp2 pp2 vpp2 ep2 etp1", "mtp", True),  # the MTP depth (in line) and the embedding copy on the last stage
    ("pp2 ep2", "shared8", False),
]


def _runs_worker(rank: int, world: int, runs: list) -> list | None:
    results = [(run_scenario if judged else train_and_gather)(config, scenario, rank)
               for config, scenario, judged in runs]
    return results if rank == 0 else None


@functools.cache
def _reference(scenario: str) -> dict:
    return reference(ParallelConfig(world_size=1), SCENARIOS[scenario])


@pytest.mark.slow
def test_overlapped_pipeline_equals_reference_and_inline_pipeline():
    runs = []
    for label, scenario, judged in RUNS:
        config = ParallelConfig.parse(label, world_size=4)
        spec = SCENARIOS[scenario]
        rules = check(spec.model, TrainingSpec(seq_length=spec.seq_length, global_batch_size=spec.global_batch_size),
                      config.replace(**OVERLAP))
        assert [r.rule for r in rules] == ([] if judged else ["ep_overlap"]), rules
        runs += [(config.replace(**OVERLAP), spec, judged), (config, spec, True)]
    references = [_reference(scenario) for _, scenario, _ in RUNS]  # before the fork
    launched = launch(_runs_worker, 4, (runs,), backend="gloo", timeout_s=900, start_method="fork")
    assert launched.ok, launched.failure_reason
    results = launched.results[0]
    failures = {}
    for i, (label, scenario, _) in enumerate(RUNS):
        overlapped, inline = results[2 * i], results[2 * i + 1]
        problems = compare(references[i], overlapped) + compare(inline, overlapped, rtol=1e-5, atol=1e-7)
        if problems:
            failures[f"{label}/{scenario}"] = problems[:6]
    assert not failures, failures


def _trace_worker(rank: int, world: int, label: str):
    config = ParallelConfig.parse(label, world_size=world).replace(**OVERLAP)
    state = build_parallel_state(config, rank)
    model = MoEGPT(get_model("tiny-moe-shared"), state, SCENARIOS["shared"].options, 16)
    trainer = Trainer(model)
    trace: list = []
    trainer.ep_overlap_trace = trace
    plain = dist.all_to_all_single

    def logged(*args, **kwargs):
        trace.append(("all_to_all", bool(kwargs.get("async_op", False))))
        return plain(*args, **kwargs)

    dist.all_to_all_single = logged
    try:
        dp = state.dp
        trainer.step(micro_batches(global_batch(model.spec.vocab_size, 16, 4 * dp.size, 0, 0), dp.size, dp.rank, 1))
    finally:
        dist.all_to_all_single = plain
    exchanges = [len(model.chunk_moe_layers(v)) * 2 for v in range(model.vpp)]  # dispatch + combine per layer
    return {"trace": trace, "pp_rank": state["pp"].rank, "exchanges": exchanges}


def _hidden(trace: list) -> tuple[int, int]:
    """(exchanges waited for only after compute of another operation, all exchanges)."""
    hidden = total = 0
    for i, event in enumerate(trace):
        if event[0] != "start":
            continue
        total += 1
        owner = event[1].split("/")[0]
        origin = next((k for k in range(i - 1, -1, -1) if trace[k] == ("defer", event[1])), i)
        j = origin + 1
        others = 0
        while trace[j] != ("wait", event[1]):
            others += trace[j][0] == "compute" and trace[j][1] != owner
            j += 1
        hidden += others > 0
    return hidden, total


@pytest.mark.slow
def test_each_merged_op_hides_its_all_to_alls_under_the_other_operation():
    """pp2·vpp2, EP2 folded over TP2, 4 micro-batches. Rank 0 holds the dense layer 0 (chunk 0: no exchange)
    and MoE layer 2 (chunk 1: 2 exchanges), rank 1 MoE layers 1 and 3 (2 each). In a merged op the backward
    computes first: its i-th exchange runs beside the forward's segment i-1 and the forward's j-th beside the
    backward's segment j, so b and f exchanges hide min(b, f + 1) + min(f, b) of them; the warmup and cooldown
    run theirs in line."""
    _reference("shared")  # torch's optimizer imported before the fork
    launched = launch(_trace_worker, 4, ("tp2 pp2 vpp2 ep2 etp1",), backend="gloo", timeout_s=600,
                      start_method="fork")
    assert launched.ok, launched.failure_reason
    for got in launched.results:
        stages = rank_stages(2, 2, 4, got["pp_rank"], combined=True)
        n = got["exchanges"]
        expected = sum(min(n[e.backward.chunk], n[e.forward.chunk] + 1) + min(n[e.forward.chunk], n[e.backward.chunk])
                       for e in stages.steady)
        hidden, total = _hidden(got["trace"])
        assert total == 4 * sum(n) * 2  # every micro-batch through both chunks, forward and backward
        assert hidden == expected and hidden > 0
        if got["pp_rank"] == 1:  # warmup F0.0 F1.0 F0.1; 5 merged ops of 2 + 2 exchanges, all hidden; cooldown
            assert expected == 5 * 4
