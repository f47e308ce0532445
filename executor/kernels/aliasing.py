"""Parameters whose values are written through another tensor, so that their own version counter misses it.

The distributed optimizer's overlapped parameter all-gather (executor.optimizer, overlap_param_gather) makes
each parameter a ``.data`` view of a flat buffer and writes the buffer: the buffer's version counter moves,
the parameter's does not. A cache keyed on a parameter's ``_version`` (the fp8 weight cache,
executor.kernels.fp8.weight_cache) must therefore skip these. The optimizer registers them here and the cache
asks here, so the kernels never import the optimizer.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

#: owner (the optimizer that writes them) -> ids of its parameters; an entry lives as long as its owner
_WRITTEN_THROUGH_BUFFER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register_written_through_buffer(owner: object, params: Iterable[torch.Tensor]) -> None:
    """Record that ``owner`` writes ``params`` through a buffer they view (replaces what it registered before)."""
    ids = frozenset(id(p) for p in params)
    if ids:
        _WRITTEN_THROUGH_BUFFER[owner] = ids
    else:
        _WRITTEN_THROUGH_BUFFER.pop(owner, None)


def written_through_buffer() -> frozenset[int]:
    """ids of the parameters a live owner writes through a buffer (their ``_version`` does not tell a write)."""
    return frozenset().union(*list(_WRITTEN_THROUGH_BUFFER.values()))
