"""Launch one process per rank on this machine (gloo on CPU, NCCL on GPU) and collect what they return.

``launch(fn, world_size, args)`` runs ``fn(rank, world_size, *args)`` in every rank after
``torch.distributed`` is initialised; ``fn`` must be importable (a module-level function). An
out-of-memory error, a rank that raises or dies, or a timeout ends every rank and yields a failed
:class:`LaunchResult` with the reason; no process is left behind.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from executor.failure import is_out_of_memory
from executor.rank_processes import rank_context
from executor.safe_load import RefusedPickle, load_rank_result
from spec.failure import FailureKind

OOM_EXIT = 3
ERROR_EXIT = 1
OOM_PREFIX = "out of memory"  # how a rank's out-of-memory reason starts ('out of memory on rank N: ...')
ERROR_SUFFIX = ".err"  # a failed rank's reason file: rankN.err, or rankN.oom.err when it ran out of memory
OOM_SUFFIX = ".oom" + ERROR_SUFFIX
# NVLink multicast stays off on shared GPU hosts (see the device notes); harmless elsewhere.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class LaunchResult:
    ok: bool
    failure_reason: str | None = None
    results: list[Any] = field(default_factory=list)  # per rank, what fn returned
    wall_s: float = 0.0
    failure_kind: FailureKind | None = None  # set exactly when not ok
    # per rank where it ran, when the launcher knows (the Ray launcher: {'node': Ray node id, 'ip', 'gpus'})
    placement: list[dict[str, Any]] = field(default_factory=list)
    # unix seconds when the ranks began running ``fn`` and when the launcher saw them end (the Ray launcher)
    run_window: list[float] = field(default_factory=list)
    # the ranks were kept from an earlier launch (executor.rank_pool), not started for this one
    reused: bool = False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound, then released: see :func:`launch`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, port: int, backend: str, threads: int, outdir: str,
           fn: Callable, args: tuple, dist_timeout_s: float) -> None:
    os.environ.update(SAFE_ENV)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    code = 0
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=dist_timeout_s),
                                **({"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}))
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    except BaseException as exc:  # noqa: BLE001  (report every failure to the parent, then exit non-zero)
        code = OOM_EXIT if is_out_of_memory(exc) else ERROR_EXIT
        kind = OOM_PREFIX if code == OOM_EXIT else type(exc).__name__
        last = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        # the file name carries the kind, so that the parent never reads it back from the reason text
        name = f"rank{rank}{OOM_SUFFIX if code == OOM_EXIT else ERROR_SUFFIX}"
        with open(os.path.join(outdir, name), "w") as f:
            f.write(f"{kind} on rank {rank}: {last}\n{traceback.format_exc()}")
    finally:
        if code == 0 and dist.is_initialized():
            with contextlib.suppress(RuntimeError):  # the result is saved; a teardown hiccup must not fail it
                # rank 0 hosts the rendezvous store: leaving together keeps the others' NCCL watchdogs from
                # polling a store that is gone (pages of TCPStore warnings, no harm otherwise)
                dist.barrier()
                dist.destroy_process_group()
    os._exit(code)  # skip atexit handlers that could block on a dead peer


def _stop(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)


PORT_ATTEMPTS = 3


def _port_taken(reason: str | None) -> bool:
    """Whether a launch failed because rank 0's rendezvous port was taken between choosing and binding it."""
    return reason is not None and ("EADDRINUSE" in reason or "address already in use" in reason.lower())


def launch(fn: Callable, world_size: int, args: tuple = (), backend: str | None = None, timeout_s: float = 600.0,
           threads_per_rank: int = 1, start_method: str = "spawn") -> LaunchResult:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes; see the module docstring.

    ``backend`` defaults to 'nccl' when CUDA has at least ``world_size`` GPUs, else 'gloo'. ``start_method``
    'fork' starts CPU ranks in milliseconds instead of re-importing torch (not for CUDA parents).
    The rendezvous port is picked free, then released for rank 0 to bind: another process (a launch beside
    this one, NCCL's own sockets) can take it in between. Such a run fails at rendezvous, before ``fn``
    starts, and is launched again on a new port (``PORT_ATTEMPTS`` in all).
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    for _ in range(PORT_ATTEMPTS - 1):
        result = _launch_once(fn, world_size, args, backend, timeout_s, threads_per_rank, start_method)
        if not _port_taken(result.failure_reason):
            return result
    return _launch_once(fn, world_size, args, backend, timeout_s, threads_per_rank, start_method)


def _launch_once(fn: Callable, world_size: int, args: tuple, backend: str, timeout_s: float, threads_per_rank: int,
                 start_method: str) -> LaunchResult:
    ctx = rank_context(start_method)
    outdir = tempfile.mkdtemp(prefix="foldtune-launch-")
    port = free_port()
    start = time.monotonic()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, backend, threads_per_rank, outdir, fn, args,
                                              timeout_s), daemon=True)
             for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        failure = None
        while True:
            codes = [p.exitcode for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                time.sleep(0.2)  # let a rank that raised finish writing its reason
                failure = _reason(outdir, bad)
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() - start > timeout_s:
                failure = (FailureKind.TIMEOUT, f"timeout after {timeout_s:.0f} s ({sum(c is None for c in codes)} "
                                                f"of {world_size} ranks still running)")
                break
            time.sleep(0.02)
        if failure:
            kind, reason = failure
            return LaunchResult(False, reason, wall_s=time.monotonic() - start, failure_kind=kind)
        try:
            results = [load_rank_result(os.path.join(outdir, f"rank{r}.pt")) for r in range(world_size)]
        except RefusedPickle as exc:
            return LaunchResult(False, f"a rank's result was refused: {exc}", wall_s=time.monotonic() - start,
                                failure_kind=FailureKind.ERROR)
        return LaunchResult(True, None, results, time.monotonic() - start)
    finally:
        _stop(procs)
        shutil.rmtree(outdir, ignore_errors=True)


def _reason(outdir: str, bad: list[tuple[int, int]]) -> tuple[FailureKind, str]:
    """The most likely root cause (its kind and reason): a rank that died silently, else an OOM, else the
    earliest error."""
    silent = [(rank, code) for rank, code in bad if code not in (ERROR_EXIT, OOM_EXIT)]
    if silent:
        rank, code = silent[0]
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        return FailureKind.CRASH, f"rank {rank} died ({how}) without a message"
    files = sorted((os.path.join(outdir, name) for name in os.listdir(outdir) if name.endswith(ERROR_SUFFIX)),
                   key=os.path.getmtime)
    reasons, ooms = [], []
    for path in files:
        with open(path) as f:
            reasons.append(f.readline().strip())
        if path.endswith(OOM_SUFFIX):
            ooms.append(reasons[-1])
    kind = FailureKind.OOM if ooms else FailureKind.ERROR
    if ooms:
        reasons = ooms
    if reasons:
        return kind, reasons[0] + (f" (and {len(reasons) - 1} more rank(s) failed)" if len(reasons) > 1 else "")
    rank, code = bad[0]
    return FailureKind.ERROR, f"rank {rank} exited with code {code} without a message"
