"""Why a measured run failed, as one machine word: the codec between launchers, search and storage.

The launchers set a :class:`FailureKind` on every failed run; the search reads it (an out-of-memory run
teaches the memory model) and the service stores its value beside the readable reason. Nothing parses
the reason text to recover the kind.
"""

from __future__ import annotations

from enum import Enum


class FailureKind(str, Enum):
    """The short word stored with a failed trial; the values are what the database and the API show."""

    OOM = "oom"              # a rank ran out of device (or, on CPU ranks, address-space) memory
    CRASH = "crash"          # a rank's process died without reporting an error (killed, segfault)
    TIMEOUT = "timeout"      # the run, its placement or its start-up did not finish in time
    CANCELLED = "cancelled"  # the job was stopped before or during the run
    LOST = "lost"            # the runner measuring it went away; the search measures the layout again
    NODE_LOST = "node_lost"  # a Ray node holding some of its ranks went away mid-run (reason 'node lost: ...')
    ERROR = "error"          # a rank raised, or the layout could not be run here (the reason says why)
    INVALID = "invalid"      # the search was handed parameters that are no candidate layout
