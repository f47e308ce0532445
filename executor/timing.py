"""Phase timing of a training step: consecutive markers on the device stream, forward and backward.

A step is cut into phases by markers. ``switch(phase)`` closes the running phase and opens ``phase``;
``mark(x, before, after)`` does the same in the forward pass and, through an identity autograd function,
switches back to ``before`` when the backward pass reaches that point. On CUDA the markers are events on
the current stream (no synchronisation until :meth:`PhaseTimer.end_step`); on CPU they are host clocks.
Because the markers tile the step, the phase times add up to the step time.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch


class _Mark(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, timer, before, after):
        ctx.timer, ctx.before = timer, before
        timer.switch(after)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.timer.switch(ctx.before)
        return grad, None, None, None


class PhaseTimer:
    """Attributes device time between consecutive markers to named phases (seconds)."""

    def __init__(self, enabled: bool = False, device: torch.device | None = None):
        self.enabled = enabled
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self._marks: list[tuple[str, object]] = []

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def switch(self, phase: str) -> None:
        """Close the running phase and open ``phase`` (no-op when disabled)."""
        if self.enabled:
            self._marks.append((phase, self._now()))

    def mark(self, x: torch.Tensor, before: str, after: str) -> torch.Tensor:
        """Identity on ``x`` that switches to ``after`` going forward and back to ``before`` in backward."""
        if not self.enabled:
            return x
        if not x.requires_grad:
            self.switch(after)
            return x
        return _Mark.apply(x, self, before, after)

    def start_step(self) -> None:
        self._marks = []
        self.switch("other")

    def end_step(self) -> dict[str, float]:
        """Close the step and return seconds per phase (waits for the last mark's event: every mark is on the
        compute stream, and a device-wide sync would also wait for collectives left running on purpose)."""
        if not self.enabled:
            return {}
        self.switch("end")
        if self.cuda:
            self._marks[-1][1].synchronize()
        phases: dict[str, float] = defaultdict(float)
        for (name, start), (_, stop) in zip(self._marks, self._marks[1:]):
            phases[name] += (start.elapsed_time(stop) / 1e3) if self.cuda else (stop - start)
        self._marks = []
        return dict(phases)


NULL_TIMER = PhaseTimer(enabled=False)
