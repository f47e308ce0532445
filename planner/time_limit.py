"""A wall-clock limit on planning work, set by whoever asks for a plan (the HTTP service: seconds per
request) and checked by the planner's scan between layouts, so a request whose layouts take longer than
its caller allows is stopped with a reason instead of holding a server thread.

The limit lives in a context variable: it holds for the thread (or forked scan worker) that set it and
for nothing else, so concurrent requests each keep their own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from spec.errors import FoldtuneError

_DEADLINE: ContextVar[tuple[float, float] | None] = ContextVar("planning_deadline", default=None)


class PlanningTimeout(FoldtuneError):
    """Planning ran past the time its caller allowed (:func:`time_limit`)."""


@contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Planning inside this block raises :class:`PlanningTimeout` once ``seconds`` (wall clock) have passed;
    None: no limit."""
    token = _DEADLINE.set(None if seconds is None else (time.monotonic() + seconds, seconds))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def check_time() -> None:
    """Raise :class:`PlanningTimeout` when the current :func:`time_limit` has run out; cheap enough to call
    per layout."""
    limit = _DEADLINE.get()
    if limit is not None and time.monotonic() > limit[0]:
        raise PlanningTimeout(f"planning took more than its {limit[1]:g} s limit; ask for fewer GPUs, fewer "
                              "options (offload, precision search, vpp_max) or a smaller model")
