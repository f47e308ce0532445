"""executor/host_copy.py: the values a dispatch reads back to the host, read once and kept."""

from __future__ import annotations

import torch

from executor.host_copy import HostInts


def test_values_are_read_once_and_kept(monkeypatch):
    source = torch.tensor([3, 0, 7], dtype=torch.int64)
    values = HostInts(source)
    assert not values.ready
    reads = []
    plain = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or plain(self))
    assert values.get() == [3, 0, 7] and values.ready
    source[0] = 9  # read already: later changes of the device tensor do not leak in
    assert values.get() == [3, 0, 7]
    assert len(reads) == 1
