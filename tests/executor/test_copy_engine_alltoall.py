"""The copy-engine all-to-all's handshake (executor/parallel/copy_engine_alltoall.py) on the CPU: one thread a
rank, each queuing its operations in order as its GPU stream would run them, against a symmetric memory
whose signals behave as torch's (a put waits while the last one is unconsumed; a wait consumes it). The GPU
path itself (peer copies on the copy engines) is checked on GPUs by bench/ce_alltoall_probe.py."""

from __future__ import annotations

import threading

import pytest
import torch

from executor.parallel.copy_engine_alltoall import FULL, READY, exchange_rows, rounds

TIMEOUT_S = 30.0  # a deadlock fails the test instead of hanging it


class _Signal:
    def __init__(self):
        self.set = False
        self.cond = threading.Condition()

    def put(self):
        with self.cond:
            if not self.cond.wait_for(lambda: not self.set, TIMEOUT_S):
                raise TimeoutError("put_signal: the last signal was never consumed")
            self.set = True
            self.cond.notify_all()

    def wait(self):
        with self.cond:
            if not self.cond.wait_for(lambda: self.set, TIMEOUT_S):
                raise TimeoutError("wait_signal: no signal came")
            self.set = False
            self.cond.notify_all()


class _World:
    def __init__(self, world: int, slot_bytes: int):
        self.buffers = [torch.zeros(world * slot_bytes, dtype=torch.uint8) for _ in range(world)]
        self.signals = {(dst, src, ch): _Signal() for dst in range(world) for src in range(world)
                        for ch in (READY, FULL)}
        self.log: list[tuple] = []


class _Handle:
    def __init__(self, world: _World, rank: int):
        self.world, self.rank, self.world_size = world, rank, len(world.buffers)

    def get_buffer(self, rank, sizes, dtype, storage_offset=0):
        flat = self.world.buffers[rank].view(dtype)
        numel = 1
        for d in sizes:
            numel *= d
        assert storage_offset + numel <= flat.numel(), "outside the peer's buffer"
        return flat[storage_offset:storage_offset + numel].view(sizes)

    def put_signal(self, dst_rank, channel=0, timeout_ms=0):
        self.world.log.append(("put", self.rank, dst_rank, channel))
        self.world.signals[(dst_rank, self.rank, channel)].put()

    def wait_signal(self, src_rank, channel=0, timeout_ms=0):
        self.world.signals[(self.rank, src_rank, channel)].wait()


def _run(splits: list[list[int]], row_shape=(3,), dtype=torch.float32, slot_bytes=64, exchanges=1):
    """splits[q][p]: rows rank q sends to rank p. Runs ``exchanges`` exchanges back to back on the same buffers
    (the later ones must wait for the earlier pulls) and returns (outputs, expected) of the last."""
    world = len(splits)
    state = _World(world, slot_bytes)
    gen = torch.Generator().manual_seed(7)
    xs = [[torch.randn((sum(splits[q]), *row_shape), generator=gen).to(dtype) for q in range(world)]
          for _ in range(exchanges)]
    outs: list = [None] * world
    errors: list[BaseException] = []

    def rank_main(r: int) -> None:
        try:
            handle = _Handle(state, r)
            for x_of in xs:
                out_splits = [splits[q][r] for q in range(world)]
                out = torch.full((sum(out_splits), *row_shape), float("nan"), dtype=dtype)
                exchange_rows(handle, slot_bytes, x_of[r], out, out_splits, splits[r])
                outs[r] = out
        except BaseException as e:  # noqa: BLE001 (re-raised in the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * TIMEOUT_S)
    assert not errors, errors
    expected = []
    for p in range(world):
        parts = []
        for q in range(world):
            start = sum(splits[q][:p])
            parts.append(xs[-1][q][start:start + splits[q][p]])
        expected.append(torch.cat(parts))
    return outs, expected, state


@pytest.mark.parametrize("splits", [
    [[2, 3], [1, 4]],                              # two ranks, every chunk within one slot
    [[0, 9], [7, 0]],                              # nothing kept locally; 9 rows of 12 bytes: 2 rounds of 5
    [[1, 0, 12], [0, 0, 0], [3, 11, 2]],           # empty chunks, an idle rank, 3 rounds on one pair only
    [[5, 5, 5, 5], [0, 6, 1, 10], [4, 0, 0, 0], [2, 2, 2, 2]],
])
def test_equals_the_all_to_all_for_any_split_sizes(splits):
    outs, expected, _ = _run(splits)
    for got, want in zip(outs, expected):
        assert torch.equal(got, want)


def test_back_to_back_exchanges_reuse_the_inboxes_only_after_they_are_read():
    splits = [[3, 8, 1], [6, 0, 9], [2, 2, 2]]
    outs, expected, _ = _run(splits, exchanges=4)
    for got, want in zip(outs, expected):
        assert torch.equal(got, want)


def test_bf16_rows_of_several_dims_move_bit_for_bit():
    outs, expected, _ = _run([[2, 5], [3, 1]], row_shape=(2, 4), dtype=torch.bfloat16, slot_bytes=48)
    for got, want in zip(outs, expected):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_a_pair_with_nothing_to_move_exchanges_no_signal():
    _, _, state = _run([[4, 0, 2], [0, 1, 0], [3, 0, 5]])
    pairs = {(src, dst) for _, src, dst, _ in state.log}
    assert (0, 1) not in pairs and (1, 0) not in pairs and (1, 2) not in pairs and (2, 1) not in pairs
    assert (0, 2) in pairs and (2, 0) in pairs


def test_rounds_and_a_row_larger_than_an_inbox():
    assert [rounds(n, 5) for n in (0, 1, 5, 6, 10, 11)] == [0, 1, 1, 2, 2, 3]
    world = _World(2, 8)
    with pytest.raises(ValueError, match="does not fit an inbox of 8 bytes"):
        exchange_rows(_Handle(world, 0), 8, torch.zeros(2, 3), torch.zeros(2, 3), [1, 1], [1, 1])
