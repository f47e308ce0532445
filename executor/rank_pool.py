"""Rank processes kept between trials: the process group is made once, each trial only builds its layout.

A trial launched afresh pays for new processes, ``import torch``, the rendezvous, the CUDA context and the
first use of every kernel before its first timed step. :class:`LocalRankPool` keeps ``world_size`` local
rank processes (gloo on CPU, NCCL on GPU) alive between calls; its :meth:`LocalRankPool.launch` has the
contract of :func:`executor.launch_local.launch` and runs each ``fn(rank, world_size, *args)`` in the same
processes, under the same default process group. The Ray launcher keeps its rank actors the same way
(:class:`executor.launch_ray.RayRankPool`); both share the per-trial hygiene here.

Per trial, in every rank (:func:`begin_trial` / :func:`end_trial`): the global RNG is re-seeded as a fresh
process would have it, CUDA's cached blocks are returned and its peak statistics reset (a trial's peak
memory is its own), the step sink and fault injection (:mod:`executor.progress`) and the fp8 counters and
weight cache start empty, and the process groups the trial created (its TP/CP/EP/... subgroups,
:func:`executor.parallel.groups.build_parallel_state`) are destroyed after it, so that no communicator of one
layout outlives it. Kernel self-check verdicts, Triton's compiled kernels and the CUDA context stay: they do
not depend on the layout, and keeping them warm is the point.

When a pool is kept after a failure (correctness over speed): after a success always; after an error or an
out-of-memory error only when every rank finished the trial (raised or returned) within
``FAILURE_GRACE_S`` of the first failure, and then only when a barrier over the whole pool completes within
``HEALTH_TIMEOUT_S``. A rank that died, a timeout, a rank left waiting in a collective for a peer that
raised, a failed barrier or a cancellation end every rank: the next launch starts new processes.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import pickle
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from executor import progress
from executor.failure import is_out_of_memory
from executor.kernels import fp8
from executor.kernels.fp8 import expert_pick
from executor.launch_local import OOM_PREFIX, PORT_ATTEMPTS, SAFE_ENV, LaunchResult, _port_taken, _stop, free_port
from executor.rank_processes import rank_context
from executor.scoped_env import scoped_env
from spec.failure import FailureKind

REUSE_ENV = "FOLDTUNE_REUSE_RANKS"
FAILURE_GRACE_S = 3.0  # seconds the other ranks get to finish a trial after one rank failed
HEALTH_TIMEOUT_S = 15.0  # seconds a barrier over a pool kept after a failed trial may take
CANCELLED_REASON = "cancelled: the run was stopped before it finished"
# device bytes a kept rank may still hold after a trial (NCCL and cuBLAS workspaces are not allocator bytes);
# more means the trial left something alive, and the rank is replaced rather than reused
LEFTOVER_LIMIT_BYTES = 256 * 2**20


def reuse_enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether trials reuse rank processes (FOLDTUNE_REUSE_RANKS, default on; '0', 'false', 'no', 'off': off)."""
    env = os.environ if environ is None else environ
    return env.get(REUSE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


# ---- per-trial hygiene inside a kept rank ----

def _group_ids() -> set[int]:
    """The ids of the process groups this process holds (the default one included)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    return {id(pg) for pg in getattr(world, "pg_map", {})} if dist.is_initialized() else set()


def begin_trial(initial_seed: int) -> set[int]:
    """Reset what one trial must not inherit from the previous one; returns the process groups held before it
    (:func:`end_trial` destroys the ones the trial adds)."""
    progress.reset()
    fp8.reset_gemm_counts()
    expert_pick.reset_counts()
    fp8.reset_weight_counts()
    fp8.clear_weight_cache()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # the previous trial's cached blocks would count as this one's reserved memory
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(initial_seed)  # seeds CUDA's generators too: the RNG state of a fresh process
    return _group_ids()


def end_trial(groups_before: set[int]) -> None:
    """Destroy the process groups the trial created and free what it left cached."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if dist.is_initialized() and world is not None:
        default = dist.distributed_c10d._get_default_group()
        for pg in [pg for pg in list(world.pg_map) if id(pg) not in groups_before and pg is not default]:
            with contextlib.suppress(Exception):  # a group whose peer failed may refuse a clean teardown
                dist.destroy_process_group(pg)
    progress.reset()
    fp8.clear_weight_cache()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def run_trial(fn: Callable, rank: int, world_size: int, args: tuple, env: dict[str, str],
              initial_seed: int, sink: progress.StepSink | None = None) -> tuple:
    """Run one trial's ``fn`` in a kept rank: ('ok', result) or ('oom' | 'error', one-line reason, traceback).

    ``env`` is set for the trial only (e.g. FOLDTUNE_FAULT) and restored after it; ``sink`` is the trial's
    step sink (:func:`executor.progress.install`), removed after it.
    """
    with scoped_env(env):
        groups = begin_trial(initial_seed)
        progress.install(sink)
        try:
            return "ok", fn(rank, world_size, *args)
        except BaseException as exc:  # noqa: BLE001  (every failure goes back to the driver as a reason)
            oom = is_out_of_memory(exc)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            kind = OOM_PREFIX if oom else type(exc).__name__
            return ("oom" if oom else "error"), f"{kind} on rank {rank}: {first}", traceback.format_exc()
        finally:
            end_trial(groups)


def leftover_bytes() -> int:
    """Device bytes still allocated in this rank after a trial's clean-up (0 without CUDA)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.memory_allocated()
    return 0


def health_check() -> bool:
    """A barrier over the whole pool (run in every rank after a failed trial): True when it completed."""
    dist.barrier()
    return True


def failure_of(outcomes: dict[int, tuple], world_size: int) -> tuple[FailureKind, str]:
    """(kind, reason) of a failed trial from the ranks' outcomes: an OOM first (it makes the peers fail),
    then the earliest rank's error; '(and N more rank(s) failed)' as the local launcher writes it."""
    bad = sorted((r, o) for r, o in outcomes.items() if o[0] != "ok")
    ooms = [o[1] for _, o in bad if o[0] == "oom"]
    reasons = ooms or [o[1] for _, o in bad]
    more = f" (and {len(bad) - 1} more rank(s) failed)" if len(bad) > 1 else ""
    return (FailureKind.OOM if ooms else FailureKind.ERROR), reasons[0] + more


# ---- the local pool ----

def _worker(rank: int, world_size: int, port: int, backend: str, threads: int, dist_timeout_s: float,
            tasks: Any, results: Any) -> None:
    """One kept rank: join the process group once, then run each task until told to leave (None)."""
    os.environ.update(SAFE_ENV)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    initial_seed = torch.initial_seed()  # what a fresh process starts from; every trial starts from it again
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=dist_timeout_s),
                                **({"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}))
    except BaseException as exc:  # noqa: BLE001
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        results.put((rank, -1, ("error", f"{type(exc).__name__} on rank {rank}: {first}", "")))
        results.close()
        results.join_thread()  # the queue's feeder thread must hand the reason over before the process ends
        os._exit(1)
    results.put((rank, -1, ("ready", os.getpid())))
    while True:
        task = tasks.get()
        if task is None:
            break
        number, fn, args, env = task
        if fn is health_check:
            try:
                outcome = ("ok", health_check())
            except BaseException as exc:  # noqa: BLE001
                outcome = ("error", f"{type(exc).__name__} on rank {rank}: {exc}", "")
        else:
            outcome = run_trial(fn, rank, world_size, args, env, initial_seed)
        try:  # the queue pickles in a background thread, where a failure would be lost: try it here first
            pickle.dumps(outcome)
        except Exception as exc:  # noqa: BLE001  (a result that does not pickle is this rank's error)
            outcome = ("error", f"{type(exc).__name__} on rank {rank}: result does not pickle: {exc}", "")
        results.put((rank, number, outcome))
        if leftover_bytes() > LEFTOVER_LIMIT_BYTES:
            # something of the trial is still alive on the device: a later trial would measure (and may run
            # out of) less memory than a fresh process has; leave, and the next launch starts new ranks
            results.close()
            results.join_thread()
            os._exit(0)
    with contextlib.suppress(Exception):
        dist.barrier()  # leave together: rank 0 hosts the store the others' watchdogs poll
        dist.destroy_process_group()
    os._exit(0)


class LocalRankPool:
    """``world_size`` local rank processes kept between launches; see the module docstring.

    ``launch`` starts them on first use and again whenever the world size or backend changes or the previous
    trial left them unusable. ``close`` (or leaving a ``with`` block) ends them. ``start_method`` as for
    :func:`executor.launch_local.launch` ('fork' only for CPU parents); ``threads_per_rank`` torch threads.
    One launch at a time (a lock serialises them).
    """

    def __init__(self, start_method: str = "spawn", threads_per_rank: int = 1) -> None:
        self.start_method, self.threads_per_rank = start_method, threads_per_rank
        self._procs: list = []
        self._tasks: list = []
        self._results: Any = None
        self._key: tuple | None = None
        self._number = 0
        self._lock = threading.Lock()
        self.starts = 0  # how many times rank processes were started (tests, reports)

    @property
    def pids(self) -> list[int]:
        """The live rank processes' pids, rank order (empty when none run)."""
        return [p.pid for p in self._procs]

    def __enter__(self) -> LocalRankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, polite: bool = True) -> None:
        """End every rank process: asked to leave together (``polite``, up to 5 s), then by force (a rank
        in a hung or abandoned trial never reads its queue again)."""
        started = [p for p in self._procs if p.pid is not None]  # a start that failed midway leaves some unstarted
        if polite:
            for q in self._tasks:
                with contextlib.suppress(Exception):
                    q.put(None)
            deadline = time.monotonic() + 5
            for p in started:
                p.join(max(0.0, deadline - time.monotonic()))
        _stop(started)
        for q in self._tasks + ([self._results] if self._results is not None else []):
            with contextlib.suppress(Exception):
                q.close()
                q.cancel_join_thread()
        self._procs, self._tasks, self._results, self._key = [], [], None, None

    def _start(self, world_size: int, backend: str, timeout_s: float) -> tuple[FailureKind, str] | None:
        """Start the ranks and wait until each joined the process group; (kind, reason) when they did not."""
        ctx = rank_context(self.start_method)
        for attempt in range(PORT_ATTEMPTS):
            self._results = ctx.Queue()
            self._tasks = [ctx.Queue() for _ in range(world_size)]
            port = free_port()
            self._procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, self.threads_per_rank,
                                                              timeout_s, self._tasks[r], self._results), daemon=True)
                           for r in range(world_size)]
            self.starts += 1
            try:
                for p in self._procs:
                    p.start()
            except BaseException:
                self.close()
                raise
            failure = self._collect(-1, world_size, timeout_s, None)[0]
            if failure is None:
                self._key = (world_size, backend)
                return None
            self.close(polite=False)
            if not (_port_taken(failure[1]) and attempt < PORT_ATTEMPTS - 1):
                return failure
        return None  # not reached

    def _collect(self, number: int, world_size: int, timeout_s: float, cancel: threading.Event | None,
                 ) -> tuple[tuple[FailureKind, str] | None, dict[int, tuple], bool]:
        """Wait for every rank's outcome of task ``number``: (failure or None, outcomes, whether every rank
        finished). Dead ranks and the timeout end the wait; after a rank fails the others get FAILURE_GRACE_S."""
        outcomes: dict[int, tuple] = {}
        start = time.monotonic()
        first_failure_at = None
        while len(outcomes) < world_size:
            if cancel is not None and cancel.is_set():
                return (FailureKind.CANCELLED, CANCELLED_REASON), outcomes, False
            try:
                rank, got, outcome = self._results.get(timeout=0.05)
                if got == number:
                    outcomes[rank] = outcome
                    if outcome[0] not in ("ok", "ready") and first_failure_at is None:
                        first_failure_at = time.monotonic()
                continue
            except queue.Empty:
                pass
            dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if p.exitcode is not None and r not in outcomes]
            if dead:
                time.sleep(0.2)  # a rank that failed to start wrote its reason before exiting
                with contextlib.suppress(queue.Empty):
                    while True:
                        rank, got, outcome = self._results.get_nowait()
                        if got == number:
                            outcomes[rank] = outcome
                if number < 0 and any(o[0] == "error" for o in outcomes.values()):
                    return failure_of(outcomes, world_size), outcomes, False  # it failed to start, and said why
                # a rank that died silently is the root cause of its peers' 'connection closed' errors
                rank, code = dead[0]
                how = f"signal {-code}" if code < 0 else f"exit code {code}"
                return (FailureKind.CRASH, f"rank {rank} died ({how}) without a message"), outcomes, False
            now = time.monotonic()
            if first_failure_at is not None and now - first_failure_at > FAILURE_GRACE_S:
                return failure_of(outcomes, world_size), outcomes, False
            if now - start > timeout_s:
                return (FailureKind.TIMEOUT, f"timeout after {timeout_s:.0f} s ({world_size - len(outcomes)} of "
                                             f"{world_size} ranks still running)"), outcomes, False
        bad = any(o[0] not in ("ok", "ready") for o in outcomes.values())
        return (failure_of(outcomes, world_size) if bad else None), outcomes, True

    def _send(self, fn: Callable, args: tuple, env: dict[str, str]) -> int:
        self._number += 1
        for q in self._tasks:
            q.put((self._number, fn, args, env))
        return self._number

    def launch(self, fn: Callable, world_size: int, args: tuple = (), backend: str | None = None,
               timeout_s: float = 600.0, threads_per_rank: int | None = None, *, env: dict[str, str] | None = None,
               cancel: threading.Event | None = None, **_ignored: Any) -> LaunchResult:
        """Run ``fn(rank, world_size, *args)`` on the kept ranks (see the module docstring); the result's
        ``reused`` says whether the ranks were already running before this call."""
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
        if threads_per_rank is not None and threads_per_rank != self.threads_per_rank:
            self.close()
            self.threads_per_rank = threads_per_rank
        with self._lock:
            start = time.monotonic()
            reused = self._key == (world_size, backend) and all(p.is_alive() for p in self._procs)
            if not reused:
                self.close()
                failure = self._start(world_size, backend, timeout_s)
                if failure is not None:
                    return LaunchResult(False, failure[1], wall_s=time.monotonic() - start, failure_kind=failure[0])
            number = self._send(fn, args, dict(env or {}))
            failure, outcomes, all_done = self._collect(number, world_size, timeout_s, cancel)
            wall = time.monotonic() - start
            if failure is None:
                return LaunchResult(True, None, [outcomes[r][1] for r in range(world_size)], wall, reused=reused)
            if not (all_done and failure[0] in (FailureKind.OOM, FailureKind.ERROR) and self._healthy()):
                self.close(polite=False)
            return LaunchResult(False, failure[1], wall_s=wall, failure_kind=failure[0], reused=reused)

    def _healthy(self) -> bool:
        """Whether a barrier over every rank completes in HEALTH_TIMEOUT_S (after a trial that failed)."""
        number = self._send(health_check, (), {})
        failure, _, all_done = self._collect(number, len(self._procs), HEALTH_TIMEOUT_S, None)
        return failure is None and all_done
