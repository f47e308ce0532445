"""Per-step hook of a profiled run: stream step times to whoever launched it, stop every rank together,
and inject faults for tests.

A launcher that can stream (the Ray launcher) installs a *sink* in rank 0's process with
:func:`install`; the sink receives ``(step, seconds)`` after every timed step and returns True when the
driver wants the run stopped (the search pruned it, or the job was cancelled). Without a sink nothing
is streamed and the run never stops early (the local launcher reports after the run).

The profile loop calls :func:`step_done` on every rank after every timed step. Rank 0 reports the
slowest rank's step time (what the Measurement takes as the step time) and decides; its decision is
broadcast so that all ranks leave the loop after the same step and no collective is left half-entered.

Fault injection (tests, and reproducing failures on a cluster): ``FOLDTUNE_FAULT`` in a rank's
environment, a comma-separated list of ``KIND:rank=R:step=S`` with KIND one of

- ``kill``  — the rank SIGKILLs itself after timed step S (a crashed node or OOM-killer);
- ``hang``  — the rank sleeps forever after timed step S (a deadlock; the launcher's timeout ends it);
- ``oom``   — the rank allocates more memory than it may have after timed step S: a genuine allocation
  failure of the allocator (the launcher's per-rank address-space limit, or beyond RAM + swap).
"""

from __future__ import annotations

import os
import resource
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spec.errors import SpecError

StepSink = Callable[[int, float], bool]
FAULT_ENV = "FOLDTUNE_FAULT"
FAULT_KINDS = ("kill", "hang", "oom")

_sink: StepSink | None = None
_last_step_done = -1  # the last timed step this process finished (before its collectives), for hang reports


def install(sink: StepSink | None) -> StepSink | None:
    """Make ``sink(step, seconds) -> stop?`` this process's step sink (None removes it); returns the previous."""
    global _sink
    previous, _sink = _sink, sink
    return previous


def last_step_done() -> int:
    """The last timed step (0-based) this process finished, -1 before the first; a hung rank lags behind."""
    return _last_step_done


def reset() -> None:
    """Forget the previous run (no sink, no step done): a rank process kept between trials starts each afresh."""
    global _sink, _last_step_done
    _sink, _last_step_done = None, -1


def report_step(step: int, seconds: float) -> bool:
    """Hand timed step ``step`` (0-based) that took ``seconds`` to the sink; True when the driver asked to stop."""
    return bool(_sink(step, seconds)) if _sink is not None else False


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``kind`` on ``rank`` after timed step ``step`` (0-based)."""

    kind: str
    rank: int
    step: int


def parse_faults(text: str | None) -> list[Fault]:
    """Parse a ``FOLDTUNE_FAULT`` value (``kill:rank=1:step=2,hang:rank=0:step=0``); SpecError names a bad part."""
    faults = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        kind, *pairs = part.split(":")
        try:
            fields = dict(p.split("=", 1) for p in pairs)
            fault = Fault(kind.strip(), int(fields.pop("rank", 0)), int(fields.pop("step", 0)))
        except ValueError:
            raise SpecError(f"{FAULT_ENV} part {part!r} is not KIND:rank=R:step=S") from None
        if fault.kind not in FAULT_KINDS or fields:
            raise SpecError(f"{FAULT_ENV} part {part!r}: kind must be one of {FAULT_KINDS} and the only keys "
                            f"rank and step")
        faults.append(fault)
    return faults


def _inject(rank: int, step: int) -> None:
    for fault in parse_faults(os.environ.get(FAULT_ENV)):
        if fault.rank != rank or fault.step != step:
            continue
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "hang":
            while True:
                time.sleep(3600)
        elif fault.kind == "oom":
            # More than any rank may have: the address-space limit when the launcher set one, else a
            # petabyte (beyond RAM + swap of any machine, so even an overcommitting kernel refuses it).
            soft, _ = resource.getrlimit(resource.RLIMIT_AS)
            nbytes = soft + (1 << 30) if soft != resource.RLIM_INFINITY else 1 << 50
            torch.empty(nbytes, dtype=torch.uint8)


def step_done(step: int, seconds: float) -> bool:
    """Call on every rank after timed step ``step`` took ``seconds``; True means leave the loop now.

    Collective when torch.distributed is initialised with more than one rank (every rank must call it
    after the same steps): the slowest rank's time is reported by rank 0, whose answer all ranks get.
    """
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if distributed else 0
    _inject(rank, step)
    global _last_step_done
    _last_step_done = step
    if not distributed:
        return report_step(step, seconds)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    stop = torch.tensor([1 if rank == 0 and report_step(step, float(slowest.item())) else 0],
                        dtype=torch.int32, device=device)
    dist.broadcast(stop, src=0)
    return bool(stop.item())
