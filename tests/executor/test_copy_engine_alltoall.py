"""The copy-engine all-to-all's handshake (executor/parallel/copy_engine_alltoall.py) on the CPU: one thread a
rank, each running its operations in order as its GPU stream would, against a symmetric memory whose
counters behave as the stream memory operations (a signal sets a value, a wait holds until the counter
reaches one); and the choice of the transport ('auto') in a gloo world with a stand-in for it. The GPU path
itself (peer copies on the copy engines, the driver's counters) is checked on GPUs by
bench/ce_alltoall_probe.py."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

import executor.parallel.copy_engine_alltoall as transport
from executor.launch_local import launch
from executor.parallel.copy_engine_alltoall import (FILLED, FREED, GENERATIONS, INBOX_BUDGET_BYTES, PairRounds,
                                                    exchange_rows, rounds, slot_bytes_for)
from executor.parallel.groups import Group

TIMEOUT_S = 30.0  # a deadlock fails the test instead of hanging it


class _Counter:
    def __init__(self):
        self.value = 0
        self.cond = threading.Condition()

    def set(self, value: int):
        with self.cond:
            assert value >= self.value, "counters only grow"
            self.value = value
            self.cond.notify_all()

    def wait(self, value: int):
        with self.cond:
            if not self.cond.wait_for(lambda: self.value >= value, TIMEOUT_S):
                raise TimeoutError(f"wait: the counter stayed at {self.value} < {value}")


class _World:
    def __init__(self, world: int, slot_bytes: int, generations: int):
        self.buffers = [torch.zeros(generations * world * slot_bytes, dtype=torch.uint8) for _ in range(world)]
        self.counters = {(at, sender, ch): _Counter() for at in range(world) for sender in range(world)
                         for ch in (FREED, FILLED)}
        self.log: list[tuple] = []


class _Handle:
    """One rank's view; its operations run when its thread reaches them, as on a stream."""

    def __init__(self, world: _World, rank: int):
        self.world, self.rank, self.world_size = world, rank, len(world.buffers)

    def get_buffer(self, rank, sizes, dtype, storage_offset=0):
        flat = self.world.buffers[rank].view(dtype)
        numel = 1
        for d in sizes:
            numel *= d
        assert storage_offset + numel <= flat.numel(), "outside the peer's buffer"
        return flat[storage_offset:storage_offset + numel].view(sizes)

    def signal(self, dst_rank, channel, value):
        self.world.log.append(("signal", self.rank, dst_rank, channel, value))
        self.world.counters[(dst_rank, self.rank, channel)].set(value)

    def wait(self, src_rank, channel, value):
        self.world.log.append(("wait", src_rank, self.rank, channel, value))
        self.world.counters[(self.rank, src_rank, channel)].wait(value)


def _run(splits: list[list[int]], row_shape=(3,), dtype=torch.float32, slot_bytes=64, exchanges=1,
         generations=GENERATIONS):
    """splits[q][p]: rows rank q sends to rank p. Runs ``exchanges`` exchanges back to back on the same buffers
    (the later ones must wait for the earlier pulls) and returns (outputs, expected) of the last."""
    world = len(splits)
    state = _World(world, slot_bytes, generations)
    gen = torch.Generator().manual_seed(7)
    xs = [[torch.randn((sum(splits[q]), *row_shape), generator=gen).to(dtype) for q in range(world)]
          for _ in range(exchanges)]
    outs: list = [None] * world
    errors: list[BaseException] = []

    def rank_main(r: int) -> None:
        try:
            handle, counted = _Handle(state, r), PairRounds()
            for x_of in xs:
                out_splits = [splits[q][r] for q in range(world)]
                out = torch.full((sum(out_splits), *row_shape), float("nan"), dtype=dtype)
                exchange_rows(handle, counted, slot_bytes, x_of[r], out, out_splits, splits[r], generations)
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


@pytest.mark.parametrize("generations", [1, 2, 3])
def test_back_to_back_exchanges_reuse_the_inboxes_only_after_they_are_read(generations):
    splits = [[3, 8, 1], [6, 0, 9], [2, 2, 2]]
    outs, expected, state = _run(splits, exchanges=4, generations=generations)
    for got, want in zip(outs, expected):
        assert torch.equal(got, want)
    # every push of round k >= G waited for the pull of round k - G out of the same inbox
    pushes = [e for e in state.log if e[0] == "signal" and e[3] == FILLED]
    freed_waits = {(e[1], e[2], e[4]) for e in state.log if e[0] == "wait" and e[3] == FREED}
    for _, sender, receiver, _, k1 in pushes:
        k = k1 - 1
        if k >= generations:
            assert (receiver, sender, k - generations + 1) in freed_waits


def test_bf16_rows_of_several_dims_move_bit_for_bit():
    outs, expected, _ = _run([[2, 5], [3, 1]], row_shape=(2, 4), dtype=torch.bfloat16, slot_bytes=48)
    for got, want in zip(outs, expected):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_a_pair_with_nothing_to_move_exchanges_no_signal():
    _, _, state = _run([[4, 0, 2], [0, 1, 0], [3, 0, 5]])
    pairs = {(e[1], e[2]) for e in state.log if e[0] == "signal"}
    assert (0, 1) not in pairs and (1, 0) not in pairs and (1, 2) not in pairs and (2, 1) not in pairs
    assert (0, 2) in pairs and (2, 0) in pairs


def test_rounds_and_a_row_larger_than_an_inbox():
    assert [rounds(n, 5) for n in (0, 1, 5, 6, 10, 11)] == [0, 1, 1, 2, 2, 3]
    world = _World(2, 8, GENERATIONS)
    with pytest.raises(ValueError, match="does not fit an inbox of 8 bytes"):
        exchange_rows(_Handle(world, 0), PairRounds(), 8, torch.zeros(2, 3), torch.zeros(2, 3), [1, 1], [1, 1])


def _auto_transport_worker(rank: int, world_size: int, fail_rank: int | None, split_nodes: bool) -> tuple:
    """One gloo rank deciding 'auto' with a stand-in transport (the real one needs GPUs): built everywhere
    but on ``fail_rank``; every rank on its own node when ``split_nodes``."""
    built = []

    class Stand:
        def __init__(self, group, device, slot_bytes=None):
            if rank == fail_rank:
                raise RuntimeError("no symmetric memory here")
            built.append(group.size)

    transport.CopyEngineAllToAll = Stand
    if split_nodes:
        transport.node_name = lambda: f"node-{rank}"
    group = Group("ep", tuple(range(world_size)), rank, dist.group.WORLD)
    engine = transport.copy_engine_for(group, torch.device("cpu"), required=False)
    again = transport.copy_engine_for(group, torch.device("cpu"), required=False)  # kept, not decided anew
    # the next trial's EP group: decided anew, the last one's transport dropped (one entry per device)
    other = Group("ep", tuple(range(world_size)), rank, dist.new_group(list(range(world_size))))
    transport.copy_engine_for(other, torch.device("cpu"), required=False)
    replaced = list(transport._COPY_ENGINES) == [torch.device("cpu")] and \
        transport._COPY_ENGINES[torch.device("cpu")][0] is other.pg
    return rank, engine is not None, again is engine and replaced, built


@pytest.mark.parametrize("fail_rank, split_nodes, agreed", [(None, False, True), (1, False, False),
                                                            (None, True, False)])
def test_auto_transport_is_the_copy_engines_only_where_every_rank_built_them_on_one_node(fail_rank, split_nodes,
                                                                                         agreed):
    result = launch(_auto_transport_worker, 2, (fail_rank, split_nodes), backend="gloo", start_method="fork")
    assert result.ok, result.failure_reason
    for rank, has_engine, kept, built in result.results:
        assert has_engine is agreed and kept
        tried = not split_nodes and rank != fail_rank  # split nodes: nobody builds; a failed rank has none
        assert built == ([2, 2] if tried else [])  # once per EP group: the first, then the next trial's


def test_inbox_size_shares_one_budget_over_the_group():
    assert slot_bytes_for(2) == 64 << 20 and slot_bytes_for(8) == 16 << 20
    for world in (2, 3, 5, 8, 64, 4096):
        assert slot_bytes_for(world) % 4096 == 0 and slot_bytes_for(world) >= 4096
        assert GENERATIONS * world * slot_bytes_for(world) <= max(INBOX_BUDGET_BYTES, GENERATIONS * world * 4096)
