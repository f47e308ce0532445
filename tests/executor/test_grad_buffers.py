"""fp32 main gradients in contiguous per-bucket buffers (executor/parallel/grad_reduce.py).

Every 16-bit parameter's ``main_grad`` is a view of its bucket's buffer; all-reduce runs in place on it, a
group of one's reduce-scatter shard *is* it, and the results equal the old path (a main grad of its own per
parameter, flattened into a copy for every reduction).
"""

from __future__ import annotations

import pytest
import torch

from spec import ClusterSpec, TrainingSpec, get_hardware
from spec.catalog import get_model
from costmodel.memory import estimate_memory
from spec.parallel_config import ParallelConfig
from executor.data import global_batch, micro_batches
from executor.launch_local import launch
from executor.model import MoEGPT
from executor.optimizer import attach_main_grads
from executor.options import ExecutorOptions
from executor.parallel import grad_reduce
from executor.parallel.grad_reduce import GradReducer, mark_main_grads_stale, settle_main_grads
from executor.parallel.groups import build_parallel_state, single_process_state
from executor.train_step import Trainer

TINY = get_model("tiny-moe")
BUCKET_MB = 0.01  # many small buckets, most of several tensors
CPU = ClusterSpec(get_hardware("cpu"), 1)


def _predicted(config: ParallelConfig) -> tuple[float, float]:
    """The memory model's (grads, reduced gradient shards) bytes for tiny-moe in bf16 on ``config``."""
    b = estimate_memory(TINY, TrainingSpec(seq_length=16, global_batch_size=4, precision="bf16"), CPU, config)
    return b.grads, dict(b.details).get("optimizer.reduced_grad_shards", 0.0)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _reducer_pair(state, sharded: bool, overlap: bool, dtype=torch.bfloat16):
    """(model, reducer) with buffers and the same model with the old per-parameter main grads."""
    pairs = []
    for buffered in (True, False):
        model = MoEGPT(TINY, state, ExecutorOptions(), 16, dtype=dtype)
        if not buffered:
            attach_main_grads(list(model.parameters()))
        pairs.append((model, GradReducer(model, state, BUCKET_MB, overlap=overlap, sharded=sharded,
                                         main_grads=buffered)))
    return pairs


def _backward_and_reduce(model, reducer, micro) -> None:
    torch.manual_seed(0)
    for i, (ids, labels) in enumerate(micro):
        out = model(ids, labels)
        if i == len(micro) - 1:
            reducer.arm()
        (out.loss / len(micro)).backward()
    reducer.reduce()


def _layout_checks(reducer) -> list[str]:
    """Every 16-bit parameter's main_grad is the next slice of its bucket's buffer."""
    problems = []
    for bucket, buffer in reducer.buckets:
        if buffer is None:
            problems.append("bucket without a buffer")
            continue
        offset = 0
        for p in bucket:
            g = p.main_grad
            if _storage(g) != _storage(buffer) or g.storage_offset() != buffer.storage_offset() + offset:
                problems.append(f"{p.shard_info.name}: main_grad is not its slice of the bucket buffer")
            offset += p.numel()
        if buffer.numel() < offset:
            problems.append("buffer smaller than its bucket")
    return problems


def test_main_grads_are_views_of_bucket_buffers_and_the_size_one_shard_is_the_buffer():
    state = single_process_state()  # world 1, distributed optimizer on: dense and expert groups of one
    assert state.config.use_distributed_optimizer
    (model, reducer), (old_model, old) = _reducer_pair(state, sharded=True, overlap=True)
    params = [p for p in model.parameters() if p.requires_grad]
    assert sum(len(b) for b, _ in reducer.buckets) == len(params) and len(reducer.buckets) > 2
    assert _layout_checks(reducer) == []
    micro = micro_batches(global_batch(TINY.vocab_size, 16, 2, 0, 0), 2, 0, 1)
    _backward_and_reduce(model, reducer, micro)
    _backward_and_reduce(old_model, old, micro)
    assert all(p.grad is None for p in params)  # accumulated into the buffers and freed
    buffers = [buffer for _, buffer in reducer.buckets]
    shards = [s for entry in reducer.entries for s in entry.shards]
    old_shards = [s for entry in old.entries for s in entry.shards]
    assert len(shards) == len(buffers) == len(old_shards)
    for shard, buffer, old_shard in zip(shards, buffers, old_shards):
        assert shard is buffer  # no copy: the shard is the buffer itself
        assert _storage(shard) == _storage(buffer)
        assert torch.equal(shard, old_shard)  # and numerically the old flattened copy
    assert any(float(s.abs().sum()) > 0 for s in shards)
    reducer.materialize()  # a no-op here: the buffers already hold the reduced gradients
    assert _layout_checks(reducer) == []
    # what the memory model predicts is what is held: 4 B per parameter of buffers, no extra shard copies
    held = {_storage(t): t.untyped_storage().nbytes() for t in buffers + shards}
    assert (sum(held.values()), 0.0) == _predicted(state.config)
    assert sum(held.values()) == 4 * sum(p.numel() for p in params)


def test_unsharded_units_read_the_buffers_and_the_reduction_zeroes_main_grads_no_backward_wrote():
    config = ParallelConfig(world_size=1, use_distributed_optimizer=False)
    model = MoEGPT(TINY, single_process_state(config), ExecutorOptions(), 16, dtype=torch.bfloat16)
    trainer = Trainer(model, bucket_mb=BUCKET_MB)
    assert trainer.reducer.entries == []  # no reduction needed, but every parameter has its buffer slice
    assert _layout_checks(trainer.reducer) == []
    for unit, (bucket, buffer) in zip(trainer.optimizer.units, trainer.reducer.buckets):
        assert unit.params == bucket and _storage(unit.grad_shard()) == _storage(buffer)
    batch = global_batch(TINY.vocab_size, 16, 2, 0, 0)
    losses = [trainer.step(micro_batches(batch, 1, 0, 1)).loss for _ in range(3)]
    assert losses[-1] < losses[0]
    assert any(float(b.abs().sum()) > 0 for _, b in trainer.reducer.buckets)
    trainer.optimizer.zero_grad()  # marks them stale: no fill until something reads them
    assert any(float(b.abs().sum()) > 0 for _, b in trainer.reducer.buckets)
    trainer.reducer.reduce()  # a step whose backward wrote none of them
    assert all(float(b.abs().sum()) == 0 for _, b in trainer.reducer.buckets)
    assert _layout_checks(trainer.reducer) == []  # zeroed in place, still views


def test_a_steps_first_gradient_is_written_over_stale_main_grads_and_unwritten_ones_read_zero():
    """After zero_grad the buffers keep the last step's values: the first accumulation copies the gradient
    (not stale + g), the next adds, and settling zeroes the main grads no gradient reached."""
    p1, p2 = (torch.nn.Parameter(torch.zeros(3, 4, dtype=torch.bfloat16)) for _ in range(2))
    buffer = torch.full((24,), 7.0)
    attach_main_grads([p1, p2], buffer)
    mark_main_grads_stale([p1, p2])
    g1, g2 = torch.randn(3, 4).to(torch.bfloat16), torch.randn(3, 4).to(torch.bfloat16)
    p1.grad = g1
    grad_reduce._accumulate(p1)
    assert torch.equal(p1.main_grad, g1.float()) and p1.grad is None
    p1.grad = g2
    grad_reduce._accumulate(p1)
    assert torch.equal(p1.main_grad, g1.float() + g2.float())
    assert torch.equal(p2.main_grad, torch.full((3, 4), 7.0))  # not read yet: still the old values
    settle_main_grads([p1, p2])
    assert torch.equal(p2.main_grad, torch.zeros(3, 4)) and torch.equal(p1.main_grad, g1.float() + g2.float())


@pytest.mark.parametrize("sharded", [False, True])
def test_training_without_the_fill_is_bitwise_the_fill_and_add(sharded):
    """Three steps of two micro-batches: parameters and losses equal, bit for bit, to the same training with
    every main grad zero-filled before each step's backward (the accumulation as it was)."""
    results = []
    for fill in (False, True):
        config = ParallelConfig(world_size=1, use_distributed_optimizer=sharded)
        model = MoEGPT(TINY, single_process_state(config), ExecutorOptions(), 16, dtype=torch.bfloat16)
        trainer = Trainer(model, bucket_mb=BUCKET_MB)
        if fill:
            marked = trainer.optimizer.zero_grad

            def zero_grad(marked=marked, params=trainer.optimizer.params):
                marked()
                settle_main_grads(params)  # every main grad zero-filled, as before

            trainer.optimizer.zero_grad = zero_grad
        batch = global_batch(TINY.vocab_size, 16, 4, 0, 0)
        losses = [trainer.step(micro_batches(batch, 2, 0, 1)).loss for _ in range(3)]
        results.append((losses, [p.detach().clone() for p in model.parameters()]))
    (losses, params), (want_losses, want_params) = results
    assert losses == want_losses
    assert all(torch.equal(a, b) for a, b in zip(params, want_params))


def test_fp32_parameters_keep_grad_as_their_main_gradient():
    model = MoEGPT(TINY, single_process_state(), ExecutorOptions(), 16)
    reducer = GradReducer(model, model.state, BUCKET_MB, sharded=True, main_grads=True)
    assert all(buffer is None for _, buffer in reducer.buckets)
    assert not any(hasattr(p, "main_grad") for p in model.parameters())


def _two_rank_worker(rank, world):
    """Both layouts of 2 ranks (dp 2 sharded into shards of their own, edp 1 sharded as views; then all-reduce
    in place), with and without overlap: buffers against the old path."""
    state = build_parallel_state(ParallelConfig(world_size=2, ep=2), rank)  # dp 2, edp 1
    micro = micro_batches(global_batch(TINY.vocab_size, 16, 4, 0, 0), 2, state["dp_cp"].rank, 1)
    out = {}
    for sharded in (True, False):
        for overlap in (True, False):
            (model, reducer), (old_model, old) = _reducer_pair(state, sharded, overlap)
            layout = _layout_checks(reducer)
            _backward_and_reduce(model, reducer, micro)
            _backward_and_reduce(old_model, old, micro)
            same, views = [], []
            buffer_bytes = sum(b.numel() * 4 for _, b in reducer.buckets)
            shard_bytes = 0  # reduced shards held outside the buffers
            if sharded:
                for entry, old_entry in zip(reducer.entries, old.entries):
                    for shard, buffer, old_shard in zip(entry.shards, entry.buffers, old_entry.shards):
                        same.append(torch.equal(shard, old_shard))
                        views.append((entry.group.size, _storage(shard) == _storage(buffer)))
                        if _storage(shard) != _storage(buffer):
                            shard_bytes += shard.numel() * 4
                reducer.materialize()
                old.materialize()
            for p, q in zip(model.parameters(), old_model.parameters()):
                same.append(torch.equal(p.main_grad, q.main_grad))
            out[(sharded, overlap)] = (layout, all(same), views, buffer_bytes, shard_bytes, len(reducer.buckets))
    return out


def _reuse_worker(rank, world):
    """Two steps' reductions of one sharded reducer (dp 2): the second writes into the first step's shards."""
    state = build_parallel_state(ParallelConfig(world_size=2, ep=2), rank)
    micro = micro_batches(global_batch(TINY.vocab_size, 16, 4, 0, 0), 2, state["dp_cp"].rank, 1)
    (model, reducer), (old_model, old) = _reducer_pair(state, True, True)
    results = []
    for step in range(2):
        for e in old.entries:  # the reference allocates fresh shards every step
            e.shards = [None] * len(e.shards)
        for m, r in ((model, reducer), (old_model, old)):
            for p in m.parameters():
                p.main_grad.zero_()
            _backward_and_reduce(m, r, micro)
        results.append([(_storage(s), s.clone()) for e in reducer.entries if e.group.size > 1 for s in e.shards])
        same = all(torch.equal(a, b) for e, o in zip(reducer.entries, old.entries) for a, b in zip(e.shards, o.shards))
        results[-1].append(same)
    first, second = results
    return {"reused": [a[0] == b[0] for a, b in zip(first[:-1], second[:-1])], "equal": [first[-1], second[-1]]}


def test_the_next_reduce_scatter_writes_into_the_kept_shard():
    """A sharded bucket's reduce-scatter output is the previous step's shard (no second copy of every shard
    while the reductions run), and the reduced values equal a fresh-shard reducer's, step after step."""
    launched = launch(_reuse_worker, 2, backend="gloo", timeout_s=300, start_method="fork")
    assert launched.ok, launched.failure_reason
    for result in launched.results:
        assert result["reused"] and all(result["reused"])
        assert result["equal"] == [True, True]


@pytest.mark.slow
def test_two_ranks_reduce_in_place_and_match_the_flattened_copies():
    launched = launch(_two_rank_worker, 2, backend="gloo", timeout_s=300, start_method="fork")
    assert launched.ok, launched.failure_reason
    for result in launched.results:
        assert len(result) == 4
        for (sharded, overlap), (layout, same, views, buffer_bytes, shard_bytes, buckets) in result.items():
            assert layout == [], (sharded, overlap)
            assert same, (sharded, overlap)
            grads, kept = _predicted(ParallelConfig(world_size=2, ep=2, use_distributed_optimizer=sharded))
            padding = 4 * buckets  # under one element per bucket and shard
            assert grads <= buffer_bytes <= grads + padding
            if sharded:
                # dense over dp 2: a new half-size shard; experts over edp 1: the buffer itself
                assert {size for size, _ in views} == {1, 2}
                assert all(shared == (size == 1) for size, shared in views)
                assert kept > 0 and kept <= shard_bytes <= kept + padding  # the model's reduced_grad_shards
            else:
                assert kept == shard_bytes == 0
