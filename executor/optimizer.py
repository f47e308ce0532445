"""Adam with Megatron's mixed-precision recipe, optionally as a distributed optimizer (ZeRO-1).

Recipe (bf16/fp16 parameters): every parameter gets an fp32 ``main_grad`` into which each micro-batch's
gradient is accumulated (a post-accumulate hook adds and frees ``.grad``); the optimizer keeps fp32 master
weights and fp32 Adam moments, steps them, and copies the result back into the low-precision parameters.
That is Megatron's 18 bytes per parameter (2 weight + 4 main grad + 4 master + 4 m + 4 v). For fp32
parameters the parameter is its own master and ``.grad`` its main gradient: plain fp32 AdamW (16 bytes).
In training the main grads are views of the reducer's per-bucket fp32 gradient buffers
(``GradReducer(main_grads=True)``, :func:`executor.parallel.grad_reduce.attach_main_grads`), so an unsharded
unit reads its bucket's buffer as its gradient and zero_grad is one fill per bucket.

State lives in flat units, one per gradient bucket of :class:`GradReducer`. With ``sharded`` (the
distributed optimizer) a unit's master weights and moments are only this rank's 1/size shard of the
bucket, over DP·CP for dense parameters and over EDP for experts: the reducer reduce-scatters the bucket's
gradients into that shard, Adam updates it, and an all-gather over the same group rebuilds the parameters.
Without it a unit is a whole bucket. fp32 parameters (no buffer) have their gradients flattened into a copy
per step.
"""

from __future__ import annotations

import math

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from executor.parallel.collectives import all_gather_nograd
from executor.parallel.grad_reduce import GradReducer, _grad_or_zeros, attach_main_grads, padded_numel
from executor.parallel.groups import Group

__all__ = ["MixedPrecisionAdam", "attach_main_grads"]  # attach_main_grads: re-exported for standalone modules


class _Unit:
    """Master weights and moments of one bucket (or this rank's shard of it). ``buffer``: the bucket's fp32
    gradient buffer (unsharded units), read in place as the gradient."""

    def __init__(self, params: list[torch.nn.Parameter], group: Group, entry=None, index: int = 0,
                 buffer: torch.Tensor | None = None):
        self.params, self.group, self.entry, self.index, self.buffer = params, group, entry, index, buffer
        self.numel = sum(p.numel() for p in params)
        full = _flatten_dense_tensors([p.detach().float() for p in params])
        padded = padded_numel(params, group.size)
        if padded > full.numel():
            full = torch.cat([full, full.new_zeros(padded - full.numel())])
        self.master = full.chunk(group.size)[group.rank].clone()
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)

    def grad_shard(self) -> torch.Tensor:
        if self.entry is not None:
            return self.entry.shards[self.index]
        if self.buffer is not None:
            return self.buffer[: self.master.numel()]
        return _flatten_dense_tensors([_grad_or_zeros(p).float() for p in self.params])

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy the (gathered) master weights into the model's parameters, in their dtype."""
        dtype = self.params[0].dtype
        flat = all_gather_nograd(self.master.to(dtype), self.group)[: self.numel]
        for p, new in zip(self.params, _unflatten_dense_tensors(flat, self.params)):
            p.copy_(new)


class MixedPrecisionAdam:
    """AdamW (torch's formula: decoupled weight decay, bias-corrected moments) over fp32 master state.

    ``reducer`` must be built with ``sharded`` equal to this optimizer's ``sharded``; call :meth:`step` after
    ``reducer.reduce()``.
    """

    def __init__(self, params: list[torch.nn.Parameter], reducer: GradReducer, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 sharded: bool = False):
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.step_count = 0
        if sharded:
            self.units = [_Unit(bucket, entry.group, entry, i) for entry in reducer.entries
                          for i, bucket in enumerate(entry.buckets)]
        else:
            single = Group("self", (reducer.state.rank,), 0)
            self.units = [_Unit(bucket, single, buffer=buffer) for bucket, buffer in reducer.buckets]
        covered = sum(len(u.params) for u in self.units)
        if covered != len(self.params):
            raise RuntimeError(f"optimizer units cover {covered} of {len(self.params)} parameters")
        self._buffers = [buffer for _, buffer in reducer.buckets if buffer is not None]
        buffered = {id(p) for bucket, buffer in reducer.buckets if buffer is not None for p in bucket}
        self._loose_main_grads = [p.main_grad for p in self.params
                                  if id(p) not in buffered and getattr(p, "main_grad", None) is not None]

    def state_bytes(self) -> int:
        """Bytes of master weights and moments held by this rank."""
        return sum(3 * u.master.numel() * 4 for u in self.units)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Free ``.grad`` (always set to None, as torch's default) and zero the fp32 main gradients: one fill
        per gradient buffer, then any main grad of its own (attached without a buffer)."""
        for p in self.params:
            p.grad = None
        for buffer in self._buffers:
            buffer.zero_()
        for main in self._loose_main_grads:
            main.zero_()

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        beta1, beta2 = self.betas
        correction1 = 1 - beta1 ** self.step_count
        root_correction2 = math.sqrt(1 - beta2 ** self.step_count)
        for unit in self.units:
            grad = unit.grad_shard()
            if self.weight_decay:
                unit.master.mul_(1 - self.lr * self.weight_decay)
            unit.exp_avg.lerp_(grad, 1 - beta1)
            unit.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (unit.exp_avg_sq.sqrt() / root_correction2).add_(self.eps)
            unit.master.addcdiv_(unit.exp_avg, denom, value=-self.lr / correction1)
        for unit in self.units:
            unit.write_back()
