"""The local launcher turns crashes, out-of-memory errors and hangs into failed results, leaving no process."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from executor.failure import is_out_of_memory
from executor.launch_local import launch
from spec.failure import FailureKind


def _ok(rank, world):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return {"rank": rank, "sum": float(t), "pid": os.getpid()}


def _raises(rank, world):
    if rank == 1:
        raise ValueError("bad shard on purpose")
    dist.barrier()  # rank 0 waits for a peer that is gone
    return rank


def _oom(rank, world):
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")


def _dies(rank, world):
    if rank == 0:
        os._exit(17)
    dist.barrier()


def _hangs(rank, world):
    with open(f"{os.environ['FOLDTUNE_TEST_DIR']}/pid{rank}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3600)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_ranks_run_and_return_results():
    result = launch(_ok, 2, backend="gloo", timeout_s=60, start_method="fork")
    assert result.ok, result.failure_reason
    assert [r["sum"] for r in result.results] == [3.0, 3.0]
    assert not any(_alive(r["pid"]) for r in result.results)


@pytest.mark.slow
@pytest.mark.parametrize("fn,reason,kind", [(_raises, "ValueError on rank 1: bad shard on purpose", FailureKind.ERROR),
                                            (_oom, "out of memory on rank", FailureKind.OOM),
                                            (_dies, "rank 0 died (exit code 17)", FailureKind.CRASH)])
def test_failures_become_reasons(fn, reason, kind):
    result = launch(fn, 2, backend="gloo", timeout_s=60, start_method="fork")
    assert not result.ok
    assert reason in result.failure_reason
    assert result.failure_kind == kind


def test_out_of_memory_is_detected_from_the_exception():
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB"))
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(type("OutOfMemoryError", (RuntimeError,), {})("no text"))
    assert not is_out_of_memory(ValueError("bad shard on purpose"))


@pytest.mark.slow
def test_timeout_kills_every_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("FOLDTUNE_TEST_DIR", str(tmp_path))
    result = launch(_hangs, 2, backend="gloo", timeout_s=3, start_method="fork")
    assert not result.ok and result.failure_reason.startswith("timeout after 3 s")
    assert result.failure_kind == FailureKind.TIMEOUT
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    assert not any(_alive(p) for p in pids)


def test_a_rendezvous_port_taken_before_rank_0_binds_it_is_retried_on_a_new_port(monkeypatch):
    import socket

    import executor.launch_local as ll

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real = ll.free_port
    ports = iter([taken])
    monkeypatch.setattr(ll, "free_port", lambda: next(ports, None) or real())
    try:
        result = launch(_ok, 2, backend="gloo", timeout_s=60, start_method="fork")
    finally:
        squatter.close()
    assert result.ok, result.failure_reason
    assert [r["sum"] for r in result.results] == [3.0, 3.0]


@pytest.mark.slow  # test_a_rendezvous_port_taken_before_rank_0_binds_it_is_retried_on_a_new_port is the fast tier's
def test_a_port_taken_on_every_attempt_fails_with_the_reason(monkeypatch):
    import socket

    import executor.launch_local as ll

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    monkeypatch.setattr(ll, "free_port", lambda: squatter.getsockname()[1])
    try:
        result = launch(_ok, 2, backend="gloo", timeout_s=60, start_method="fork")
    finally:
        squatter.close()
    assert not result.ok and ll._port_taken(result.failure_reason)


class _Cycle:
    """Garbage only the cyclic collector frees; its destructor records the process it ran in."""

    def __init__(self, path) -> None:
        self.path, self.me = path, self

    def __del__(self) -> None:
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


def _collects(rank, world):
    import gc

    gc.collect()  # what a rank's collector does sooner or later
    return os.getpid()


@pytest.mark.parametrize("pooled", [False, True], ids=["launch", "rank-pool"])
def test_a_forked_rank_never_runs_the_destructors_of_garbage_it_inherited(tmp_path, pooled):
    """Ray's client objects hang a forked rank (a thread join) or break the parent's session (a socket) when
    the rank's collector frees them; any inherited garbage stands in for them here."""
    import gc

    from executor.rank_pool import LocalRankPool

    record = tmp_path / "destructors"
    gc.disable()  # the cycle stays uncollected until the ranks are forked
    try:
        _Cycle(record)
        if pooled:
            with LocalRankPool(start_method="fork") as pool:
                result = pool.launch(_collects, 2, backend="gloo", timeout_s=120)
        else:
            result = launch(_collects, 2, backend="gloo", timeout_s=120, start_method="fork")
    finally:
        gc.enable()
    gc.collect()
    assert result.ok, result.failure_reason
    assert record.read_text().split() == [str(os.getpid())]  # freed once, by the parent that made it
