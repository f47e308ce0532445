"""Gradient reduction across replicas, in flat buckets, optionally overlapped with the backward pass.

- ``tp_partial`` parameters (norms, router, ...; replicated over TP but fed sequence-sharded input) are
  summed over TP.
- Dense gradients are averaged over DP (the next issue makes this DP·CP).
- Expert gradients are summed over EDP and divided by DP: every expert replica already holds the sum over
  the tokens of the ep·etp ranks it serves, so the sum over EDP covers all DP replicas once.
All three are sums, so their order does not matter. Buckets hold at most ``bucket_bytes`` of gradients of one
dtype, in reverse parameter order (the order the backward pass produces them); each is one all-reduce.

With ``sharded`` (the distributed optimizer, ZeRO-1) each DP/EDP bucket is instead reduce-scattered: the
bucket's flat gradient, padded to a multiple of the group size, is summed over the group and this rank keeps
its contiguous 1/size shard (``entry.shards[i]``), which is all its optimizer shard needs. The TP sum of
``tp_partial`` gradients is then applied to the shard (the bucket layout is identical on every TP rank).
The gradient read is ``param.main_grad`` when the optimizer keeps fp32 main gradients, else ``param.grad``.

Gradient buffers (``main_grads=True``, Megatron's recipe for 16-bit parameters): every bucket of bf16/fp16
parameters owns one contiguous fp32 buffer (padded to a multiple of the sharding group's size) and each
parameter's ``main_grad`` is a view into it, in bucket order. The bucket is then reduced where it lies: the
all-reduce runs in place on the buffer, the reduce-scatter reads the buffer into the bucket's 1/size shard
(allocated once, then rewritten every step), and over a group of one the shard *is* the buffer. fp32 parameters keep ``.grad`` as their main gradient; their
buckets (and the TP-only bucket of ``tp_partial`` parameters) are still flattened into a copy per reduction.
The buffers are not zero-filled between steps: the optimizer's ``zero_grad`` marks every main grad stale, the
step's first gradient is then written into it (:func:`mark_main_grads_stale`), and :meth:`GradReducer.reduce`
zeroes those no backward reached before anything reads them (:func:`settle_main_grads`).

With ``overlap`` (ParallelConfig.overlap_grad_reduce), :meth:`GradReducer.arm` before the last micro-batch's
backward makes each DP/EDP bucket start an asynchronous all-reduce as soon as all its gradients are final;
buckets start strictly in bucket order, so every rank issues the same collectives in the same order.
:meth:`GradReducer.reduce` then waits for them and does what is left (the TP sums).

Parameters held on both the first and the last pipeline stage (``ShardInfo.pp_shared``: the word embedding
under MTP or tied output weights, Megatron's embedding group) first sum their local gradients over the
embedding group (first and last stage of this pipeline), then reduce over DP like any dense parameter: both
sums commute, and summing before the DP reduction works alike for the all-reduce and the reduce-scatter.
They sit in their own last dense bucket, which never starts during the backward (the other stage's part is
not there yet): :meth:`GradReducer.reduce` syncs them, then reduces that bucket.
"""

from __future__ import annotations

import weakref
from collections import defaultdict

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from executor.kernels.triton_grad_accumulate import accumulate_main_grad_, copy_main_grad_
from executor.parallel.collectives import reduce_scatter_tensor, all_gather_nograd, all_reduce_
from executor.parallel.groups import EMBEDDING_GROUP, Group, ParallelState


def grad_of(p: torch.nn.Parameter) -> torch.Tensor | None:
    """The gradient the reduction and the optimizer read: fp32 ``main_grad`` when kept, else ``.grad``."""
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def grad_or_zeros(p: torch.nn.Parameter) -> torch.Tensor:
    """``p``'s gradient (:func:`grad_of`: its main_grad where it has one), or zeros of its shape before any."""
    g = grad_of(p)
    return g if g is not None else torch.zeros_like(p)


def padded_numel(bucket: list[torch.nn.Parameter], size: int) -> int:
    """Elements of a bucket's flat buffer, padded so it splits into ``size`` equal shards."""
    n = sum(p.numel() for p in bucket)
    return -(-n // size) * size


def _accumulate(param: torch.nn.Parameter) -> None:
    if getattr(param, "_main_grad_stale", False):
        # the step's first gradient: written, not added to a zero-filled buffer (no fill, no fp32 read;
        # 0 + g is g exactly, so the sums are bitwise those of the fill-and-add)
        copy_main_grad_(param.main_grad, param.grad)
        param._main_grad_stale = False
    else:
        # main_grad += grad: the vectorised Triton kernel on CUDA (bitwise torch's add_, checked on first use),
        # torch's add_ elsewhere; torch's mixed-dtype add runs at about half the HBM rate (docs/benchmarks.md).
        accumulate_main_grad_(param.main_grad, param.grad)
    param.grad = None


def mark_main_grads_stale(params) -> None:
    """Start a step without zero-filling the fp32 main gradients: each one's next accumulation writes the
    gradient instead of adding it (saving a fill and a read of 4 bytes per parameter). Whatever reads main
    gradients calls :func:`settle_main_grads` first, which zeroes those no backward has written since."""
    for p in params:
        if getattr(p, "main_grad", None) is not None:
            p._main_grad_stale = True


def settle_main_grads(params) -> None:
    """Zero the main gradients still marked stale (:func:`mark_main_grads_stale`): their parameters got no
    gradient this step, and the reduction, the norm and the optimizer must read zeros there."""
    for p in params:
        if getattr(p, "_main_grad_stale", False):
            p.main_grad.zero_()
            p._main_grad_stale = False


def attach_main_grads(params: list[torch.nn.Parameter], buffer: torch.Tensor | None = None) -> None:
    """fp32 gradient accumulation for 16-bit parameters: a ``main_grad`` each, into which a post-accumulate
    hook adds (and then frees) every ``.grad``. Call before any other grad hook, which must see the sum.

    ``buffer``: an fp32 tensor of at least the parameters' total elements; the main grads become consecutive
    views of it, in ``params`` order (:class:`GradReducer` passes each bucket's buffer). None: each parameter
    gets its own zeroed tensor. fp32 parameters and frozen ones are skipped: ``.grad`` is their main gradient.
    """
    offset = 0
    for p in params:
        if p.dtype == torch.float32 or not p.requires_grad:
            continue
        if getattr(p, "main_grad", None) is not None:
            raise RuntimeError("main_grad attached twice: its accumulation hook would run twice")
        if buffer is None:
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        else:
            p.main_grad = buffer[offset: offset + p.numel()].view(p.shape)
            offset += p.numel()
        p.register_post_accumulate_grad_hook(_accumulate)


def _grad_buffer(bucket: list[torch.nn.Parameter], size: int) -> torch.Tensor | None:
    """The zeroed fp32 buffer of a bucket of 16-bit parameters, padded to ``size`` shards, with the bucket's
    main grads attached as views (None for fp32 buckets)."""
    if bucket[0].dtype == torch.float32:
        return None
    buffer = torch.zeros(padded_numel(bucket, size), dtype=torch.float32, device=bucket[0].device)
    attach_main_grads(bucket, buffer)
    return buffer


def _buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    by_dtype: dict[torch.dtype, list] = defaultdict(list)
    for p in reversed(params):
        by_dtype[p.dtype].append(p)
    out = []
    for group in by_dtype.values():
        bucket, size = [], 0
        for p in group:
            nbytes = p.numel() * p.element_size()
            if bucket and size + nbytes > bucket_bytes:
                out.append(bucket)
                bucket, size = [], 0
            bucket.append(p)
            size += nbytes
        if bucket:
            out.append(bucket)
    return out


class _Entry:
    """One reduction: a group, a scale and its buckets; tracks overlapped launches.

    ``buffers[i]``: bucket i's fp32 gradient buffer (its main grads are views of it), or None where the
    bucket's gradients are separate tensors and each reduction flattens them into a copy.
    """

    def __init__(self, group: Group, scale: float, buckets: list[list[torch.nn.Parameter]], sharded: bool = False,
                 tp: Group | None = None, buffers: list[torch.Tensor | None] | None = None):
        self.group, self.scale, self.buckets, self.sharded = group, scale, buckets, sharded
        self.buffers = buffers if buffers is not None else [None] * len(buckets)
        self.shards: list[torch.Tensor | None] = [None] * len(buckets)
        # Sharded buckets: positions (inside this rank's shard) of tp_partial elements, summed over TP afterwards.
        self.tp, self.tp_index = tp, [None] * len(buckets)
        if sharded and tp is not None and tp.size > 1:
            for i, bucket in enumerate(buckets):
                mask = torch.cat([torch.full((p.numel(),), bool(p.shard_info.tp_partial), device=p.device)
                                  for p in bucket])
                full = torch.zeros(padded_numel(bucket, group.size), dtype=torch.bool, device=mask.device)
                full[: mask.numel()] = mask
                index = full.chunk(group.size)[group.rank].nonzero().squeeze(1)
                self.tp_index[i] = index if index.numel() else None
        self.reset()

    def reset(self) -> None:
        self.missing = [len(b) for b in self.buckets]
        self.next = 0
        self.pending: list[tuple[object, torch.Tensor, int]] = []  # (work, reduced tensor, bucket index)

    def launch(self, index: int, async_op: bool):
        bucket, flat = self.buckets[index], self.buffers[index]
        if flat is None:
            flat = _flatten_dense_tensors([grad_or_zeros(p) for p in bucket])
        work = None
        if self.sharded:
            size = self.group.size
            if flat.numel() % size:  # only a flattened copy: buffers are padded already
                flat = torch.cat([flat, flat.new_zeros(padded_numel(bucket, size) - flat.numel())])
            if size > 1:
                # the previous step's shard (kept for the optimizer, read before this backward) takes the new
                # result: a fresh one per step would hold two copies of every shard while the reductions run
                shard = self.shards[index]
                if shard is None:  # the first step (a bucket's size and dtype never change)
                    shard = flat.new_empty(flat.numel() // size)
                work = reduce_scatter_tensor(shard, flat, group=self.group.pg, async_op=async_op)
                flat = shard
            # a group of one: the shard is the (padded) bucket itself, a view of its buffer when it has one
            self.pending.append((work, flat, index))
            return
        if self.group.size > 1:  # a group of one (edp=1 while dp>1) only needs the scale
            work = dist.all_reduce(flat, group=self.group.pg, async_op=async_op)
        self.pending.append((work, flat, index))

    def launch_ready(self) -> None:
        while self.next < len(self.buckets) and self.missing[self.next] == 0:
            self.launch(self.next, async_op=True)
            self.next += 1

    def finish(self) -> None:
        for index in range(self.next, len(self.buckets)):
            self.launch(index, async_op=False)
        for work, flat, index in self.pending:
            if work is not None:
                work.wait()
            if self.scale != 1.0:
                flat.mul_(self.scale)
            if self.sharded:
                partial = self.tp_index[index]
                if partial is not None:
                    flat[partial] = all_reduce_(flat[partial], self.tp)
                self.shards[index] = flat
                continue
            if self.buffers[index] is not None:  # reduced in place: the main grads are views of it
                continue
            bucket = self.buckets[index]
            for p, g in zip(bucket, _unflatten_dense_tensors(flat, [grad_or_zeros(p) for p in bucket])):
                target = grad_of(p)
                if target is None:
                    p.grad = g.clone()
                else:
                    target.copy_(g)
        self.reset()

    def materialize(self) -> None:
        """Sharded entries: all-gather the reduced shards back into every gradient (verification only)."""
        if not self.sharded:
            return
        for bucket, buffer, shard in zip(self.buckets, self.buffers, self.shards):
            flat = all_gather_nograd(shard, self.group)
            if buffer is not None:
                if flat.data_ptr() != buffer.data_ptr():  # a group of one: the shard is the buffer already
                    buffer.copy_(flat)
                continue
            for p, g in zip(bucket, _unflatten_dense_tensors(flat[: sum(q.numel() for q in bucket)],
                                                             [grad_or_zeros(q) for q in bucket])):
                target = grad_of(p)
                if target is None:
                    p.grad = g.clone().to(p.dtype)
                else:
                    target.copy_(g)


class GradReducer:
    """Reduces ``.grad`` of a model's parameters after backward; build once, call :meth:`reduce` per step.

    ``main_grads``: give every 16-bit parameter an fp32 ``main_grad`` as a view of its bucket's gradient buffer
    (see the module docstring), accumulated by a hook registered before this reducer's own. This is the one
    place main grads are made for training; :attr:`buckets` lists every bucket with its buffer (None: fp32, or
    ``main_grads`` off), including buckets no reduction needs (world size 1, not sharded).
    """

    def __init__(self, model: torch.nn.Module, state: ParallelState, bucket_mb: float = 25.0,
                 overlap: bool = False, sharded: bool = False, main_grads: bool = False):
        self.state, self.sharded = state, sharded
        params = [p for p in model.parameters() if p.requires_grad]
        self.params = params
        bucket_bytes = int(bucket_mb * 2**20)
        dp = state["dp_cp"]
        self.entries: list[_Entry] = []
        self.buckets: list[tuple[list[torch.nn.Parameter], torch.Tensor | None]] = []
        dense = [p for p in params if not p.shard_info.expert]
        expert = [p for p in params if p.shard_info.expert]
        self.pp_shared = [p for p in params if p.shard_info.pp_shared]
        self.embedding_group = state.groups.get(EMBEDDING_GROUP) if self.pp_shared else None
        for group, kind, reduce in ((dp, dense, dp.size > 1 or sharded),
                                    (state.edp, expert, state.edp.size > 1 or dp.size > 1 or sharded)):
            if not kind:
                continue
            own = [p for p in kind if not p.shard_info.pp_shared]
            shared = [p for p in kind if p.shard_info.pp_shared]
            buckets = (_buckets(own, bucket_bytes) if own else []) + (_buckets(shared, bucket_bytes) if shared else [])
            size = group.size if sharded else 1  # a sharded bucket splits into equal shards
            buffers = [_grad_buffer(b, size) if main_grads else None for b in buckets]
            self.buckets += list(zip(buckets, buffers))
            # Sharded: every parameter sits in exactly one entry (even over a group of one): its optimizer shard.
            if reduce:
                self.entries.append(_Entry(group, 1.0 / dp.size, buckets, sharded, state.tp, buffers))
        tp_partial = [p for p in params if p.shard_info.tp_partial]
        self.tp_entry = _Entry(state.tp, 1.0, _buckets(tp_partial, bucket_bytes)) \
            if state.tp.size > 1 and tp_partial and not sharded else None
        self.overlap = overlap and bool(self.entries)
        self.armed = False
        if self.overlap:
            for entry in self.entries:
                for index, bucket in enumerate(entry.buckets):
                    if any(p.shard_info.pp_shared for p in bucket):
                        continue  # launched by reduce(), after the embedding-group sum
                    for p in bucket:
                        p.register_post_accumulate_grad_hook(self._hook(entry, index))

    def _hook(self, entry: _Entry, index: int):
        # The hook lives in the parameter's hook dict, which the tensor holds from C++: a closure holding the
        # reducer and its entry (which holds the parameters) strongly would make a cycle the garbage collector
        # cannot see, and keep every parameter and fp32 gradient buffer of a trial alive in a kept rank.
        reducer, entry_ref = weakref.ref(self), weakref.ref(entry)

        def on_grad(_param):
            owner, live = reducer(), entry_ref()
            if owner is not None and live is not None and owner.armed:
                live.missing[index] -= 1
                if live.missing[index] == 0:
                    live.launch_ready()
        return on_grad

    def arm(self) -> None:
        """Call before the backward of the step's last micro-batch: its final gradients start reducing."""
        if self.overlap:
            for entry in self.entries:
                entry.reset()
            self.armed = True

    @torch.no_grad()
    def reduce(self) -> None:
        """Finish (or run) every reduction; afterwards each gradient (``main_grad`` or ``.grad``) holds the
        reduced gradient, or with ``sharded`` each entry's ``shards`` hold this rank's slice of it."""
        self.armed = False
        settle_main_grads(self.params)
        self._sum_pp_shared()
        for entry in self.entries:
            entry.finish()
        if self.tp_entry is not None:
            self.tp_entry.finish()

    def _sum_pp_shared(self) -> None:
        """Sum the gradients of the first and last stage's copies of a shared parameter (embedding group)."""
        group = self.embedding_group
        if group is None or group.size == 1:
            return
        for p in self.pp_shared:
            if grad_of(p) is None:  # this stage's copy saw no use this step: its part is zero
                p.grad = torch.zeros_like(p)
            all_reduce_(grad_of(p), group)

    @torch.no_grad()
    def materialize(self) -> None:
        """After :meth:`reduce` with ``sharded``: make every gradient whole again (for checks, not training)."""
        for entry in self.entries:
            entry.materialize()
