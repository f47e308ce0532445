"""How much planning the HTTP service does at once and for how long: the cost-model planner runs inside
the request (POST /v1/plans, and the runnable check of POST /v1/jobs), so each request's planning holds
one of a fixed number of slots and stops at a time limit. A request that finds every slot busy, or whose
planning runs past the limit, is answered 503 with the reason and a ``Retry-After``, never left to hang.

With the size bounds of :mod:`spec.limits` one planning run holds at most about 0.5 GB, so the slots
bound the planner's memory as well as its CPU.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from api.service.errors import Unavailable
from planner.time_limit import PlanningTimeout, time_limit

# a request waits this long (at most its planning time limit) for a free slot before it is told to come back:
# long enough for a burst of small plans to queue through, short enough that a waiting request holds its
# server thread for a bounded time
SLOT_WAIT_S = 10.0


class PlanningGate:
    """At most ``slots`` planning runs at once, each stopped after ``seconds`` of wall clock; a request waits
    for a slot up to :data:`SLOT_WAIT_S` or ``seconds``, whichever is shorter."""

    def __init__(self, slots: int, seconds: float) -> None:
        self.slots, self.seconds = slots, seconds
        self._free = threading.BoundedSemaphore(slots)

    @contextmanager
    def __call__(self) -> Iterator[None]:
        """Hold a slot and the time limit for the planning inside the block; :class:`Unavailable` when no
        slot comes free in time or the planning runs past the limit."""
        if not self._free.acquire(timeout=min(SLOT_WAIT_S, self.seconds)):
            raise Unavailable("planner-busy", "Planner busy",
                              f"all {self.slots} planning slots are busy (FOLDTUNE_PLAN_CONCURRENCY); retry shortly",
                              retry_after=max(1, math.ceil(self.seconds / 2)))
        try:
            with time_limit(self.seconds):
                yield
        except PlanningTimeout as exc:
            raise Unavailable("planning-timeout", "Planning took too long",
                              f"{exc} (FOLDTUNE_PLAN_SECONDS)", retry_after=max(1, math.ceil(self.seconds))) from None
        finally:
            self._free.release()


@contextmanager
def no_gate() -> Iterator[None]:
    """The gate of a caller that plans without limits (the local CLI)."""
    yield
