"""Timing of a device operation: warm-up, then the median of several timed repeats (:func:`time_op`: wall
clock over a loop of calls; :func:`time_device`: one call at a time, CUDA events on a GPU;
:func:`time_host_ahead`: the device time of a window of calls queued while the GPU is held busy, so that the
host's issue time is not in it; :func:`time_steady`: calls back to back behind earlier ones, as inside a
training step; :func:`time_paired_steady`: two calls in alternated steady windows, so that both see the same
clock; :func:`time_host_issue`: the host's seconds to issue one call)."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist

# how a time was measured, as stored with component measurements (executor/microbench/components.py)
WALL_CLOCK = "wall clock"  # CPU: ops are synchronous, host time is device time
EVENTS_ONE_CALL = "CUDA events, one call"  # time_device: includes host issue time where that exceeds device time
HOST_AHEAD = "device time, host ahead"  # time_host_ahead: host queued the window before the GPU started on it
HOST_BEHIND = "device span, host not ahead"  # time_host_ahead gave up: an upper bound, GPU idle time in it
STEADY = "steady state, back to back"  # time_steady: calls behind earlier ones, as in a step (its syncs included)

# time_host_ahead: the GPU sleep before a window covers SLEEP_MARGIN x the host's issue time of the window plus
# SLEEP_FLOOR_S (the sleep rate is measured at another moment, and GPU clocks vary)
SLEEP_MARGIN = 2.0
SLEEP_FLOOR_S = 5e-4
_SLEEP_CYCLES_PER_S: dict[int, float] = {}


# How ranks of a process group coordinate their timings: None (each on its own), LOCKSTEP (every timed repeat of
# every rank starts together and runs as many calls) or IN_TURNS (one rank times at a time, the others wait).
LOCKSTEP = "lockstep"
IN_TURNS = "in turns"
_MODE: list[str | None] = [None]


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@contextlib.contextmanager
def _mode(mode: str | None) -> Iterator[None]:
    before = _MODE[0]
    _MODE[0] = mode if mode and _grouped() else None
    try:
        yield
    finally:
        _MODE[0] = before


def lockstep(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Time in lockstep with the other ranks of the default process group: what a collective needs.

    In lockstep each repeat of :func:`time_op` and :func:`time_device` waits for every rank and all ranks run the
    same number of calls, so the ranks of a collective call it together. Every rank must then time the same
    operations in the same order.
    """
    return _mode(LOCKSTEP if enabled else None)


def in_turns(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Time one rank at a time: each :func:`time_op` / :func:`time_device` (and :func:`one_rank_at_a_time`) runs
    on rank 0 while the others wait at a barrier, then on rank 1, and so on.

    Why: CPU ranks share the machine's cores, and how many compute at once depends on the layout (four ranks of a
    dp4 step on two cores get half a core each; a pp2 step with one micro-batch keeps two busy). A rate timed
    while the other ranks also compute is some mix of the two that changes with the scheduler's moment
    (docs/benchmarks.md, "CPU ranks' contention priced per layout"); timed alone it is one number, and the cost
    model prices the contention of each layout from it
    (``HardwareProfile.cpu_cores``, ``costmodel.step_time.cpu_contention``). A rank waiting in a gloo barrier
    sleeps, so the timed rank has the cores to itself. Every rank must time the same operations in the same
    order; collectives cannot be timed in turns (time them inside :func:`lockstep`).
    """
    return _mode(IN_TURNS if enabled else None)


def one_rank_at_a_time(body: Callable[[], object]):
    """``body()`` on every rank, inside :func:`in_turns` one rank after the other (the others wait at a barrier),
    else directly; returns this rank's result. ``body`` runs with no coordination (it must not call a collective)."""
    if _MODE[0] != IN_TURNS:
        return body()
    result = None
    with _mode(None):
        for turn in range(dist.get_world_size()):
            dist.barrier()
            if turn == dist.get_rank():
                result = body()
        dist.barrier()
    return result


def _agreed_count(count: int) -> int:
    """``count`` as every rank in lockstep uses it: the largest any rank asks for."""
    if _MODE[0] != LOCKSTEP:
        return count
    t = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def start_together(device: torch.device) -> None:
    """Inside :func:`lockstep`: wait for the device and for every rank, so that what follows starts on all ranks
    together (outside it: nothing)."""
    if _MODE[0] == LOCKSTEP:
        synchronize(device)
        dist.barrier()


class BlockTime(NamedTuple):
    """Mean seconds of one call, and how they were measured (one of the method strings of this module,
    HOST_AHEAD possibly followed by the calls per window where fewer than asked)."""

    seconds: float
    method: str


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(op: Callable[[], object], device: torch.device, iters: int | None = None, repeats: int = 3,
            warmup: int = 2, target_s: float = 0.01) -> float:
    """Median over ``repeats`` of the mean seconds of one ``op()`` call in a loop of ``iters`` calls.

    ``iters`` None sizes the loop to about ``target_s`` seconds from the last warm-up call (only for
    single-rank work: ranks of a collective must agree on the count, so they pass it). Inside :func:`in_turns`
    the ranks take turns (:func:`one_rank_at_a_time`).
    """
    if _MODE[0] == IN_TURNS:
        return one_rank_at_a_time(lambda: time_op(op, device, iters, repeats, warmup, target_s))
    for _ in range(max(1, warmup)):
        synchronize(device)
        start = time.perf_counter()
        op()
        synchronize(device)
        last = time.perf_counter() - start
    if iters is None:
        iters = max(1, min(1000, int(target_s / max(last, 1e-7))))
    iters = _agreed_count(iters)
    samples = []
    for _ in range(repeats):
        start_together(device)
        start = time.perf_counter()
        for _ in range(iters):
            op()
        synchronize(device)
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def time_device(op: Callable[[], object], device: torch.device, warmup: int = 2,
                repeats: int = 5) -> float:
    """Median seconds of ``op()`` over ``repeats`` runs after ``warmup``: CUDA events on a GPU, wall clock
    (``op`` is synchronous there) on the CPU. Inside :func:`in_turns` the ranks take turns."""
    if _MODE[0] == IN_TURNS:
        return one_rank_at_a_time(lambda: time_device(op, device, warmup, repeats))
    for _ in range(warmup):
        op()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            op()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            start_together(device)
            t0 = time.perf_counter()
            op()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def time_steady_window(op: Callable[[], object], device: torch.device, iters: int, lead: int) -> float:
    """Seconds per call of ``iters`` calls back to back after ``lead`` unsynchronised ones (one window of
    :func:`time_steady`): CUDA events on a GPU, wall clock on the CPU."""
    for _ in range(lead):
        op()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            op()
        return (time.perf_counter() - start) / iters
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_event.record()
    for _ in range(iters):
        op()
    end_event.record()
    end_event.synchronize()
    return start_event.elapsed_time(end_event) / 1e3 / iters


def time_steady(op: Callable[[], object], device: torch.device, iters: int = 20, lead: int = 3,
                trials: int = 3) -> float:
    """Seconds per call in steady state: the median over ``trials`` windows of :func:`time_steady_window`,
    after one synchronised warm-up call.

    Why: in a training step the host runs ahead of the GPU, so a layer's launch latency (small kernels issued
    before its first big GEMM) hides behind the previous layer's kernels; :func:`time_device` starts every
    call from an idle device and exposes it. Here ``lead`` unsynchronised calls go first, so the GPU is busy
    when the window starts. Where issuing a call takes the host longer than the device needs to run it, the
    GPU drains and the figure is the host's rate (compare :func:`time_host_issue`)."""
    op()
    synchronize(device)
    return statistics.median(time_steady_window(op, device, iters, lead) for _ in range(trials))


class PairedTimes(NamedTuple):
    """Two calls timed in alternated steady windows: medians of seconds per call of ``a`` and ``b``, and the
    median over rounds of b / a with each round's ratio."""

    a_s: float
    b_s: float
    ratio: float
    ratio_by_round: list[float]


def time_paired_steady(op_a: Callable[[], object], op_b: Callable[[], object], device: torch.device,
                       rounds: int = 6, iters: int = 20, lead: int = 3) -> PairedTimes:
    """``op_a`` and ``op_b`` in alternating steady windows (:func:`time_steady_window`), ``rounds`` times, the
    order flipped every round.

    Why: two steady timings taken one after the other differ by the card's clock as well as by the code (under
    seconds of tensor-core load a GPU lowers its SM clock at its power limit, and the clock wanders while it
    does). Windows taken in turn see the same drift, so each round's ratio compares the two at one clock."""
    op_a()
    op_b()
    synchronize(device)
    a: list[float] = []
    b: list[float] = []
    for r in range(rounds):
        order = ((op_a, a), (op_b, b)) if r % 2 == 0 else ((op_b, b), (op_a, a))
        for op, samples in order:
            samples.append(time_steady_window(op, device, iters, lead))
    ratios = [y / x for x, y in zip(a, b)]
    return PairedTimes(statistics.median(a), statistics.median(b), statistics.median(ratios), ratios)


def time_host_issue(op: Callable[[], object], device: torch.device, iters: int = 10) -> float:
    """Host seconds to issue one ``op()`` (``iters`` calls, no synchronisation between them)."""
    op()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        op()
    host = (time.perf_counter() - start) / iters
    synchronize(device)
    return host


def time_host_issue_idle(op: Callable[[], object], device: torch.device, repeats: int = 7) -> float:
    """Median host seconds of one ``op()`` issued on an idle device (synchronised before each call, not inside):
    unlike :func:`time_host_issue`, a call never waits behind the previous one's queued work, so an op with a
    host sync inside (the dispatcher's split sizes) reads its own host time only."""
    samples = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        op()
        samples.append(time.perf_counter() - start)
    synchronize(device)
    return statistics.median(samples)


def sleep_cycles_per_second(device: torch.device) -> float:
    """Clock cycles per second of ``torch.cuda._sleep`` on the CUDA ``device`` (median of 3 CUDA-event timed
    sleeps of 2^22 cycles, about 2 ms; measured once per device and cached)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SLEEP_CYCLES_PER_S:
        cycles = 1 << 22
        with torch.cuda.device(index):
            torch.cuda._sleep(cycles)  # the first launch loads the kernel
            rates = []
            for _ in range(3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(cycles)
                end.record()
                end.synchronize()
                rates.append(cycles / (start.elapsed_time(end) / 1e3))
        _SLEEP_CYCLES_PER_S[index] = statistics.median(rates)
    return _SLEEP_CYCLES_PER_S[index]


def time_host_ahead(op: Callable[[], object], device: torch.device, calls: int = 8, windows: int = 3,
                    warmup: int = 2) -> BlockTime:
    """Mean device seconds of one ``op()`` in windows of ``calls`` calls issued back to back, with the host
    ahead of the GPU as in a training step: the median over ``windows`` windows.

    Why: a block of many small kernels (MLA attention) takes the host longer to issue than the GPU to run.
    Wall clock around a window then measures the host, whereas in a step the host runs ahead (it queues the
    next block while the GPU works through big MoE and head kernels) and only device time adds up; the time
    model prices the host separately (costmodel/host.py, max(device, host) per micro-batch).

    Method on CUDA: the host's issue time of one window is measured first (wall clock, no sync). Each window
    is then queued behind ``torch.cuda._sleep`` long enough to cover SLEEP_MARGIN x that time + SLEEP_FLOOR_S
    (cycles from :func:`sleep_cycles_per_second`), between a CUDA event recorded after the sleep and one after
    the last call. If the start event has not completed when the host has issued the last call (``query()``),
    every kernel of the window was queued before the GPU reached it, so the event span holds device time only
    (the GPU may still idle inside ``op`` where ``op`` itself synchronises: that is in a step as well). If the
    event had completed, the window is discarded and retried with a sleep sized from that window's host time;
    after two such misses at one window size the window is halved (CUDA's launch queue holds about a thousand
    pending kernels, beyond which the host blocks until the GPU drains it, and a longer sleep cannot help:
    MLA attention's fwd+bwd is over a hundred kernels). After two misses with windows of one call, the
    smallest per-call event span of the missed windows is reported as HOST_BEHIND: each span holds the
    device time and the GPU's idle time waiting for the host, so it is an upper bound of the device time.
    At most 2 (log2(calls) + 1) windows miss; the next sleep is sized from the missed window's host time,
    which outlasted its sleep, so sleeps about double per miss.

    On the CPU (ops are synchronous) this is :func:`time_op` with ``iters=calls``, ``repeats=windows``,
    reported as WALL_CLOCK.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return BlockTime(time_op(op, device, iters=calls, repeats=windows, warmup=warmup), WALL_CLOCK)
    with torch.cuda.device(device):
        rate = sleep_cycles_per_second(device)
        for _ in range(max(1, warmup)):
            op()
        torch.cuda.synchronize()
        begin = time.perf_counter()
        for _ in range(calls):
            op()
        issue_per_call = (time.perf_counter() - begin) / calls  # host seconds per call, GPU idle at the start
        torch.cuda.synchronize()
        ahead: list[float] = []
        behind: list[float] = []
        n, misses_at_n = calls, 0
        while len(ahead) < windows:
            if misses_at_n >= 2:
                if n == 1:
                    break
                n, misses_at_n = max(1, n // 2), 0
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(int(rate * (SLEEP_MARGIN * issue_per_call * n + SLEEP_FLOOR_S)))
            start.record()
            begin = time.perf_counter()
            for _ in range(n):
                op()
            host = time.perf_counter() - begin
            queued_first = not start.query()  # the GPU was still asleep when the last call was issued
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3 / n
            if queued_first:
                ahead.append(seconds)
                continue
            behind.append(seconds)
            issue_per_call = max(issue_per_call, host / n)
            misses_at_n += 1
    if ahead:
        return BlockTime(statistics.median(ahead), HOST_AHEAD + (f" ({n} calls per window)" if n < calls else ""))
    return BlockTime(min(behind), HOST_BEHIND)
