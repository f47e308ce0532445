"""Gradient reduction across replicas, in flat buckets, optionally overlapped with the backward pass.

- ``tp_partial`` parameters (norms, router, ...; replicated over TP but fed sequence-sharded input) are
  summed over TP.
- Dense gradients are averaged over DP (the next issue makes this DP·CP).
- Expert gradients are summed over EDP and divided by DP: every expert replica already holds the sum over
  the tokens of the ep·etp ranks it serves, so the sum over EDP covers all DP replicas once.
All three are sums, so their order does not matter. Buckets hold at most ``bucket_bytes`` of gradients of one
dtype, in reverse parameter order (the order the backward pass produces them); each is one all-reduce.

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

from executor.parallel.groups import Group, ParallelState


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

    def __init__(self, group: Group, scale: float, buckets: list[list[torch.nn.Parameter]]):
        self.group, self.scale, self.buckets = group, scale, buckets
        self.reset()

    def reset(self) -> None:
        self.missing = [len(b) for b in self.buckets]
        self.next = 0
        self.pending: list[tuple[object, torch.Tensor, list[torch.nn.Parameter]]] = []

    def launch(self, index: int, async_op: bool):
        bucket = self.buckets[index]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
        flat = _flatten_dense_tensors(grads)
        work = None
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
            for p, g in zip(bucket, _unflatten_dense_tensors(flat, [p.grad if p.grad is not None else p
                                                                    for p in bucket])):
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
        self.reset()


class GradReducer:
    """Reduces ``.grad`` of a model's parameters after backward; build once, call :meth:`reduce` per step."""

    def __init__(self, model: torch.nn.Module, state: ParallelState, bucket_mb: float = 25.0,
                 overlap: bool = False):
        self.state = state
        params = [p for p in model.parameters() if p.requires_grad]
        bucket_bytes = int(bucket_mb * 2**20)
        dp = state["dp_cp"]
        self.entries: list[_Entry] = []
        dense = [p for p in params if not p.shard_info.expert]
        expert = [p for p in params if p.shard_info.expert]
        if dp.size > 1 and dense:
            self.entries.append(_Entry(dp, 1.0 / dp.size, _buckets(dense, bucket_bytes)))
        if expert and (state.edp.size > 1 or dp.size > 1):
            self.entries.append(_Entry(state.edp, 1.0 / dp.size, _buckets(expert, bucket_bytes)))
        tp_partial = [p for p in params if p.shard_info.tp_partial]
        self.tp_entry = _Entry(state.tp, 1.0, _buckets(tp_partial, bucket_bytes)) \
            if state.tp.size > 1 and tp_partial else None
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
