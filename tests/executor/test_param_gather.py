"""overlap_param_gather: the distributed optimizer's parameter all-gather runs behind the next forward.

With it, ``MixedPrecisionAdam.step`` leaves every sharded unit's in-place all-gather pending and the forward
waits for each unit before its parameters are read (executor/optimizer.py). These tests check that the
results equal the synchronous gather bit for bit (plain data parallel, EP·EDP, an interleaved pipeline, a
training run with checkpoints and evaluation), that ``step()`` really returns with gathers pending, and that
no torch operation of the forward or backward reads a parameter whose gather is still pending.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from spec.catalog import get_model
from spec.parallel_config import ParallelConfig
from executor.data import global_batch, micro_batches
from executor.kernels.aliasing import written_through_buffer
from executor.launch_local import launch
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.collectives import all_gather_nograd
from executor.parallel.groups import build_parallel_state
from executor.parallel.sharding import gather_model
from executor.train.loop import TrainConfig, train_local
from executor.train_step import Trainer

REPO = Path(__file__).resolve().parents[2]
TINY = get_model("tiny-moe")
SHARED = get_model("tiny-moe-shared")  # shared experts, first layer dense, 4 layers
OPTIONS = ExecutorOptions(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
BUCKET_MB = 0.01  # many small units: many gathers pending at once, in a meaningful order
SEQ, GBS, STEPS = 16, 8, 3


class _PendingReads(TorchFunctionMode):
    """Records every torch function called with a parameter (or a view of one) whose gather is pending."""

    def __init__(self, optimizer):
        super().__init__()
        self.optimizer = optimizer
        self.storages = {}  # storage pointer of a unit's gather buffer -> unit
        for unit in optimizer._overlapped:
            self.storages[unit.gather_buffer.untyped_storage().data_ptr()] = unit
        self.bad: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("__get__", "__set__"):  # attributes such as .grad, not the values
            return func(*args, **(kwargs or {}))
        for a in list(args) + list((kwargs or {}).values()):
            for t in a if isinstance(a, (list, tuple)) else (a,):
                if isinstance(t, torch.Tensor):
                    unit = self.storages.get(t.untyped_storage().data_ptr())
                    if unit is not None and unit.work is not None:
                        self.bad.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _run(config: ParallelConfig, spec, rank: int, dtype: torch.dtype, check_reads: bool) -> dict:
    """STEPS steps of ``config``; returns the losses, the final full parameters and (check_reads) what
    the forward/backward read while pending."""
    state = build_parallel_state(config, rank)
    torch.manual_seed(0)
    model = MoEGPT(spec, state, OPTIONS, SEQ, dtype=dtype)
    trainer = Trainer(model, lr=1e-2, bucket_mb=BUCKET_MB, eps=1e-6)
    dp = state.dp
    losses, pending, bad = [], [], []
    for step in range(STEPS):
        micro = micro_batches(global_batch(spec.vocab_size, SEQ, GBS, 0, step), dp.size, dp.rank, 1)
        if check_reads and step > 0:
            with _PendingReads(trainer.optimizer) as mode:
                result = trainer.step(micro)
            bad += mode.bad
        else:
            result = trainer.step(micro)
        losses.append(result.loss)
        pending.append(len(trainer.optimizer.pending_units()))
    params = gather_model(model, state)
    return {"loss": losses, "params": params, "pending": pending, "bad": bad,
            "overlapped": len(trainer.optimizer._overlapped)}


def _equality_worker(rank, world, runs):
    out = []
    for label, spec_name, dtype in runs:
        spec = {"tiny": TINY, "shared": SHARED}[spec_name]
        config = ParallelConfig.parse(label, world_size=world)
        sync = _run(config.replace(overlap_param_gather=False), spec, rank, dtype, False)
        overlapped = _run(config, spec, rank, dtype, True)
        out.append((sync, overlapped))
    return out if rank == 0 else None


def _assert_same(label, sync, overlapped):
    assert sync["overlapped"] == 0 and overlapped["overlapped"] > 1, label
    assert sync["pending"] == [0] * STEPS, label
    assert all(n > 0 for n in overlapped["pending"]), (label, overlapped["pending"])
    assert overlapped["bad"] == [], (label, sorted(set(overlapped["bad"])))
    assert overlapped["loss"] == sync["loss"], label
    assert set(overlapped["params"]) == set(sync["params"])
    different = [name for name, t in sync["params"].items() if not torch.equal(t, overlapped["params"][name])]
    assert different == [], (label, different)


# dp2: dense and expert units over DP 2 (fp32 and bf16); dp4 ep2: dense units over DP 4, expert units over
# EDP 2; pp2 vpp2 dp2 ep2: interleaved chunks whose first forwards come in schedule order, dense units over
# DP 2, expert units over EDP 1 (synchronous)
WORLDS = [(2, [("dp2", "tiny", torch.float32), ("dp2", "tiny", torch.bfloat16)]),
          (4, [("dp4 ep2", "shared", torch.bfloat16), ("pp2 vpp2 dp2 ep2", "shared", torch.bfloat16)])]


@pytest.mark.slow
@pytest.mark.parametrize("world,runs", WORLDS, ids=["dp2", "dp4_ep2+pp2_vpp2_dp2_ep2"])
def test_overlapped_gather_equals_synchronous(world, runs):
    launched = launch(_equality_worker, world, (runs,), backend="gloo", timeout_s=400, start_method="fork")
    assert launched.ok, launched.failure_reason
    for run, (sync, overlapped) in zip(runs, launched.results[0]):
        _assert_same(run, sync, overlapped)


def _async_worker(rank, world):
    """After step(): units pending; a forward consumes them all and the parameters hold the gathered masters."""
    state = build_parallel_state(ParallelConfig(world_size=2), rank)  # dp 2, edp 2
    model = MoEGPT(TINY, state, OPTIONS, SEQ, dtype=torch.bfloat16)
    trainer = Trainer(model, lr=1e-2, bucket_mb=BUCKET_MB)
    optimizer = trainer.optimizer
    micro = micro_batches(global_batch(TINY.vocab_size, SEQ, 4, 0, 0), 2, rank, 1)
    trainer.step(micro)
    pending = optimizer.pending_units()
    # what each pending unit's parameters must become: its gathered master shards, in the parameters' dtype
    expected = {}
    for unit in pending:
        flat = all_gather_nograd(unit.master.to(torch.bfloat16), unit.group)[: unit.numel]
        offset = 0
        for p in unit.params:
            expected[id(p)] = flat[offset: offset + p.numel()].view(p.shape).clone()
            offset += p.numel()
    with torch.no_grad():
        model(*micro[0])
    left = optimizer.pending_units()
    equal = all(torch.equal(p.detach(), expected[id(p)]) for u in pending for p in u.params)
    views = all(p.untyped_storage().data_ptr() == u.gather_buffer.untyped_storage().data_ptr()
                for u in optimizer._overlapped for p in u.params)
    # what fp8's weight cache asks: exactly the parameters the overlapped gathers write, every one of them
    reported = written_through_buffer() == {id(p) for p in model.parameters()}
    return len(pending), len(optimizer._overlapped), len(optimizer.units), len(left), equal, views, reported


@pytest.mark.slow
def test_step_returns_with_gathers_pending_and_the_forward_consumes_them():
    launched = launch(_async_worker, 2, backend="gloo", timeout_s=120, start_method="fork")
    assert launched.ok, launched.failure_reason
    for pending, overlapped, units, left, equal, views, reported in launched.results:
        assert overlapped == units > 1  # every unit is sharded over a group of two
        assert pending == overlapped  # step() waited for none of them
        assert left == 0 and equal and views and reported


def _no_overlap(model: MoEGPT, trainer: Trainer, micro) -> list[str]:
    """What shows an overlapped gather (none expected): overlapped units, hooks, pending units after a step."""
    problems = []
    if trainer.optimizer._overlapped:
        problems.append("overlapped units")
    if written_through_buffer():
        problems.append("parameters reported as gathered in place")
    if type(model._parameters) is not dict:
        problems.append("waiting parameter dict")
    if any(m._forward_pre_hooks for m in model.modules()):
        problems.append("forward pre-hooks")
    trainer.step(micro)
    if trainer.optimizer.pending_units():
        problems.append("pending units after step()")
    return problems


def _unsharded_worker(rank, world):
    state = build_parallel_state(ParallelConfig(world_size=2, use_distributed_optimizer=False), rank)
    assert state.config.overlap_param_gather and state.dp.size == 2
    model = MoEGPT(TINY, state, OPTIONS, SEQ, dtype=torch.bfloat16)
    micro = micro_batches(global_batch(TINY.vocab_size, SEQ, 4, 0, 0), 2, rank, 1)
    return _no_overlap(model, Trainer(model, bucket_mb=BUCKET_MB), micro)


def test_overlap_is_off_without_sharding_or_a_group():
    """One process: no group to gather over; two ranks without the distributed optimizer: whole units, no
    shard to gather. Either way nothing is overlapped and step() is the synchronous one."""
    from executor.parallel.groups import single_process_state

    state = single_process_state()
    assert state.config.use_distributed_optimizer and state.config.overlap_param_gather
    model = MoEGPT(TINY, state, OPTIONS, SEQ, dtype=torch.bfloat16)
    micro = micro_batches(global_batch(TINY.vocab_size, SEQ, 2, 0, 0), 1, 0, 1)
    assert _no_overlap(model, Trainer(model, bucket_mb=BUCKET_MB), micro) == []
    launched = launch(_unsharded_worker, 2, backend="gloo", timeout_s=120, start_method="fork")
    assert launched.ok, launched.failure_reason
    assert launched.results == [[], []]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    from api.cli.main import main

    out = tmp_path_factory.mktemp("corpus") / "data"
    assert main(["data", "prepare", str(REPO / "README.md"), str(REPO / "docs"), "--out", str(out)]) == 0
    return str(out)


@pytest.mark.slow
@pytest.mark.parametrize("label,world", [("dp2 mbs2", 2), ("pp2 dp2 mbs1", 4)])
def test_training_with_checkpoints_and_evaluation_equals_the_synchronous_gather(corpus, tmp_path, label, world):
    """Evaluation (a forward, or under PP the pipeline schedule) and checkpoint saves between steps, then a
    resume from the middle checkpoint: every number equals the run with the synchronous gather."""
    torch.set_num_threads(1)
    spec = dataclasses.replace(TINY, untie_embeddings_and_output_weights=True)
    overlapped = ParallelConfig.parse(label, world_size=world)
    assert overlapped.use_distributed_optimizer and overlapped.overlap_param_gather

    def cfg(name: str) -> TrainConfig:
        return TrainConfig(corpus, steps=6, seq_length=32, global_batch_size=4, lr=3e-3, warmup_steps=2,
                           eval_every=3, eval_batches=2, checkpoint_dir=str(tmp_path / name), checkpoint_every=3)

    sync = train_local(spec, overlapped.replace(overlap_param_gather=False), cfg("sync"), OPTIONS,
                       start_method="fork")
    run = train_local(spec, overlapped, cfg("overlap"), OPTIONS, start_method="fork")

    def numbers(report):
        return [(m.loss, m.grad_norm, m.eval_loss) for m in report.metrics]
    assert run.initial_eval_loss == sync.initial_eval_loss
    assert numbers(run) == numbers(sync)
    assert [m.eval_loss is not None for m in run.metrics] == [False, False, True, False, False, True]
    assert [Path(c).name for c in run.checkpoints] == ["step-00000003", "step-00000006"]

    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    (resumed_dir / "latest").write_text("step-00000003\n")
    (resumed_dir / "step-00000003").symlink_to(tmp_path / "overlap" / "step-00000003")
    resumed = train_local(spec, overlapped, cfg("resumed"), OPTIONS, start_method="fork")
    assert resumed.start_step == 3
    assert numbers(resumed) == numbers(sync)[3:]
