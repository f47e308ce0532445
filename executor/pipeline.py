"""Pipeline schedules (1F1B and interleaved virtual stages) and their execution with p2p messages.

Each pipeline rank runs its operations — forward ``F`` or backward ``B`` of (micro-batch, virtual chunk) —
in Megatron's order: warm-up forwards, then one forward one backward, then the remaining backwards. For
``vpp`` > 1 the interleaved order walks micro-batches in groups of ``pp`` through the chunks (forwards in
chunk order, backwards in reverse).

The orders are turned into a global table of ticks by simulating them: at every tick each rank runs its
next operation if its input arrived by the previous tick; a result produced at tick t is exchanged at the
end of tick t. Every rank computes the same table, so at each tick it knows exactly which activations and
gradients it sends and receives; all messages of a tick go out as one ``batch_isend_irecv`` (NCCL's grouped
p2p, gloo's send/recv), which matches them pairwise without any ordering deadlock. Time spent waiting in
these exchanges is the pipeline's idle time: the ``pp_bubble`` phase of the Measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from spec.errors import InvalidConfigError


@dataclass(frozen=True)
class Op:
    kind: str  # 'F' or 'B'
    micro: int
    chunk: int  # virtual chunk index on its rank (0..vpp-1)


def rank_order(pp: int, vpp: int, num_micro: int, rank: int) -> list[Op]:
    """The operations of pipeline rank ``rank`` in execution order (1F1B, interleaved when vpp > 1)."""
    if vpp == 1:
        warmup = min(pp - rank - 1, num_micro)
        ops = [Op("F", m, 0) for m in range(warmup)]
        for i in range(num_micro - warmup):
            ops += [Op("F", warmup + i, 0), Op("B", i, 0)]
        return ops + [Op("B", m, 0) for m in range(num_micro - warmup, num_micro)]
    if num_micro % pp:
        raise InvalidConfigError(f"[vpp_microbatches] interleaved pipeline (vpp={vpp}) needs micro-batches per "
                                 f"step ({num_micro}) divisible by pp ({pp})")
    total = num_micro * vpp

    def place(k: int, backward: bool) -> Op:
        chunk = (k // pp) % vpp
        micro = (k // (pp * vpp)) * pp + k % pp
        return Op("B", micro, vpp - 1 - chunk) if backward else Op("F", micro, chunk)

    warmup = min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
    ops = [place(k, False) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [place(warmup + k, False), place(k, True)]
    return ops + [place(k, True) for k in range(total - warmup, total)]


@dataclass(frozen=True)
class Message:
    kind: str  # 'F' (activation to the next chunk) or 'B' (gradient to the previous chunk)
    micro: int
    src: int  # pipeline ranks
    dst: int
    dst_chunk: int  # the chunk on ``dst`` that consumes it


@dataclass
class Schedule:
    """``ticks[rank][t]``: the op rank runs at tick t (or None); ``messages[t]``: exchanged after tick t."""

    pp: int
    vpp: int
    num_micro: int
    ticks: list[list[Op | None]]
    messages: list[list[Message]]

    def bubble_fraction(self) -> float:
        """Idle ticks over all ticks (every operation counted as one tick): the schedule's own bubble."""
        busy = sum(1 for row in self.ticks for op in row if op is not None)
        return 1 - busy / (len(self.ticks) * len(self.ticks[0]))


def build_schedule(pp: int, vpp: int, num_micro: int) -> Schedule:
    """Simulate every rank's order into ticks (see the module docstring)."""
    chunks = pp * vpp  # global chunk g = v·pp + rank
    orders = [rank_order(pp, vpp, num_micro, r) for r in range(pp)]
    ready: dict[tuple[str, int, int], int] = {}  # (kind, micro, global chunk) -> tick its input is available
    position = [0] * pp
    ticks: list[list[Op | None]] = [[] for _ in range(pp)]
    messages: list[list[Message]] = []
    t = 0
    while any(position[r] < len(orders[r]) for r in range(pp)):
        sent: list[Message] = []
        progressed = False
        for r in range(pp):
            op = orders[r][position[r]] if position[r] < len(orders[r]) else None
            run = False
            if op is not None:
                g = op.chunk * pp + r
                if op.kind == "F":
                    run = g == 0 or ready.get(("F", op.micro, g), t + 1) <= t
                else:
                    done_forward = ("done", op.micro, g) in ready
                    run = done_forward and (g == chunks - 1 or ready.get(("B", op.micro, g), t + 1) <= t)
            ticks[r].append(op if run else None)
            if not run:
                continue
            progressed = True
            position[r] += 1
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
            raise RuntimeError(f"pipeline schedule pp={pp} vpp={vpp} micro={num_micro} is stuck at tick {t}")
        messages.append(sent)
        t += 1
    return Schedule(pp, vpp, num_micro, ticks, messages)


def run_schedule(model, micro: list[tuple[torch.Tensor, torch.Tensor]], before_last_backward=None) -> tuple:
    """Forward and backward of every micro-batch through this rank's chunks, exchanging with the others.

    Gradients accumulate into the parameters as for ``(loss / len(micro)).backward()`` per micro-batch.
    Returns ([ce, router loss, mtp loss] summed over this rank's chunks and averaged over micro-batches, the
    routed token counts [MoE layers of the model, experts] summed over micro-batches, zero in the rows of other
    stages' layers (or None)).
    ``before_last_backward`` is called before this rank's last backward operation.
    """
    state, timer = model.state, model.timer
    pp = state["pp"]
    num_micro = len(micro)
    schedule = build_schedule(pp.size, model.vpp, num_micro)
    mbs = micro[0][0].shape[0]
    shape = model.activation_shape(mbs)
    device = model.rope_cos.device
    inbox: dict[tuple[str, int, int], torch.Tensor] = {}  # (kind, micro, chunk) -> received tensor
    saved: dict[tuple[int, int], tuple] = {}  # (micro, chunk) -> (input, output)
    outbox: dict[tuple[str, int], torch.Tensor] = {}  # (kind, micro) -> tensor produced this tick
    stats = torch.zeros(3, device=device)
    counts = None
    my_ops = [op for op in schedule.ticks[pp.rank] if op is not None]
    last_backward = max(i for i, op in enumerate(my_ops) if op.kind == "B")
    done = 0
    for t, op in enumerate(schedule.ticks[pp.rank]):
        if op is not None:
            ids, labels = micro[op.micro]
            if op.kind == "F":
                if model.is_first_chunk(op.chunk):
                    x = ids
                else:
                    x = inbox.pop(("F", op.micro, op.chunk)).requires_grad_()
                out = model.forward_chunk(op.chunk, x, labels)
                saved[(op.micro, op.chunk)] = (x, out)
                stats += out.stats() / num_micro
                counts = model.count_routed(counts, model.chunk_moe_layers(op.chunk))
                if out.hidden is not None:
                    outbox[("F", op.micro)] = out.hidden.detach()
            else:
                if done == last_backward and before_last_backward is not None:
                    before_last_backward()
                x, out = saved.pop((op.micro, op.chunk))
                if out.hidden is None:
                    (out.loss / num_micro).backward()
                else:
                    grad = inbox.pop(("B", op.micro, op.chunk))
                    outputs, grads = [out.hidden], [grad]
                    if out.loss.requires_grad:  # router losses (zero and constant in dense-only chunks)
                        outputs.append(out.loss / num_micro)
                        grads.append(torch.ones_like(out.loss))
                    torch.autograd.backward(outputs, grads)
                if not model.is_first_chunk(op.chunk):
                    outbox[("B", op.micro)] = x.grad
            done += 1
        _exchange(schedule.messages[t], pp, outbox, inbox, shape, model.dtype, device, timer)
    return stats, counts


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
