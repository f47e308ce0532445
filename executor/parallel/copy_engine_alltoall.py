"""An uneven all-to-all of rows moved by the GPUs' copy engines, not by kernels on their SMs.

Why: under the EP all-to-all overlap (executor/ep_overlap.py) NCCL's all-to-all kernels share the SMs with
the other micro-batch's persistent grouped GEMMs. On 2 x H200 (2026-11-27, docs/benchmarks.md) that compute
took 17.7 ms longer per step with the overlap, nearly the 15.3 ms of all-to-all it hid. Copies between
peer memory (``cudaMemcpyAsync`` on pointers into another GPU's memory, which ``Tensor.copy_`` issues for
contiguous rows) run on the copy engines; only the tiny signal kernels of the handshake below take an SM.

Notation (one EP group of ``W`` ranks, this rank ``me``): ``x`` [Σ in_splits, ...] holds the rows this rank
sends, ``in_splits[p]`` of them to rank p in rank order; ``out`` [Σ out_splits, ...] receives
``out_splits[q]`` rows from rank q in rank order (``torch.distributed.all_to_all_single``'s contract).

Memory: every rank owns one symmetric buffer (``torch.distributed._symmetric_memory``) of ``W`` slots of
``slot_bytes``; slot q of rank p's buffer is rank q's *inbox* at p. A chunk of rows larger than a slot goes
in rounds of ``slot_bytes // row_bytes`` rows.

Handshake per round, for each ordered pair (sender q, receiver p) with rows left in that round; both ranks
know the chunk's size (q from ``in_splits[p]``, p from ``out_splits[q]``), so both count the same rounds
and no rank waits for a signal nobody sends:

1. READY: p signals q that its inbox for q is free (everything p read from it earlier is queued before).
2. push: q waits for READY, copies its rows into that inbox (peer memory, copy engine), signals FULL.
3. pull: p waits for FULL and copies the inbox into ``out`` (local copy, copy engine).

Each rank queues, per round, all its READY signals, then its pushes, then its pulls. A rank's round j
waits only for its peers' round-j READY and FULL, which they queue before any wait of their round j; so
the exchange cannot deadlock, whatever the split sizes. This rank's own rows go straight from ``x`` to
``out``. Every operation is queued on the stream current at the call: the caller orders it against compute
with events (:func:`executor.parallel.collectives.all_to_all_start`).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Protocol

import torch
from torch.distributed import _symmetric_memory as symm_mem

from executor.parallel.groups import Group

READY, FULL = 0, 1  # signal channels
#: each peer's inbox at a rank (bytes): the Mixtral-8x7B EP2 dispatch of one 4096-token micro-batch (64 MiB of
#: bf16 rows, at most, to one peer) fits in one round
DEFAULT_SLOT_BYTES = 64 << 20
SIGNAL_TIMEOUT_MS = 600_000  # a peer that never signals ends the process with a CUDA error, not a hang


class SignalledBuffers(Protocol):
    """What the exchange needs of a symmetric-memory handle (``_SymmetricMemory`` satisfies it)."""

    rank: int
    world_size: int

    def get_buffer(self, rank: int, sizes: tuple[int, ...], dtype: torch.dtype, storage_offset: int = 0
                   ) -> torch.Tensor:
        """Rank ``rank``'s buffer seen from this rank, as a tensor of ``sizes`` from element ``storage_offset``."""

    def put_signal(self, dst_rank: int, channel: int = 0, timeout_ms: int = 0) -> None:
        """Queue a signal to ``dst_rank`` on ``channel``."""

    def wait_signal(self, src_rank: int, channel: int = 0, timeout_ms: int = 0) -> None:
        """Queue a wait for (and the consumption of) a signal from ``src_rank`` on ``channel``."""


def rounds(rows: int, rows_per_round: int) -> int:
    """Rounds that move ``rows`` through an inbox of ``rows_per_round`` rows."""
    return -(-rows // rows_per_round)


def exchange_rows(handle: SignalledBuffers, slot_bytes: int, x: torch.Tensor, out: torch.Tensor,
                  out_splits: list[int], in_splits: list[int]) -> None:
    """Queue the all-to-all of ``x`` into ``out`` on the current stream (module docstring: the handshake).
    ``x`` and ``out`` are contiguous, of one dtype and row shape; ``slot_bytes`` is each inbox's size."""
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
        receiving = [q for q in peers if to_recv[q] > j]
        for q in receiving:
            handle.put_signal(q, READY, SIGNAL_TIMEOUT_MS)
        for p in peers:
            if to_send[p] > j:
                first = send_at[p] + j * per_round
                n = min(per_round, send_at[p + 1] - first)
                handle.wait_signal(p, READY, SIGNAL_TIMEOUT_MS)
                inbox = handle.get_buffer(p, (n, *row_shape), dtype, me * slot_elems)
                inbox.copy_(x[first:first + n])
                handle.put_signal(p, FULL, SIGNAL_TIMEOUT_MS)
        for q in receiving:
            first = recv_at[q] + j * per_round
            n = min(per_round, recv_at[q + 1] - first)
            handle.wait_signal(q, FULL, SIGNAL_TIMEOUT_MS)
            out[first:first + n].copy_(handle.get_buffer(me, (n, *row_shape), dtype, q * slot_elems))


class CopyEngineAllToAll:
    """The exchange of :func:`exchange_rows` over one process group's symmetric memory, on CUDA devices whose
    ranks can map each other's memory (one node). Building it is a collective over ``group``."""

    def __init__(self, group: Group, device: torch.device, slot_bytes: int = DEFAULT_SLOT_BYTES):
        if device.type != "cuda":
            raise ValueError(f"the copy-engine all-to-all needs CUDA tensors, not {device.type}")
        self.group, self.slot_bytes = group, slot_bytes
        buffer = symm_mem.empty(group.size * slot_bytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(buffer, group.pg)
        self._buffer = buffer  # the handle maps it; keep it alive with the transport
        self._stream = torch.cuda.Stream(device)

    def start(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
              after: torch.cuda.Event | None = None):
        """Queue the exchange of ``x`` on this transport's stream, after ``after`` (an event) or else after
        everything queued on the current stream; returns (output, work): ``work.wait()`` makes the current
        stream wait for the exchange, as a collective's work handle does."""
        current = torch.cuda.current_stream(x.device)
        if after is None or not x.is_contiguous():
            x = x.contiguous()
            after = current.record_event()
        side = self._stream
        side.wait_event(after)
        with torch.cuda.stream(side):
            out = torch.empty((sum(out_splits), *x.shape[1:]), dtype=x.dtype, device=x.device)
            exchange_rows(self.handle, self.slot_bytes, x, out, list(out_splits), list(in_splits))
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
