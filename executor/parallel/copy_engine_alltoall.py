"""An uneven all-to-all of rows moved by the GPUs' copy engines, not by kernels on their SMs.

Why: under the EP all-to-all overlap (executor/ep_overlap.py) NCCL's all-to-all kernels share the SMs with
the other micro-batch's persistent grouped GEMMs. On 2 x H200 (docs/benchmarks.md) that compute
took 17.7 ms longer per step with the overlap, nearly the 15.3 ms of all-to-all it hid. Copies between
peer memory (``cudaMemcpyAsync`` on pointers into another GPU's memory, which ``Tensor.copy_`` issues for
contiguous rows) run on the copy engines, and the handshake's signals are stream memory operations
(:class:`StreamSignals`): no part of the exchange takes an SM (a profiled exchange shows only
'Memcpy PtoP' and 'Memcpy DtoD', bench/ce_alltoall_probe.py).

Notation (one EP group of ``W`` ranks, this rank ``me``): ``x`` [Σ in_splits, ...] holds the rows this rank
sends, ``in_splits[p]`` of them to rank p in rank order; ``out`` [Σ out_splits, ...] receives
``out_splits[q]`` rows from rank q in rank order (``torch.distributed.all_to_all_single``'s contract).

Memory: every rank owns one symmetric buffer (``torch.distributed._symmetric_memory``) of ``G × W`` inboxes
of ``slot_bytes``: inbox (g, q) at rank p receives generation g of rank q's rows for p. A chunk of rows
larger than an inbox goes in rounds of ``slot_bytes // row_bytes`` rows. The rounds of each ordered pair
(sender q, receiver p) are numbered from the transport's start, k = 0, 1, ...; round k uses generation
k mod G. Both ranks of a pair count the same rounds: q knows the chunk's size from ``in_splits[p]``, p from
``out_splits[q]``.

Handshake, through two counters per ordered pair, both at the rank that waits on them:

1. push (round k at q): wait until FREED(p→q) >= k − G + 1 (p has read round k − G out of that inbox),
   copy the rows into p's inbox (peer memory, copy engine), set FILLED(q→p) = k + 1 at p.
2. pull (round k at p): wait until FILLED(q→p) >= k + 1, copy the inbox into ``out`` (local copy, copy
   engine), set FREED(p→q) = k + 1 at q.

With G = 2 the push's wait is for a round that was pulled an exchange earlier: it is met when reached,
and only the pull waits. Why that matters: beside busy compute each wait on another GPU's write may stretch
an exchange (2 x H200, bench/ce_alltoall_probe.py, one call each: 12 exchanges beside a loop of
grouped GEMMs ended after 18 ms with one generation, whose every round also waited for a 'free' signal sent
just before, and after 12-14 ms with two; alone they take 2.8 ms).

Each rank queues, per round, its pushes, then its pulls. A push of round k waits only for pulls of rounds
before k, and a pull of round k only for the push of round k, which its sender queues before any pull of
round k; so the exchange cannot deadlock, whatever the split sizes. This rank's own rows go straight from
``x`` to ``out``. Every operation is queued on the stream current at the call: the caller orders it
against compute with events (:meth:`CopyEngineAllToAll.start`). A peer that never signals stalls the
stream, as a peer that never joins stalls NCCL's all-to-all: the trial's timeout ends it.

:func:`copy_engine_for` gives the EP overlap (executor/ep_overlap.py) a rank's transport: built once per EP
group, or for 'auto' only where every rank of the group is on one node and every rank built it.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import _symmetric_memory as symm_mem

from executor.node import node_name
from executor.parallel.groups import Group
from spec.errors import InvalidConfigError

FREED, FILLED = 0, 1  # counter channels
GENERATIONS = 2
#: all inboxes of a rank together (bytes), whatever the group's size: G x W inboxes share it
INBOX_BUDGET_BYTES = 256 << 20
SLOT_ALIGN = 4096


def slot_bytes_for(world: int) -> int:
    """Each inbox's bytes for a group of ``world`` ranks: :data:`INBOX_BUDGET_BYTES` over the G × W inboxes,
    aligned to 4 KiB. At EP2 64 MiB: the whole dispatch of one 4096-token Mixtral-8x7B micro-batch (4096 × 2
    rows of 4096 bf16) fits one inbox even if every row goes to one peer; at EP8 16 MiB, twice a peer's share
    of it under even routing. A larger chunk takes more rounds."""
    return max(SLOT_ALIGN, INBOX_BUDGET_BYTES // (GENERATIONS * world) // SLOT_ALIGN * SLOT_ALIGN)


class SignalledBuffers(Protocol):
    """What the exchange needs of a symmetric buffer with counters (:class:`StreamSignals` on GPUs)."""

    rank: int
    world_size: int

    def get_buffer(self, rank: int, sizes: tuple[int, ...], dtype: torch.dtype, storage_offset: int = 0
                   ) -> torch.Tensor:
        """Rank ``rank``'s buffer seen from this rank, as a tensor of ``sizes`` from element ``storage_offset``."""

    def signal(self, dst_rank: int, channel: int, value: int) -> None:
        """Queue: set this rank's counter on ``channel`` at ``dst_rank`` to ``value`` (after what is queued)."""

    def wait(self, src_rank: int, channel: int, value: int) -> None:
        """Queue: wait until ``src_rank``'s counter on ``channel`` here is at least ``value``."""


@dataclass
class PairRounds:
    """Rounds each ordered pair has queued since the transport started: ``sent[p]`` pushed to p,
    ``received[q]`` pulled from q."""

    sent: dict[int, int] = field(default_factory=dict)
    received: dict[int, int] = field(default_factory=dict)


def rounds(rows: int, rows_per_round: int) -> int:
    """Rounds that move ``rows`` through an inbox of ``rows_per_round`` rows."""
    return -(-rows // rows_per_round)


def exchange_rows(handle: SignalledBuffers, counted: PairRounds, slot_bytes: int, x: torch.Tensor,
                  out: torch.Tensor, out_splits: list[int], in_splits: list[int],
                  generations: int = GENERATIONS) -> None:
    """Queue the all-to-all of ``x`` into ``out`` on the current stream (module docstring: the handshake).
    ``x`` and ``out`` are contiguous, of one dtype and row shape; ``slot_bytes`` is each inbox's size;
    ``counted`` is updated with the rounds queued."""
    me, world = handle.rank, handle.world_size
    row_shape, dtype = tuple(x.shape[1:]), x.dtype
    row_numel = 1
    for d in row_shape:
        row_numel *= d
    row_bytes = row_numel * x.element_size()
    per_round = slot_bytes // row_bytes if row_bytes else 0
    if per_round < 1:
        raise ValueError(f"a row of {row_bytes} bytes does not fit an inbox of {slot_bytes} bytes")
    slot_elems = slot_bytes // x.element_size()
    send_at = [0, *accumulate(in_splits)]
    recv_at = [0, *accumulate(out_splits)]
    if in_splits[me]:
        out[recv_at[me]:recv_at[me] + out_splits[me]].copy_(x[send_at[me]:send_at[me] + in_splits[me]])
    peers = [r for r in range(world) if r != me]
    to_send = {p: rounds(in_splits[p], per_round) for p in peers}
    to_recv = {q: rounds(out_splits[q], per_round) for q in peers}
    for j in range(max([0, *to_send.values(), *to_recv.values()])):
        for p in peers:
            if to_send[p] > j:
                k = counted.sent.get(p, 0)
                first = send_at[p] + j * per_round
                n = min(per_round, send_at[p + 1] - first)
                if k >= generations:
                    handle.wait(p, FREED, k - generations + 1)
                inbox = (k % generations) * world + me
                handle.get_buffer(p, (n, *row_shape), dtype, inbox * slot_elems).copy_(x[first:first + n])
                handle.signal(p, FILLED, k + 1)
                counted.sent[p] = k + 1
        for q in peers:
            if to_recv[q] > j:
                k = counted.received.get(q, 0)
                first = recv_at[q] + j * per_round
                n = min(per_round, recv_at[q + 1] - first)
                handle.wait(q, FILLED, k + 1)
                inbox = (k % generations) * world + q
                out[first:first + n].copy_(handle.get_buffer(me, (n, *row_shape), dtype, inbox * slot_elems))
                handle.signal(q, FREED, k + 1)
                counted.received[q] = k + 1


class StreamSignals:
    """:class:`SignalledBuffers` over a symmetric buffer whose signals are stream memory operations
    (``cuStreamWriteValue32`` / ``cuStreamWaitValue32``), which the GPU's front end runs without any SM.

    Why not torch's ``put_signal``/``wait_signal`` (binary flags): they are kernels, which need an SM beside
    persistent grouped GEMMs that hold every SM; stream memory operations need none, which is the reason for
    them. Measured (2 x H200, bench/ce_alltoall_probe.py, one call each): a GEMM loop took 12 ms
    longer beside 12 exchanges signalled by those kernels, and 11-12 ms with these operations in the next call;
    4-7 ms in the two calls after that with the same signals (docs/benchmarks.md: not explained by the code).

    Each rank's buffer starts with a header of 32-bit counters, one per (channel, sending rank); a signal
    writes the value into the counter at the destination (through the peer mapping; the write waits for
    the copies queued before it, and is fenced), a wait holds the stream until the counter here is at least
    the value (compared as the driver does, modulo 2**32). The inboxes follow the header:
    :meth:`get_buffer` offsets past it."""

    HEADER_BYTES = 4096

    def __init__(self, handle, buffer: torch.Tensor):
        self.handle, self.rank, self.world_size = handle, handle.rank, handle.world_size
        if 2 * self.world_size * 4 > self.HEADER_BYTES:
            raise ValueError(f"{self.world_size} ranks need more signal counters than a {self.HEADER_BYTES}-byte "
                             "header holds")
        self._ptrs = [int(p) for p in handle.buffer_ptrs]
        self._cuda = _driver()
        buffer[: self.HEADER_BYTES].zero_()

    def _counter(self, owner: int, channel: int, sender: int) -> int:
        return self._ptrs[owner] + 4 * (channel * self.world_size + sender)

    def get_buffer(self, rank, sizes, dtype, storage_offset=0):
        elem = torch.empty((), dtype=dtype).element_size()
        return self.handle.get_buffer(rank, sizes, dtype, storage_offset + self.HEADER_BYTES // elem)

    def signal(self, dst_rank, channel, value):
        _check(self._cuda.cuStreamWriteValue32_v2(
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
            ctypes.c_uint64(self._counter(dst_rank, channel, self.rank)),
            ctypes.c_uint32(value & 0xFFFFFFFF), ctypes.c_uint(0)), "cuStreamWriteValue32")

    def wait(self, src_rank, channel, value):
        _check(self._cuda.cuStreamWaitValue32_v2(
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
            ctypes.c_uint64(self._counter(self.rank, channel, src_rank)),
            ctypes.c_uint32(value & 0xFFFFFFFF), ctypes.c_uint(_WAIT_VALUE_GEQ)), "cuStreamWaitValue32")


_WAIT_VALUE_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: wait until (int32)(*addr - value) >= 0
_DRIVER: list = []


def _driver():
    """The CUDA driver library (loaded once; torch has loaded it already in a CUDA process)."""
    if not _DRIVER:
        _DRIVER.append(ctypes.CDLL("libcuda.so.1"))
    return _DRIVER[0]


def _check(result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"{call} failed with CUresult {result} (stream memory operations unsupported here?)")


class CopyEngineAllToAll:
    """The exchange of :func:`exchange_rows` over one process group's symmetric memory, on CUDA devices whose
    ranks can map each other's memory (one node). Building it is a collective over ``group``."""

    def __init__(self, group: Group, device: torch.device, slot_bytes: int | None = None):
        if device.type != "cuda":
            raise ValueError(f"the copy-engine all-to-all needs CUDA tensors, not {device.type}")
        slot_bytes = slot_bytes_for(group.size) if slot_bytes is None else slot_bytes  # None: the shared budget's
        self.group, self.slot_bytes = group, slot_bytes
        buffer = symm_mem.empty(StreamSignals.HEADER_BYTES + GENERATIONS * group.size * slot_bytes,
                                dtype=torch.uint8, device=device)
        self.handle = StreamSignals(symm_mem.rendezvous(buffer, group.pg), buffer)
        self._buffer = buffer  # the handle maps it; keep it alive with the transport
        self.stream = torch.cuda.Stream(device)  # where every exchange of this transport runs, in order
        self.counted = PairRounds()
        # every rank's counters are zero before any peer may signal into them
        torch.cuda.current_stream(device).synchronize()
        dist.barrier(group=group.pg)

    def start(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
              after: torch.cuda.Event | None = None):
        """Queue the exchange of ``x`` on this transport's stream, after ``after`` (an event) or else after
        everything queued on the current stream; returns (output, work): ``work.wait()`` makes the current
        stream wait for the exchange, as a collective's work handle does."""
        current = torch.cuda.current_stream(x.device)
        if after is None or not x.is_contiguous():
            x = x.contiguous()
            after = current.record_event()
        side = self.stream
        side.wait_event(after)
        with torch.cuda.stream(side):
            out = torch.empty((sum(out_splits), *x.shape[1:]), dtype=x.dtype, device=x.device)
            exchange_rows(self.handle, self.counted, self.slot_bytes, x, out, list(out_splits), list(in_splits))
            done = side.record_event()
        x.record_stream(side)  # read there: not handed out again on the current stream before that
        out.record_stream(current)
        return out, _EventWork(done)


class _EventWork:
    """A work handle whose ``wait`` makes the current stream wait for an event."""

    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def wait(self) -> bool:
        torch.cuda.current_stream().wait_event(self.event)
        return True


# per device, the process group the transport serves and the transport (None: NCCL). One entry a device: a rank
# runs one layout at a time, and a trial with other groups replaces (and frees) the last trial's buffer.
_COPY_ENGINES: dict[torch.device, tuple[object, CopyEngineAllToAll | None]] = {}


def copy_engine_for(group: Group, device: torch.device, required: bool = True) -> CopyEngineAllToAll | None:
    """The copy-engine transport of ``group`` on ``device``, decided and built on first use (collectives over
    the group, which every member reaches at the same exchange of the fixed schedule) and kept while the
    group's process group serves this rank: a rank process reused across trials keeps its symmetric buffer while
    the EP group stays, and frees it for the next one when the group changes.

    ``required`` ('copy_engine'): built or an error. Otherwise ('auto'): None, for NCCL, unless every member
    runs on this node (:func:`executor.node.node_name`) and every member built it; the members agree on the
    outcome through an all-reduce, so none waits in a copy-engine exchange that a peer runs over NCCL."""
    held = _COPY_ENGINES.get(device)
    if held is None or held[0] is not group.pg:
        _COPY_ENGINES.pop(device, None)  # the last layout's buffer goes before this one is allocated
        held = (group.pg, _build_copy_engine(group, device) if required else _agreed_copy_engine(group, device))
        _COPY_ENGINES[device] = held
    return held[1]


def _build_copy_engine(group: Group, device: torch.device) -> CopyEngineAllToAll:
    try:
        return CopyEngineAllToAll(group, device)
    except (RuntimeError, ValueError, OSError) as e:
        raise InvalidConfigError(f"ep_overlap_transport='copy_engine' needs symmetric memory over the EP group "
                                 f"(every rank on one node, peer access between its GPUs): {e}; use 'auto' or "
                                 f"'nccl'") from e


def _agreed_copy_engine(group: Group, device: torch.device) -> CopyEngineAllToAll | None:
    names: list = [None] * group.size
    dist.all_gather_object(names, node_name(), group=group.pg)
    if len(set(names)) != 1:
        return None
    engine = None
    try:
        engine = CopyEngineAllToAll(group, device)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"EP overlap: the copy-engine all-to-all is not available here ({e}); NCCL moves the exchanges",
              file=sys.stderr, flush=True)
    built = torch.tensor([1 if engine is not None else 0], device=device)
    dist.all_reduce(built, op=dist.ReduceOp.MIN, group=group.pg)
    return engine if int(built.item()) == 1 else None
