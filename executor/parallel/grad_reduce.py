"""Gradient reduction across replicas, in flat buckets.

- ``tp_partial`` parameters (norms, router, ...; replicated over TP but fed sequence-sharded input) are
  summed over TP first.
- Dense gradients are averaged over DP (the next issue makes this DP·CP).
- Expert gradients are summed over EDP and divided by DP: every expert replica already holds the sum over
  the tokens of the ep·etp ranks it serves, so the sum over EDP covers all DP replicas once.
Buckets hold at most ``bucket_bytes`` of gradients of one dtype; each bucket is one all-reduce.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from executor.parallel.collectives import all_reduce_
from executor.parallel.groups import Group, ParallelState


def _buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    by_dtype: dict[torch.dtype, list] = defaultdict(list)
    for p in params:
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


class GradReducer:
    """Reduces ``.grad`` of a model's parameters after backward; build once, call :meth:`reduce` per step."""

    def __init__(self, model: torch.nn.Module, state: ParallelState, bucket_mb: float = 25.0):
        self.state = state
        params = [p for p in model.parameters() if p.requires_grad]
        bucket_bytes = int(bucket_mb * 2**20)
        dp = state["dp_cp"]
        # (group, scale, buckets) in order; tp sum comes before the DP average of the same parameters.
        self.plan: list[tuple[Group, float, list[list[torch.nn.Parameter]]]] = []
        tp_partial = [p for p in params if p.shard_info.tp_partial]
        if state.tp.size > 1 and tp_partial:
            self.plan.append((state.tp, 1.0, _buckets(tp_partial, bucket_bytes)))
        dense = [p for p in params if not p.shard_info.expert]
        expert = [p for p in params if p.shard_info.expert]
        if dp.size > 1 and dense:
            self.plan.append((dp, 1.0 / dp.size, _buckets(dense, bucket_bytes)))
        if expert and (state.edp.size > 1 or dp.size > 1):
            self.plan.append((state.edp, 1.0 / dp.size, _buckets(expert, bucket_bytes)))

    @torch.no_grad()
    def reduce(self) -> None:
        for group, scale, buckets in self.plan:
            for bucket in buckets:
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
                flat = _flatten_dense_tensors(grads)
                all_reduce_(flat, group)
                if scale != 1.0:
                    flat.mul_(scale)
                for p, g in zip(bucket, _unflatten_dense_tensors(flat, grads)):
                    if p.grad is None:
                        p.grad = g
                    else:
                        p.grad.copy_(g)
