"""The multiprocessing context that starts CPU rank processes, made safe for 'fork'.

A forked rank inherits the parent's whole heap, including objects that were already garbage there (a Ray
client's ``GlobalStateAccessor``, a gRPC channel, a thread pool) but not yet collected. When the rank's
collector later frees such an object its destructor runs in the child: it joins a thread that the child does
not have (the rank hangs for good) or speaks on a socket the parent still owns (the parent's Ray session
breaks). Both were seen in the test suite, where one pytest process holds a Ray driver and forks ranks.
Freezing the inherited heap first thing in the child puts every inherited object out of the collector's
reach; the child's own objects are collected as usual.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import threading

_registered = False
_lock = threading.Lock()


def rank_context(start_method: str) -> multiprocessing.context.BaseContext:
    """``multiprocessing.get_context(start_method)``; for 'fork', every child forked from now on freezes the
    heap it inherited (``gc.freeze``) before running any Python code. Registered once per process."""
    global _registered
    if start_method == "fork":
        with _lock:
            if not _registered:
                os.register_at_fork(after_in_child=gc.freeze)
                _registered = True
    return multiprocessing.get_context(start_method)
