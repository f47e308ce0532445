"""Pipeline schedules (1F1B, interleaved virtual stages, and the combined 1F1B of the EP all-to-all overlap) and
their execution with p2p messages. The one schedule module: every step with a pipeline or with the EP overlap
runs here (:func:`run_schedule`).

Each pipeline rank runs its operations — forward ``F`` or backward ``B`` of (micro-batch, virtual chunk) — in
Megatron's order, in three named stages (:class:`RankStages`): *warmup* (forwards only), *steady* (one forward,
one backward) and *cooldown* (the remaining backwards). For ``vpp`` > 1 the interleaved order walks micro-batches
in groups of ``pp`` through the chunks (forwards in chunk order, backwards in reverse).

Combined 1F1B (``overlap_moe_expert_parallel_comm``, Megatron's ``combined_1f1b``): each steady step is one
:class:`MergedOp`, the forward of one (micro-batch, chunk) run together with the backward of another, so that
the EP all-to-alls of each run under the other's compute (``executor/ep_overlap.py`` cuts both at their
all-to-alls and zips them). The warmup runs one forward more than plain 1F1B, as Megatron's does, so that the
two halves of every merged op are independent: without it the last pipeline rank would pair a chunk's forward
with the backward of the same micro-batch and chunk. Without a pipeline (pp = 1) the same rule gives
F₀ · [B₀ ‖ F₁] · ... · [B_{m-2} ‖ F_{m-1}] · B_{m-1}. Warmup forwards and cooldown backwards run alone, their
all-to-alls in line. The extra warmup forward keeps one more micro-batch's activations in flight per rank.

The orders are turned into a global table of ticks by simulating them: at every tick each rank runs its
next entry (an operation or a merged pair) if the inputs of all its operations arrived by the previous tick; a
result produced at tick t is exchanged at the end of tick t. Every rank computes the same table, so at each
tick it knows exactly which activations and gradients it sends and receives; all messages of a tick go out as
one ``batch_isend_irecv`` (NCCL's grouped p2p, gloo's send/recv), which matches them pairwise without any
ordering deadlock. Time spent waiting in these exchanges is the pipeline's idle time: the ``pp_bubble`` phase
of the Measurement. No p2p message is in flight during a merged op, so the only collectives it overlaps are
its own EP all-to-alls, issued in the same order on every rank of the EP group (the ranks of one EP group
share their pipeline rank, hence their tick table).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from executor.ep_overlap import Stream, Tape, forward_stream, overlap_driver
from spec.errors import InvalidConfigError


@dataclass(frozen=True)
class Op:
    kind: str  # 'F' or 'B'
    micro: int
    chunk: int  # virtual chunk index on its rank (0..vpp-1)


@dataclass(frozen=True)
class MergedOp:
    """A steady step of combined 1F1B: ``forward`` and ``backward`` (of another micro-batch or chunk) run
    together, each one's EP all-to-alls under the other's compute."""

    forward: Op
    backward: Op


Entry = Op | MergedOp


def ops_of(entry: Entry) -> tuple[Op, ...]:
    """The operations an entry of a rank's order runs (a merged op: its forward, then its backward)."""
    return (entry.forward, entry.backward) if isinstance(entry, MergedOp) else (entry,)


@dataclass(frozen=True)
class RankStages:
    """One pipeline rank's order in Megatron's three stages. ``steady`` alternates forward and backward
    (plain 1F1B) or holds :class:`MergedOp` pairs (combined 1F1B)."""

    warmup: tuple[Entry, ...]
    steady: tuple[Entry, ...]
    cooldown: tuple[Entry, ...]

    def order(self) -> list[Entry]:
        return [*self.warmup, *self.steady, *self.cooldown]


def rank_stages(pp: int, vpp: int, num_micro: int, rank: int, combined: bool = False) -> RankStages:
    """The stages of pipeline rank ``rank`` (1F1B, interleaved when vpp > 1; ``combined``: Megatron's combined
    1F1B of the EP all-to-all overlap, one warmup forward more and the steady pairs merged)."""
    if vpp > 1 and num_micro % pp:
        raise InvalidConfigError(f"[vpp_microbatches] interleaved pipeline (vpp={vpp}) needs micro-batches per "
                                 f"step ({num_micro}) divisible by pp ({pp})")
    total = num_micro * vpp

    def place(k: int, backward: bool) -> Op:
        """The k-th forward (or backward) of the rank: micro-batches in groups of pp through the chunks."""
        chunk = (k // pp) % vpp
        micro = (k // (pp * vpp)) * pp + k % pp
        return Op("B", micro, vpp - 1 - chunk) if backward else Op("F", micro, chunk)

    warmup = pp - rank - 1 if vpp == 1 else (pp - rank - 1) * 2 + (vpp - 1) * pp
    warmup = min(warmup + combined, total)
    steady: list[Entry] = []
    for k in range(total - warmup):
        forward, backward = place(warmup + k, False), place(k, True)
        steady += [MergedOp(forward, backward)] if combined else [forward, backward]
    return RankStages(tuple(place(k, False) for k in range(warmup)), tuple(steady),
                      tuple(place(k, True) for k in range(total - warmup, total)))


def rank_order(pp: int, vpp: int, num_micro: int, rank: int, combined: bool = False) -> list[Entry]:
    """The entries of pipeline rank ``rank`` in execution order (:func:`rank_stages`, flattened)."""
    return rank_stages(pp, vpp, num_micro, rank, combined).order()


@dataclass(frozen=True)
class Message:
    kind: str  # 'F' (activation to the next chunk) or 'B' (gradient to the previous chunk)
    micro: int
    src: int  # pipeline ranks
    dst: int
    dst_chunk: int  # the chunk on ``dst`` that consumes it


@dataclass
class Schedule:
    """``ticks[rank][t]``: the entry rank runs at tick t (or None); ``messages[t]``: exchanged after tick t."""

    pp: int
    vpp: int
    num_micro: int
    ticks: list[list[Entry | None]]
    messages: list[list[Message]]
    combined: bool = False

    def bubble_fraction(self) -> float:
        """Idle ticks over all ticks (every entry, a merged op too, counted as one tick): the schedule's own
        bubble."""
        busy = sum(1 for row in self.ticks for entry in row if entry is not None)
        return 1 - busy / (len(self.ticks) * len(self.ticks[0]))


def build_schedule(pp: int, vpp: int, num_micro: int, combined: bool = False) -> Schedule:
    """Simulate every rank's order into ticks (see the module docstring); ``combined``: combined 1F1B."""
    chunks = pp * vpp  # global chunk g = v·pp + rank
    orders = [rank_order(pp, vpp, num_micro, r, combined) for r in range(pp)]
    ready: dict[tuple[str, int, int], int] = {}  # (kind, micro, global chunk) -> tick its input is available
    position = [0] * pp
    ticks: list[list[Entry | None]] = [[] for _ in range(pp)]
    messages: list[list[Message]] = []

    def can_run(op: Op, g: int, t: int) -> bool:
        if op.kind == "F":
            return g == 0 or ready.get(("F", op.micro, g), t + 1) <= t
        done_forward = ("done", op.micro, g) in ready
        return done_forward and (g == chunks - 1 or ready.get(("B", op.micro, g), t + 1) <= t)

    t = 0
    while any(position[r] < len(orders[r]) for r in range(pp)):
        sent: list[Message] = []
        progressed = False
        for r in range(pp):
            entry = orders[r][position[r]] if position[r] < len(orders[r]) else None
            run = entry is not None and all(can_run(op, op.chunk * pp + r, t) for op in ops_of(entry))
            ticks[r].append(entry if run else None)
            if not run:
                continue
            progressed = True
            position[r] += 1
            for op in ops_of(entry):
                g = op.chunk * pp + r
                if op.kind == "F":
                    ready[("done", op.micro, g)] = t
                    if g + 1 < chunks:
                        nxt = g + 1
                        ready[("F", op.micro, nxt)] = t + 1
                        sent.append(Message("F", op.micro, r, nxt % pp, nxt // pp))
                elif g > 0:
                    prev = g - 1
                    ready[("B", op.micro, prev)] = t + 1
                    sent.append(Message("B", op.micro, r, prev % pp, prev // pp))
        if not progressed:
            raise RuntimeError(f"pipeline schedule pp={pp} vpp={vpp} micro={num_micro} combined={combined} is "
                               f"stuck at tick {t}")
        messages.append(sent)
        t += 1
    return Schedule(pp, vpp, num_micro, ticks, messages, combined)


class _RankRun:
    """This rank's side of a schedule: runs its entries, keeps what each backward needs and what the tick's
    messages carry. ``overlap``: combined 1F1B, every operation cut at its EP all-to-alls
    (``executor/ep_overlap.py``): a forward records a :class:`Tape`, a backward runs it in reverse, and a merged
    op zips the two; ``trace``, when a list, receives the overlap driver's events (tests)."""

    def __init__(self, model, micro: list[tuple[torch.Tensor, torch.Tensor]], overlap: bool, trace: list | None):
        self.model, self.micro, self.num_micro = model, micro, len(micro)
        self.inbox: dict[tuple[str, int, int], torch.Tensor] = {}  # (kind, micro, chunk) -> received tensor
        self.outbox: dict[tuple[str, int], torch.Tensor] = {}  # (kind, micro) -> tensor produced this tick
        self.saved: dict[tuple[int, int], tuple] = {}  # (micro, chunk) -> (input, LossOutput or Tape)
        self.stats = torch.zeros(3, device=model.rope_cos.device)
        self.counts: torch.Tensor | None = None
        self.driver = overlap_driver(model, trace) if overlap else None

    def tag(self, op: Op) -> str:
        """The operation's name in the overlap trace: 'F3', or 'F3.1' for chunk 1 under virtual stages."""
        return f"{op.kind}{op.micro}" + (f".{op.chunk}" if self.model.vpp > 1 else "")

    def run(self, entry: Entry) -> None:
        if self.driver is None:
            if entry.kind == "F":
                self._forward(entry)
            else:
                self._backward(entry)
        elif isinstance(entry, MergedOp):
            # the backward's compute first: its first exchange (the last MoE layer's combine, transposed) then
            # runs under the forward's first attention, as in Megatron's merged layer schedule
            b, f = entry.backward, entry.forward
            self.driver.together(self._backward_stream(b), self.tag(b), self._forward_stream(f), self.tag(f))
        elif entry.kind == "F":
            self.driver.alone(self._forward_stream(entry), self.tag(entry))
        else:
            self.driver.alone(self._backward_stream(entry), self.tag(entry))

    # ---- what every operation does around its compute ----------------------------------------------
    def _input(self, op: Op) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids on the model's first chunk, else the received activations as a leaf; labels)."""
        ids, labels = self.micro[op.micro]
        if self.model.is_first_chunk(op.chunk):
            return ids, labels
        return self.inbox.pop(("F", op.micro, op.chunk)).requires_grad_(), labels

    def _forwarded(self, op: Op, out) -> None:
        self.stats += out.stats() / self.num_micro
        self.counts = self.model.count_routed(self.counts, self.model.chunk_moe_layers(op.chunk))
        if out.hidden is not None:
            self.outbox[("F", op.micro)] = out.hidden.detach()

    def _output_grad(self, op: Op) -> torch.Tensor | None:
        """The gradient of the chunk's output activations (None on the model's last chunk: it ends in the loss)."""
        return None if self.model.is_last_chunk(op.chunk) else self.inbox.pop(("B", op.micro, op.chunk))

    def _backwarded(self, op: Op, x: torch.Tensor) -> None:
        if not self.model.is_first_chunk(op.chunk):
            self.outbox[("B", op.micro)] = x.grad

    # ---- plain 1F1B: one autograd graph per operation ------------------------------------------------
    def _forward(self, op: Op) -> None:
        x, labels = self._input(op)
        # a model whose chunks need more than their input (the vision-language model's micro-batch: its image
        # tokens, its multimodal positions) is told which micro-batch runs
        by_micro = getattr(self.model, "forward_micro_chunk", None)
        out = (by_micro(op.micro, op.chunk, x, labels) if by_micro is not None
               else self.model.forward_chunk(op.chunk, x, labels))
        self.saved[(op.micro, op.chunk)] = (x, out)
        self._forwarded(op, out)

    def _backward(self, op: Op) -> None:
        x, out = self.saved.pop((op.micro, op.chunk))
        grad = self._output_grad(op)
        if grad is None:
            (out.loss / self.num_micro).backward()
        else:
            outputs, grads = [out.hidden], [grad]
            if out.loss.requires_grad:  # router losses (zero and constant in dense-only chunks)
                outputs.append(out.loss / self.num_micro)
                grads.append(torch.ones_like(out.loss))
            torch.autograd.backward(outputs, grads)
        self._backwarded(op, x)

    # ---- combined 1F1B: operations as streams of compute segments between all-to-alls ----------------
    def _forward_stream(self, op: Op) -> Stream:
        x, labels = self._input(op)
        tape = Tape()
        self.saved[(op.micro, op.chunk)] = (x, tape)
        return forward_stream(self.model, op.chunk, x, labels, self.num_micro, tape, self.tag(op),
                              lambda out: self._forwarded(op, out))

    def _backward_stream(self, op: Op) -> Stream:
        x, tape = self.saved.pop((op.micro, op.chunk))
        yield from tape.backward(self.tag(op), self._output_grad(op))
        self._backwarded(op, x)


def run_schedule(model, micro: list[tuple[torch.Tensor, torch.Tensor]], before_last_backward=None,
                 overlap: bool = False, trace: list | None = None) -> tuple:
    """Forward and backward of every micro-batch through this rank's chunks, exchanging with the others.

    Gradients accumulate into the parameters as for ``(loss / len(micro)).backward()`` per micro-batch (in
    that order, per parameter). Returns ([ce, router loss, mtp loss] summed over this rank's chunks and averaged
    over micro-batches, the routed token counts [MoE layers of the model, experts] summed over micro-batches, zero
    in the rows of other stages' layers (or None)).
    ``before_last_backward`` is called before this rank's last backward operation (the last entry of every
    order, never merged: the combined warmup's extra forward leaves the cooldown one backward at least). ``overlap``: combined 1F1B (the EP all-to-all overlap; ``model.options`` sets its SM
    carveout and transport), with any pp, pp = 1 included; ``trace``: its events (:class:`ep_overlap.Overlap`).
    """
    state, timer = model.state, model.timer
    pp = state["pp"]
    schedule = build_schedule(pp.size, model.vpp, len(micro), combined=overlap)
    shape = model.activation_shape(micro[0][0].shape[0])
    device = model.rope_cos.device
    rank = _RankRun(model, micro, overlap, trace)
    row = schedule.ticks[pp.rank]
    last = max(t for t, entry in enumerate(row) if entry is not None)
    for t, entry in enumerate(row):
        if entry is not None:
            if t == last and before_last_backward is not None:
                before_last_backward()
            rank.run(entry)
        _exchange(schedule.messages[t], pp, rank.outbox, rank.inbox, shape, model.dtype, device, timer)
    return rank.stats, rank.counts


def _exchange(messages: list[Message], pp, outbox, inbox, shape, dtype, device, timer) -> None:
    ops = []
    for m in messages:
        if m.src == pp.rank:
            tensor = outbox.pop((m.kind, m.micro)).contiguous()
            ops.append(dist.P2POp(dist.isend, tensor, pp.ranks[m.dst], group=pp.pg))
        if m.dst == pp.rank:
            buffer = torch.empty(shape, dtype=dtype, device=device)
            inbox[(m.kind, m.micro, m.dst_chunk)] = buffer
            ops.append(dist.P2POp(dist.irecv, buffer, pp.ranks[m.src], group=pp.pg))
    if not ops:
        return
    timer.switch("pp_bubble")
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    timer.switch("other")
