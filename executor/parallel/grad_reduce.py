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

With ``overlap`` (ParallelConfig.overlap_grad_reduce), :meth:`GradReducer.arm` before the last micro-batch's
backward makes each DP/EDP bucket start an asynchronous all-reduce as soon as all its gradients are final;
buckets start strictly in bucket order, so every rank issues the same collectives in the same order.
:meth:`GradReducer.reduce` then waits for them and does what is left (the TP sums).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from executor.parallel.collectives import _reduce_scatter_tensor, all_gather_nograd, all_reduce_
from executor.parallel.groups import Group, ParallelState


def grad_of(p: torch.nn.Parameter) -> torch.Tensor | None:
    """The gradient the reduction and the optimizer read: fp32 ``main_grad`` when kept, else ``.grad``."""
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def _grad_or_zeros(p: torch.nn.Parameter) -> torch.Tensor:
    g = grad_of(p)
    return g if g is not None else torch.zeros_like(p)


def padded_numel(bucket: list[torch.nn.Parameter], size: int) -> int:
    """Elements of a bucket's flat buffer, padded so it splits into ``size`` equal shards."""
    n = sum(p.numel() for p in bucket)
    return -(-n // size) * size


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
    """One reduction: a group, a scale and its buckets; tracks overlapped launches."""

    def __init__(self, group: Group, scale: float, buckets: list[list[torch.nn.Parameter]], sharded: bool = False,
                 tp: Group | None = None):
        self.group, self.scale, self.buckets, self.sharded = group, scale, buckets, sharded
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
        self.pending: list[tuple[object, torch.Tensor, list[torch.nn.Parameter]]] = []

    def launch(self, index: int, async_op: bool):
        bucket = self.buckets[index]
        flat = _flatten_dense_tensors([_grad_or_zeros(p) for p in bucket])
        work = None
        if self.sharded:
            size = self.group.size
            if flat.numel() % size:
                flat = torch.cat([flat, flat.new_zeros(padded_numel(bucket, size) - flat.numel())])
            if size > 1:
                shard = flat.new_empty(flat.numel() // size)
                work = _reduce_scatter_tensor(shard, flat, group=self.group.pg, async_op=async_op)
                flat = shard
            self.pending.append((work, flat, index))
            return
        if self.group.size > 1:  # a group of one (edp=1 while dp>1) only needs the scale
            work = dist.all_reduce(flat, group=self.group.pg, async_op=async_op)
        self.pending.append((work, flat, bucket))

    def launch_ready(self) -> None:
        while self.next < len(self.buckets) and self.missing[self.next] == 0:
            self.launch(self.next, async_op=True)
            self.next += 1

    def finish(self) -> None:
        for index in range(self.next, len(self.buckets)):
            self.launch(index, async_op=False)
        for work, flat, bucket in self.pending:
            if work is not None:
                work.wait()
            if self.scale != 1.0:
                flat.mul_(self.scale)
            if self.sharded:
                index = self.tp_index[bucket]
                if index is not None:
                    flat[index] = all_reduce_(flat[index], self.tp)
                self.shards[bucket] = flat
                continue
            for p, g in zip(bucket, _unflatten_dense_tensors(flat, [_grad_or_zeros(p) for p in bucket])):
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
        for bucket, shard in zip(self.buckets, self.shards):
            flat = all_gather_nograd(shard, self.group)
            for p, g in zip(bucket, _unflatten_dense_tensors(flat[: sum(q.numel() for q in bucket)],
                                                             [_grad_or_zeros(q) for q in bucket])):
                target = grad_of(p)
                if target is None:
                    p.grad = g.clone().to(p.dtype)
                else:
                    target.copy_(g)


class GradReducer:
    """Reduces ``.grad`` of a model's parameters after backward; build once, call :meth:`reduce` per step."""

    def __init__(self, model: torch.nn.Module, state: ParallelState, bucket_mb: float = 25.0,
                 overlap: bool = False, sharded: bool = False):
        self.state, self.sharded = state, sharded
        params = [p for p in model.parameters() if p.requires_grad]
        bucket_bytes = int(bucket_mb * 2**20)
        dp = state["dp_cp"]
        self.entries: list[_Entry] = []
        dense = [p for p in params if not p.shard_info.expert]
        expert = [p for p in params if p.shard_info.expert]
        # Sharded: every parameter sits in exactly one entry (even over a group of one): its optimizer shard.
        if dense and (dp.size > 1 or sharded):
            self.entries.append(_Entry(dp, 1.0 / dp.size, _buckets(dense, bucket_bytes), sharded, state.tp))
        if expert and (state.edp.size > 1 or dp.size > 1 or sharded):
            self.entries.append(_Entry(state.edp, 1.0 / dp.size, _buckets(expert, bucket_bytes), sharded, state.tp))
        tp_partial = [p for p in params if p.shard_info.tp_partial]
        self.tp_entry = _Entry(state.tp, 1.0, _buckets(tp_partial, bucket_bytes)) \
            if state.tp.size > 1 and tp_partial and not sharded else None
        self.overlap = overlap and bool(self.entries)
        self.armed = False
        if self.overlap:
            for entry in self.entries:
                for index, bucket in enumerate(entry.buckets):
                    for p in bucket:
                        p.register_post_accumulate_grad_hook(self._hook(entry, index))

    def _hook(self, entry: _Entry, index: int):
        def on_grad(_param):
            if self.armed:
                entry.missing[index] -= 1
                if entry.missing[index] == 0:
                    entry.launch_ready()
        return on_grad

    def arm(self) -> None:
        """Call before the backward of the step's last micro-batch: its final gradients start reducing."""
        if self.overlap:
            for entry in self.entries:
                entry.reset()
            self.armed = True

    @torch.no_grad()
    def reduce(self) -> None:
        """Finish (or run) every reduction; afterwards each ``.grad`` holds the reduced gradient."""
        self.armed = False
        for entry in self.entries:
            entry.finish()
        if self.tp_entry is not None:
            self.tp_entry.finish()

    @torch.no_grad()
    def materialize(self) -> None:
        """After :meth:`reduce` with ``sharded``: make every gradient whole again (for checks, not training)."""
        for entry in self.entries:
            entry.materialize()
