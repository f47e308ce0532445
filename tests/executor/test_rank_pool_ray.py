"""The Ray rank pool: trials of several layouts on the same rank actors give what fresh local launches give,
steps still stream, an out-of-memory trial keeps the actors, a killed rank makes the next trial start new
ones, and trials of another world size get their own."""

from __future__ import annotations

import functools
import os

import pytest

from spec.catalog import get_model
from spec.failure import FailureKind
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec
from executor.launch_local import launch as launch_local
from executor.progress import FAULT_ENV

TINY = get_model("tiny-moe")
TRAINING = TrainingSpec(seq_length=32, global_batch_size=4, precision="fp32")
LAYOUTS = [ParallelConfig(world_size=2, ep=2), ParallelConfig(world_size=2, tp=2, sequence_parallel=True),
           ParallelConfig(world_size=2, tp=2, ep=2, etp=1, micro_batch_size=2)]


@pytest.fixture(scope="module")
def launch_ray():
    from executor import launch_ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    launch_ray.attach_ray()
    return launch_ray


def _profile(config: ParallelConfig, launcher, steps: int = 2):
    from executor.profile import profile_layout

    return profile_layout(TINY, TRAINING, config, warmup_steps=1, timed_steps=steps, timeout_s=120, device="cpu",
                          launcher=launcher)


@pytest.mark.slow
def test_kept_actors_run_three_layouts_like_fresh_ranks_and_stream_steps(launch_ray):
    fresh = [_profile(c, functools.partial(launch_local, start_method="fork")) for c in LAYOUTS]
    pools = launch_ray.RayRankPools()
    try:
        seen: list[list[int]] = []
        pooled, pids = [], []
        for i, config in enumerate(LAYOUTS):
            seen.append([])
            on_step = lambda step, seconds, i=i: seen[i].append(step) and False
            pooled.append(_profile(config, functools.partial(pools.launch, on_step=on_step, name=f"t{i}",
                                                             env={FAULT_ENV: ""})))
            pids.append([p.pids for p in pools._idle])
    finally:
        pools.close()
    for f, p in zip(fresh, pooled):
        assert p.ok, p.failure_reason
        assert p.losses == f.losses and p.tokens_per_expert == f.tokens_per_expert
        assert p.fixed_cost_s >= p.startup_s >= 0 and p.warmup_s >= 0
    assert [m.reused_ranks for m in pooled] == [False, True, True]
    assert pids[0] == pids[1] == pids[2] and len(pids[0]) == 1 and len(pids[0][0]) == 2  # the same two processes
    assert seen == [[0, 1]] * 3  # rank 0's sink is installed afresh for every run


@pytest.mark.slow
def test_out_of_memory_keeps_the_actors_and_a_killed_rank_replaces_them(launch_ray):
    pool = launch_ray.RayRankPool()
    try:
        assert _profile(LAYOUTS[0], pool.launch).ok
        pids = pool.pids
        both = "oom:rank=0:step=0,oom:rank=1:step=0"  # both ranks fail: none is left waiting in a collective
        oom = _profile(LAYOUTS[0], functools.partial(pool.launch, env={FAULT_ENV: both}))
        assert not oom.ok and oom.failure_kind == FailureKind.OOM, oom.failure_reason
        assert pool.pids == pids and pool.starts == 1
        killed = _profile(LAYOUTS[1], functools.partial(pool.launch, env={FAULT_ENV: "kill:rank=1:step=0"}))
        assert not killed.ok and killed.failure_kind == FailureKind.CRASH, killed.failure_reason
        assert pool.pids == []  # torn down
        after = _profile(LAYOUTS[1], pool.launch)
        assert after.ok and not after.reused_ranks and pool.starts == 2
        assert not set(pool.pids) & set(pids)
        assert _profile(ParallelConfig(world_size=1), pool.launch).ok and pool.starts == 3  # another world size
    finally:
        pool.close()
