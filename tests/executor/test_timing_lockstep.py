"""How CPU ranks coordinate their microbenchmarks (executor.microbench.timing): in lockstep (collectives) every
repeat starts on all ranks together and every rank runs as many calls; in turns (each rank's own work) one rank
times at a time while the others wait, so it has the cores to itself whatever the others would do."""

from __future__ import annotations

import time

import torch

from executor.launch_local import launch
from executor.microbench.timing import in_turns, lockstep, one_rank_at_a_time, time_device, time_op

# long beside what rank 0 times alone (~0.1 s, or a few times that on a loaded machine), so that waiting for the
# late rank and not waiting are told apart whatever the load
LATE_S = 1.0


def _worker(rank: int, world_size: int, in_lockstep: bool) -> dict:
    calls = [0]
    # rank 1's call is 20x as long: alone, it sizes its loop to one call, rank 0 to ~20 (a loaded machine's slower
    # sleeps lower that, not to one)
    pause = 0.001 if rank == 0 else 0.02

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


def _turns_worker(rank: int, world_size: int, turns: bool) -> dict:
    calls: dict[str, list[float]] = {"op": [], "device": []}

    def op(phase: str) -> None:
        calls[phase].append(time.perf_counter())
        time.sleep(0.002)

    torch.distributed.barrier()  # start together: without turns the spans then overlap whatever the start-up
    with in_turns(turns):
        # ~0.2 s of calls a rank: far longer than a loaded machine's lag in waking a rank after the barrier
        time_op(lambda: op("op"), torch.device("cpu"), repeats=2, warmup=1, target_s=0.1)
        time_device(lambda: op("device"), torch.device("cpu"), warmup=1, repeats=3)
        body = one_rank_at_a_time(lambda: (time.perf_counter(), time.sleep(0.02), time.perf_counter()))
    return {"op": (calls["op"][0], calls["op"][-1]), "device": (calls["device"][0], calls["device"][-1]),
            "body": (body[0], body[2])}


def _disjoint(spans: list[tuple[float, float]]) -> bool:
    spans = sorted(spans)
    return all(a[1] < b[0] for a, b in zip(spans, spans[1:]))


def test_ranks_in_turns_time_one_at_a_time():
    result = launch(_turns_worker, 3, (True,), backend="gloo", timeout_s=120, start_method="fork")
    for timing in ("op", "device", "body"):  # no rank's timed calls overlap another's
        assert _disjoint([r[timing] for r in result.results]), timing


def test_without_turns_the_ranks_time_at_once():
    result = launch(_turns_worker, 3, (False,), backend="gloo", timeout_s=120, start_method="fork")
    assert not _disjoint([r["op"] for r in result.results])
