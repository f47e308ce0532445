"""Bounded shutdown of the long-running commands (``foldtune serve``, ``foldtune runner``): after SIGTERM a
process gets a fixed number of seconds to finish cleanly, then exits whatever its threads are doing.

Python waits at exit for every non-daemon thread; a request handler blocked on a database lock, or a
runner teardown waiting on a dead Ray node, would otherwise keep the process alive until its orchestrator
kills it with SIGKILL, after which nothing is logged.
"""

from __future__ import annotations

import os
import sys
import threading


def busy_threads() -> list[threading.Thread]:
    """Live non-daemon threads other than the main one: what Python's exit would wait for."""
    return [t for t in threading.enumerate()
            if t is not threading.main_thread() and not t.daemon and t.is_alive()]


def exit_leaving_busy_threads(who: str, code: int = 0) -> None:
    """Exit now with ``code`` when threads are still busy (their work is abandoned: an open database
    transaction is rolled back by the server when the connection drops); return when none is."""
    busy = busy_threads()
    if busy:
        print(f"{who}: {len(busy)} thread(s) still busy after the shutdown timeout; exiting without them",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(code)


def exit_timer(seconds: float, who: str, code: int) -> threading.Timer:
    """A started daemon timer that exits the process with ``code`` after ``seconds`` unless the process
    has exited before: the upper bound of a graceful shutdown."""

    def expire() -> None:
        print(f"{who}: not shut down after {seconds:g} s; exiting", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(code)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer
