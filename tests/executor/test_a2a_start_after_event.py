"""executor/parallel/collectives.all_to_all_start with ``after``: the exchange is issued from a side stream that
waits for the given event only (the EP overlap's deferred dispatch), with its output allocated on the caller's
stream. CUDA streams are replaced by recording fakes so that the order of calls is checked on CPU."""

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
    monkeypatch.setattr(collectives, "_side_stream", lambda device: side)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(collectives.dist, "all_to_all_single", exchange)
    group = Group("ep", (0, 1), 0, pg=object())
    x = torch.ones(5, 3)
    out, work = collectives.all_to_all_start(x, [2, 4], [1, 4], group, after="event")
    assert work == "work" and out.shape == (6, 3)
    assert log == [("side waits", "event"), ("enter", side), ("all_to_all", [2, 4], [1, 4], True), ("exit", side)]
    log.clear()
    out, work = collectives.all_to_all_start(x, [2, 4], [1, 4], group)  # not deferred: the caller's stream
    assert log == [("all_to_all", [2, 4], [1, 4], True)]
