"""CPU ranks time their microbenchmarks in lockstep (executor.microbench.timing.lockstep): every repeat starts on
all ranks together and every rank runs as many calls, so a rank is timed under the contention of training (all
ranks computing at once), not alone while the others wait or start."""

from __future__ import annotations

import time

import torch

from executor.launch_local import launch
from executor.microbench.timing import lockstep, time_op

LATE_S = 0.3


def _worker(rank: int, world_size: int, in_lockstep: bool) -> dict:
    calls = [0]
    # rank 1's call is 4x as long: alone, it would size its loop to a quarter of rank 0's calls
    pause = 0.001 if rank == 0 else 0.004

    def op() -> None:
        calls[0] += 1
        time.sleep(pause)

    if rank == 1:
        time.sleep(LATE_S)  # starts late, as a rank still printing or importing does
    start = time.perf_counter()
    with lockstep(in_lockstep):
        time_op(op, torch.device("cpu"), repeats=2, warmup=1, target_s=0.02)
    return {"calls": calls[0], "waited_s": time.perf_counter() - start}


def test_ranks_in_lockstep_run_as_many_calls_and_start_together():
    result = launch(_worker, 2, (True,), backend="gloo", timeout_s=120, start_method="fork")
    r0, r1 = result.results
    assert r0["calls"] == r1["calls"]
    # rank 0 waited for the late rank before its timed repeats
    assert r0["waited_s"] >= LATE_S


def test_without_lockstep_each_rank_sizes_its_own_loop():
    result = launch(_worker, 2, (False,), backend="gloo", timeout_s=120, start_method="fork")
    r0, r1 = result.results
    assert r0["calls"] > r1["calls"]
    assert r0["waited_s"] < LATE_S
