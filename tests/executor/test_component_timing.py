"""The components' timing (executor/microbench/components.py, executor/microbench/timing.py): each block is issued
COMPONENT_CALLS times back to back per window and timed as device time with the host ahead of the GPU
(time_host_ahead); on the CPU that falls back to time_op's wall clock. The CUDA path's retry logic runs here
against a fake torch.cuda; the real one needs a GPU (the last test)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from executor.microbench import components, timing
from spec.catalog import get_model


def test_time_op_times_a_window_back_to_back_with_one_sync(monkeypatch):
    log = []
    monkeypatch.setattr(timing, "synchronize", lambda device: log.append("sync"))
    clock = iter(range(100))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(clock)))
    calls = components.COMPONENT_CALLS
    seconds = timing.time_op(lambda: log.append("op"), torch.device("cpu"), iters=calls, warmup=1, repeats=2)
    assert log == ["sync", "op", "sync"] + (["op"] * calls + ["sync"]) * 2
    assert seconds == 1 / calls  # each window reads the clock twice: one tick over its calls


def test_host_ahead_on_the_cpu_is_the_wall_clock_mean_of_one_call(monkeypatch):
    # a clock only the op moves, by 2 ms a call: one call's seconds come out exactly, however busy the machine
    nap, now = 0.002, [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

    def op():
        now[0] += nap

    result = timing.time_host_ahead(op, torch.device("cpu"), calls=3, windows=2, warmup=1)
    assert result.method == timing.WALL_CLOCK
    assert result.seconds == pytest.approx(nap)  # a window's mean, not its sum (3 calls)


class _FakeCuda:
    """torch.cuda as time_host_ahead uses it: a sleep that is logged, events whose query() says whether the
    GPU had reached them when the host finished issuing (``reached_for(calls in the window)``), and a fixed
    4 ms span per window."""

    def __init__(self, reached: bool):
        self.reached_for = lambda calls: reached  # per window size, as a full launch queue would
        self.sleeps, self.windows = [], []

    def device(self, device):
        return contextlib.nullcontext()

    def synchronize(self, device=None):
        pass

    def _sleep(self, cycles):
        self.sleeps.append(cycles)
        self.windows.append(0)

    def Event(self, enable_timing=False):  # noqa: N802 (torch's name)
        fake = self

        class Event:
            def record(self):
                pass

            def synchronize(self):
                pass

            def query(self):
                return fake.reached_for(fake.windows[-1])

            def elapsed_time(self, end):
                return 4.0

        return Event()


@pytest.fixture
def fake_cuda(monkeypatch):
    def make(reached: bool):
        fake = _FakeCuda(reached)
        for name in ("device", "synchronize", "_sleep", "Event"):
            monkeypatch.setattr(timing.torch.cuda, name, getattr(fake, name))
        monkeypatch.setitem(timing._SLEEP_CYCLES_PER_S, 0, 1e9)  # 1 GHz, so the rate is not measured
        clock = [0.0]
        monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])

        def op():  # 1 ms of host time per call; counted into the window the last sleep opened
            clock[0] += 1e-3
            if fake.windows:
                fake.windows[-1] += 1
        return fake, op
    return make


def test_host_ahead_reports_the_event_span_of_windows_queued_behind_a_long_enough_sleep(fake_cuda):
    fake, op = fake_cuda(reached=False)  # the GPU was still asleep when the host finished: host ahead
    result = timing.time_host_ahead(op, torch.device("cuda:0"), calls=8, windows=3, warmup=2)
    assert result.method == timing.HOST_AHEAD
    assert result.seconds == pytest.approx(4e-3 / 8)
    assert fake.windows == [8, 8, 8]
    # each sleep covers SLEEP_MARGIN x the measured host time of a window (8 ms) + the floor, at 1 GHz
    assert fake.sleeps == [int(1e9 * (timing.SLEEP_MARGIN * 8e-3 + timing.SLEEP_FLOOR_S))] * 3


def test_host_ahead_halves_the_window_and_then_says_the_host_was_not_ahead(fake_cuda):
    fake, op = fake_cuda(reached=True)  # the GPU always reached the window before the host had issued it
    result = timing.time_host_ahead(op, torch.device("cuda:0"), calls=8, windows=3, warmup=2)
    assert result.method == timing.HOST_BEHIND
    assert fake.windows == [8, 8, 4, 4, 2, 2, 1, 1]  # two misses at each size, down to one call
    assert result.seconds == pytest.approx(4e-3 / 8)  # the smallest per-call span: the tightest upper bound
    # each miss sizes the next sleep from that window's host time (1 ms per call here, as the probe measured)
    assert fake.sleeps == [int(1e9 * (timing.SLEEP_MARGIN * 1e-3 * n + timing.SLEEP_FLOOR_S)) for n in fake.windows]


def test_host_ahead_halves_the_window_when_only_smaller_windows_get_ahead(fake_cuda):
    fake, op = fake_cuda(reached=True)
    fake.reached_for = lambda n: n > 2  # e.g. a launch queue that holds two calls' kernels, not four
    result = timing.time_host_ahead(op, torch.device("cuda:0"), calls=8, windows=3, warmup=2)
    assert fake.windows == [8, 8, 4, 4, 2, 2, 2]
    assert result.method == timing.HOST_AHEAD + " (2 calls per window)"
    assert result.seconds == pytest.approx(4e-3 / 2)


def test_measure_components_times_every_block_with_the_host_ahead_and_the_optimizer_alone(monkeypatch):
    used = []

    def host_ahead(op, device, calls=None, **kw):
        used.append(("time_host_ahead", calls))
        return timing.BlockTime(1.0, "method of the test")

    def alone(op, device, **kw):
        used.append(("time_device", None))
        return 1.0

    monkeypatch.setattr(components, "time_host_ahead", host_ahead)
    monkeypatch.setattr(components, "time_device", alone)
    _, measured, methods = components.measure_components(get_model("tiny-moe"), 32, 1, "fp32", "cpu",
                                                         optimizer_params=4096)
    blocks = [name for name in measured if name != "optimizer"]
    assert blocks == ["attention", "moe", "head"]
    assert used == [("time_host_ahead", components.COMPONENT_CALLS)] * len(blocks) + [("time_device", None)]
    assert methods == {**{name: "method of the test" for name in blocks}, "optimizer": timing.WALL_CLOCK}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_host_ahead_on_a_gpu_leaves_out_the_issue_time_of_many_small_kernels():
    device = torch.device("cuda:0")
    x = torch.zeros(16, device=device)

    def small_kernels():  # ~µs of device work per add, several µs of host issue each
        for _ in range(100):
            x.add_(1.0)
    wall = timing.time_op(small_kernels, device, iters=8)
    ahead = timing.time_host_ahead(small_kernels, device, calls=8)
    assert ahead.method.startswith(timing.HOST_AHEAD)
    assert ahead.seconds < wall
