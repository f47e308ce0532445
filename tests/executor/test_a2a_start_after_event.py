"""executor/parallel/collectives.all_to_all_start with ``after``: the exchange is issued from a side stream that
waits for the given event only (the EP overlap's deferred dispatch), with its output allocated on the caller's
stream, with its output allocated on the side stream and recorded on the caller's (a buffer allocated on the
caller's stream could still be read by kernels queued there after the event: a race measured on 2 x H200).
CUDA streams are replaced by recording fakes so that the order of calls is checked on CPU."""

from __future__ import annotations

import contextlib

import torch

from executor.parallel import collectives
from executor.parallel.groups import Group


def test_deferred_exchange_waits_for_its_event_on_a_side_stream(monkeypatch):
    log: list = []

    class Side:
        def wait_event(self, event):
            log.append(("side waits", event))

    @contextlib.contextmanager
    def stream(s):
        log.append(("enter", s))
        yield
        log.append(("exit", s))

    def exchange(out, x, out_splits, in_splits, group=None, async_op=False):
        log.append(("all_to_all", out_splits, in_splits, async_op))
        return "work"

    side = Side()
    real_empty = torch.empty

    def empty(*args, **kwargs):
        log.append(("allocate",))
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(collectives, "_side_stream", lambda device: side)
    class Current:
        def record_event(self):
            log.append(("current records",))
            return "after the copy"

    current = Current()
    monkeypatch.setattr(collectives, "_current_stream", lambda device: current)
    monkeypatch.setattr(collectives, "_record_stream", lambda t, s: log.append(("record", s)))
    monkeypatch.setattr(collectives.torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(collectives.dist, "all_to_all_single", exchange)
    group = Group("ep", (0, 1), 0, pg=object())
    x = torch.ones(5, 3)
    out, work = collectives.all_to_all_start(x, [2, 4], [1, 4], group, after="event")
    assert work == "work" and out.shape == (6, 3)
    assert log == [("side waits", "event"), ("enter", side), ("allocate",), ("all_to_all", [2, 4], [1, 4], True),
                   ("exit", side), ("record", current)]
    log.clear()
    out, work = collectives.all_to_all_start(x, [2, 4], [1, 4], group)  # not deferred: the caller's stream
    assert log == [("allocate",), ("all_to_all", [2, 4], [1, 4], True)]
    log.clear()
    # a non-contiguous input is copied on the caller's stream after the event: the exchange waits for the copy
    out, work = collectives.all_to_all_start(torch.ones(3, 5).t(), [2, 4], [1, 4], group, after="event")
    assert log[:2] == [("current records",), ("side waits", "after the copy")]
