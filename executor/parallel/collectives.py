"""Collectives over a :class:`Group` as autograd functions (the backward of each is its transpose).

Tensors are split or joined along dim 0 (tokens or sequence). A group of size one makes every
function the identity, which is what lets the single-process reference run the same code. A group standing
in for its communicator in a one-rank slice (``pg`` is :data:`executor.parallel.groups.SLICE_PEERS`) exchanges
nothing: outputs get their real sizes, integer payloads the values a symmetric world would send
(:class:`executor.parallel.groups.SlicePeers`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from executor.parallel.groups import Group, SlicePeers

# torch 2.13 renames the tensor collectives (*_single); 2.11 on the GPU machine has only the old names.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _slice(group: Group) -> bool:
    """Whether ``group`` stands in for its communicator in a one-rank slice (nothing is exchanged)."""
    return isinstance(group.pg, SlicePeers)


def _stand_in(out: torch.Tensor) -> None:
    """A slice's floating-point output, zero-filled: uninitialised memory may hold NaN (a router's top-k over NaN
    scores picks no expert, and its counting kernel writes out of bounds) or, on the CPU, denormal numbers that
    slow its arithmetic a hundredfold. The fill is one memset, which the real exchange does not cost."""
    out.zero_()


def _gather(x: torch.Tensor, group: Group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((group.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    if not _slice(group):
        all_gather_tensor(out, x, group=group.pg)
    elif not x.is_floating_point():  # every member sent what this one did
        out.view(group.size, *x.shape).copy_(x.unsqueeze(0).expand(group.size, *x.shape))
    else:
        _stand_in(out)
    return out


def _reduce_scatter(x: torch.Tensor, group: Group) -> torch.Tensor:
    if x.shape[0] % group.size:
        raise ValueError(f"reduce-scatter over {group.name}: dim 0 ({x.shape[0]}) not divisible by {group.size}")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // group.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    if not _slice(group):
        reduce_scatter_tensor(out, x, group=group.pg)
    elif not x.is_floating_point():  # every member's segment summed: this one's, size times
        out.copy_(x.view(group.size, *out.shape)[group.rank] * group.size)
    else:
        _stand_in(out)
    return out


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((sum(out_splits), *x.shape[1:]), dtype=x.dtype, device=x.device)
    if not _slice(group):
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group.pg)
    elif not x.is_floating_point() and all(n == in_splits[group.rank] for n in out_splits):
        # every member sends this one what this one sends itself (the routing counts' exchange)
        mine = torch.split(x, list(in_splits))[group.rank]
        out.view(group.size, *mine.shape).copy_(mine.unsqueeze(0).expand(group.size, *mine.shape))
    elif x.is_floating_point():
        _stand_in(out)
    return out


def _all_reduce_in_place(x: torch.Tensor, group: Group, op=dist.ReduceOp.SUM) -> None:
    if not _slice(group):
        dist.all_reduce(x, op=op, group=group.pg)
    elif not x.is_floating_point() and op == dist.ReduceOp.SUM:  # max and min of equal members: this one's
        x.mul_(group.size)


def _gather_v(x: torch.Tensor, counts: list[int], group: Group) -> torch.Tensor:
    """Concatenate every member's ``x`` (``counts[i]`` rows on member i) along dim 0."""
    longest = max(counts)
    padded = x.new_zeros((longest, *x.shape[1:]))
    padded[: x.shape[0]] = x
    everything = _gather(padded, group).view(group.size, longest, *x.shape[1:])
    return torch.cat([everything[i, :c] for i, c in enumerate(counts)])


def _reduce_scatter_v(x: torch.Tensor, counts: list[int], group: Group) -> torch.Tensor:
    """Sum ``x`` (segments of ``counts`` rows, one per member) over the group; keep this member's segment."""
    longest = max(counts)
    padded = x.new_zeros((group.size, longest, *x.shape[1:]))
    for i, segment in enumerate(torch.split(x, counts)):
        padded[i, : counts[i]] = segment
    return _reduce_scatter(padded.view(group.size * longest, *x.shape[1:]), group)[: counts[group.rank]]


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group), None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        _all_reduce_in_place(x, group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.args = (in_splits, out_splits, group)
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits, group = ctx.args
        return _all_to_all(grad, in_splits, out_splits, group), None, None, None


class _AllGatherV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, group):
        ctx.args = (counts, group)
        return _gather_v(x, counts, group)

    @staticmethod
    def backward(ctx, grad):
        counts, group = ctx.args
        return _reduce_scatter_v(grad, counts, group), None, None


class _ReduceScatterV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, group):
        ctx.args = (counts, group)
        return _reduce_scatter_v(x, counts, group)

    @staticmethod
    def backward(ctx, grad):
        counts, group = ctx.args
        return _gather_v(grad, counts, group), None, None


def all_gather(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenate the members' ``x`` along dim 0 (backward: reduce-scatter of the gradient)."""
    return x if group.size == 1 else _AllGather.apply(x, group)


def reduce_scatter(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum ``x`` over the group and keep this member's 1/size slice of dim 0 (backward: all-gather)."""
    return x if group.size == 1 else _ReduceScatter.apply(x, group)


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum ``x`` over the group; the gradient passes through unchanged (each member owns its term)."""
    return x if group.size == 1 else _AllReduce.apply(x, group)


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group) -> torch.Tensor:
    """Send ``in_splits[i]`` rows of ``x`` to member i, receive ``out_splits[i]`` rows from member i."""
    return x if group.size == 1 else _AllToAll.apply(x, list(out_splits), list(in_splits), group)


def all_gather_v(x: torch.Tensor, counts: list[int], group: Group) -> torch.Tensor:
    """Uneven all-gather along dim 0: member i contributes ``counts[i]`` rows."""
    return x if group.size == 1 else _AllGatherV.apply(x, list(counts), group)


def reduce_scatter_v(x: torch.Tensor, counts: list[int], group: Group) -> torch.Tensor:
    """Uneven reduce-scatter: sum over the group, member i keeps the i-th segment of ``counts[i]`` rows."""
    return x if group.size == 1 else _ReduceScatterV.apply(x, list(counts), group)


def all_reduce_(x: torch.Tensor, group: Group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce without autograd (statistics, gradients)."""
    if group.size > 1:
        _all_reduce_in_place(x, group, op)
    return x


def all_gather_nograd(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather along dim 0 without autograd."""
    return x if group.size == 1 else _gather(x, group)


def all_to_all_start(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group,
                     after: torch.cuda.Event | None = None):
    """Start :func:`all_to_all` without autograd and return (output buffer, work handle): the exchange runs
    on the backend's own stream (NCCL) or thread (gloo) while the caller goes on issuing compute; call
    ``work.wait()`` before reading the buffer (on CUDA it makes the current stream wait, not the host).
    The work is None for a group of one (the output is ``x``).

    The exchange waits for everything queued on the current stream (NCCL's rule), unless ``after`` (a CUDA
    event recorded when ``x`` was complete) is given: then it waits for that event only, through a side
    stream, so that compute the caller queued after the event (another micro-batch's) runs beside it instead
    of before it."""
    if group.size == 1:
        return x, None
    if _slice(group):  # nothing in flight: the output is ready (sized as the exchange's)
        return _all_to_all(x, out_splits, in_splits, group), None
    if after is None:
        x = x.contiguous()
        # allocated on the current stream, the one that reads it after wait(): the allocator ties it there
        out = torch.empty((sum(out_splits), *x.shape[1:]), dtype=x.dtype, device=x.device)
        work = dist.all_to_all_single(out, x, list(out_splits), list(in_splits), group=group.pg, async_op=True)
        return out, work
    current = _current_stream(x.device)
    if not x.is_contiguous():  # the copy is queued after ``after``: the exchange must wait for it instead
        x = x.contiguous()
        after = current.record_event()
    side = _side_stream(x.device)
    side.wait_event(after)
    with torch.cuda.stream(side):  # the backend's stream waits for ``side``: for ``after`` only
        # The output is allocated on the side stream: a block the allocator hands out on the current stream
        # may still be read by kernels queued there after ``after``, which the exchange does not wait for
        # (on 2 x H200 the overlapped step's losses were 2 % off the in-line run's with the buffer on the
        # current stream, 1.3e-4 with it here).
        out = torch.empty((sum(out_splits), *x.shape[1:]), dtype=x.dtype, device=x.device)
        work = dist.all_to_all_single(out, x, list(out_splits), list(in_splits), group=group.pg, async_op=True)
    _record_stream(out, current)  # read there after wait(): not reused by the side stream before that
    return out, work


class _AllToAllStarted(torch.autograd.Function):
    """:func:`all_to_all_start` as an autograd node: forward starts the exchange into the buffer it returns
    (``pending.work`` set; the buffer is not ready before ``work.wait()``), backward sends the gradient back
    by the transposed exchange, in line."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, pending):
        ctx.args = (in_splits, out_splits, group)
        out, pending.work = all_to_all_start(x, out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits, group = ctx.args
        return _all_to_all(grad.contiguous(), in_splits, out_splits, group), None, None, None, None


class PendingCollective:
    """A collective in flight, with autograd (:func:`all_to_all_async`, :func:`all_gather_async`,
    :func:`reduce_scatter_async`): :meth:`wait` gives its output."""

    def __init__(self) -> None:
        self.work = None
        self.out: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        """The exchanged rows, once they have arrived (on CUDA the current stream waits, not the host)."""
        if self.work is not None:
            # gloo finishes some collectives (reduce-scatter) with a copy into the output: not a step of the graph
            with torch.no_grad():
                self.work.wait()
            self.work = None
        return self.out


def all_to_all_async(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group) -> PendingCollective:
    """Start :func:`all_to_all` (same arguments, same result, same gradient) and return before it completes, so
    that the caller can issue independent work beside it; its output comes from ``PendingCollective.wait()``."""
    pending = PendingCollective()
    if group.size == 1:
        pending.out = x
    else:
        pending.out = _AllToAllStarted.apply(x, list(out_splits), list(in_splits), group, pending)
    return pending


class _AllGatherStarted(torch.autograd.Function):
    """An all-gather along dim 0 started in forward (``pending.work``; the buffer is not ready before its wait);
    backward reduce-scatters the gradient in line."""

    @staticmethod
    def forward(ctx, x, group, pending):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty((group.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        if _slice(group):
            _stand_in(out)
        else:
            pending.work = all_gather_tensor(out, x, group=group.pg, async_op=True)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group), None, None


class _ReduceScatterStarted(torch.autograd.Function):
    """A reduce-scatter along dim 0 started in forward (``pending.work``); backward all-gathers the gradient in
    line."""

    @staticmethod
    def forward(ctx, x, group, pending):
        ctx.group = group
        if x.shape[0] % group.size:
            raise ValueError(f"reduce-scatter over {group.name}: dim 0 ({x.shape[0]}) not divisible by {group.size}")
        x = x.contiguous()
        out = torch.empty((x.shape[0] // group.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        if _slice(group):
            _stand_in(out)
        else:
            pending.work = reduce_scatter_tensor(out, x, group=group.pg, async_op=True)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group), None, None


def all_gather_async(x: torch.Tensor, group: Group) -> PendingCollective:
    """Start :func:`all_gather` (same result, same gradient) and return before it completes; its output comes
    from ``wait()``."""
    pending = PendingCollective()
    pending.out = x if group.size == 1 else _AllGatherStarted.apply(x, group, pending)
    return pending


def reduce_scatter_async(x: torch.Tensor, group: Group) -> PendingCollective:
    """Start :func:`reduce_scatter` (same result, same gradient) and return before it completes; its output
    comes from ``wait()``."""
    pending = PendingCollective()
    pending.out = x if group.size == 1 else _ReduceScatterStarted.apply(x, group, pending)
    return pending


def _current_stream(device: torch.device):
    return torch.cuda.current_stream(device)


def _record_stream(t: torch.Tensor, stream) -> None:
    t.record_stream(stream)


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One stream per device on which :func:`all_to_all_start` issues exchanges that wait for an event."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]
