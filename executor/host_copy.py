"""A few integers computed on the device, read by the host only when they are needed.

``tensor.tolist()`` on a CUDA tensor blocks the host until the GPU has finished *everything* queued on the
stream before it. Where the host must still issue work that does not depend on the integers (the EP overlap
issues the other micro-batch's compute, executor/ep_overlap.py), :class:`HostInts` starts the device-to-host
copy now (pinned buffer, ``non_blocking``, an event after it) and blocks only in :meth:`HostInts.get`, and
then only until the copy itself is done, not what was queued after it. On CPU tensors ``get`` reads them
directly (there is nothing to wait for).
"""

from __future__ import annotations

import torch


class HostInts:
    """The values of a 1-D integer tensor, copied to the host asynchronously; :meth:`get` returns them."""

    def __init__(self, values: torch.Tensor):
        self._values: list[int] | None = None
        self._event = None
        if values.is_cuda:
            # pinned memory: the copy is a DMA the stream orders, and the host can read it after the event
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = values

    @property
    def ready(self) -> bool:
        """Whether :meth:`get` has already been called (the host holds the values)."""
        return self._values is not None

    def get(self) -> list[int]:
        """The values as Python ints; the first call waits for the copy (the one host sync), later calls
        return the same list."""
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            self._values = self._host.tolist()
            self._host = self._event = None
        return self._values
