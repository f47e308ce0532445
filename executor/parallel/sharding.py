"""How each parameter is cut across the layout, deterministic full-size init, and gathering back.

Every parameter carries a :class:`ShardInfo`. Weights are drawn at full size from a generator seeded by
(seed, parameter name) and then sliced, so every layout (and the single-process reference) starts from
the same model. :func:`gather_full` inverts the slicing for tests and checkpoints.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from executor.optimizer import finish_param_gather
from executor.parallel.grad_reduce import settle_main_grads
from executor.parallel.groups import Group, ParallelState

_CPU_INIT_LIMIT = 2**24  # elements


@dataclass(frozen=True)
class ShardInfo:
    """Where a parameter's slices live.

    ``tp_dim``/``etp_dim``: dimension split over the tp/etp group; ``ep_dim``: expert dimension split over
    ep. ``expert``: gradients reduce over EDP instead of DP. ``tp_partial``: a TP-replicated parameter whose
    gradient on each TP rank covers only part of the input (sequence shard or head shard), so TP ranks sum it.
    ``rows``: true row count when dim 0 was padded (vocabulary). ``pp_shared``: one of two copies, on the
    first and the last pipeline stage, of the same parameter (the word embedding under MTP or tied output
    weights with pp > 1), whose gradients sum over the embedding group.
    """

    name: str
    full_shape: tuple[int, ...]
    tp_dim: int | None = None
    etp_dim: int | None = None
    ep_dim: int | None = None
    expert: bool = False
    tp_partial: bool = False
    rows: int | None = None
    pp_shared: bool = False


def _slice(full: torch.Tensor, dim: int | None, group: Group) -> torch.Tensor:
    if dim is None or group.size == 1:
        return full
    if full.shape[dim] % group.size:
        raise ValueError(f"cannot split dim {dim} of size {full.shape[dim]} over {group.name}={group.size}")
    return full.chunk(group.size, dim=dim)[group.rank]


def local_shard(full: torch.Tensor, info: ShardInfo, state: ParallelState) -> torch.Tensor:
    """This rank's slice of the full logical tensor ``full`` (a view): cut along TP, ETP and EP as ``info``
    says (what :func:`gather_full` concatenates back)."""
    local = _slice(full, info.tp_dim, state.tp)
    local = _slice(local, info.etp_dim, state.etp)
    return _slice(local, info.ep_dim, state.ep)


def make_param(info: ShardInfo, state: ParallelState, init: str, std: float, seed: int,
               device: torch.device, dtype: torch.dtype) -> torch.nn.Parameter:
    """A parameter holding this rank's slice of a deterministically initialised full tensor.

    ``init`` is 'normal' (std ``std``), 'ones' or 'zeros'.
    """
    if init == "ones":
        full = torch.ones(info.full_shape, device=device)
    elif init == "zeros":
        full = torch.zeros(info.full_shape, device=device)
    else:
        # Small tensors are drawn on the CPU so GPU runs of test-sized models start from the CPU reference's
        # weights; big ones on the device, where drawing billions of numbers takes milliseconds, not minutes.
        numel = 1
        for d in info.full_shape:
            numel *= d
        where = device if numel > _CPU_INIT_LIMIT else torch.device("cpu")
        gen = torch.Generator(device=where)
        gen.manual_seed((seed * 1_000_003 + zlib.crc32(info.name.encode())) % (2**63))
        full = (torch.randn(info.full_shape, generator=gen, device=where) * std).to(device)
        if info.rows is not None:
            full[info.rows:] = 0  # padded vocabulary rows
    param = torch.nn.Parameter(local_shard(full, info, state).to(dtype).contiguous())
    param.shard_info = info
    return param


def _cat_over(t: torch.Tensor, dim: int | None, group: Group) -> torch.Tensor:
    if dim is None or group.size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(group.size)]
    dist.all_gather(parts, t.contiguous(), group=group.pg)
    return torch.cat(parts, dim=dim)


def gather_full(t: torch.Tensor, info: ShardInfo, state: ParallelState) -> torch.Tensor:
    """This parameter (or its gradient) at full shape, padding rows cropped. Collective over the shard groups."""
    t = _cat_over(t, info.ep_dim, state.ep)
    t = _cat_over(t, info.etp_dim, state.etp)
    t = _cat_over(t, info.tp_dim, state.tp)
    if info.rows is not None:
        t = t[: info.rows]
    return t


def gather_model(model: torch.nn.Module, state: ParallelState, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full-shape parameters (or gradients) of ``model`` keyed by ShardInfo name. Every rank must call it.

    The copies of a ``pp_shared`` parameter (first and last stage) must be equal: a later stage's copy that
    differs comes back under ``name@pp{stage}``, so a comparison with the reference names it."""
    finish_param_gather(model)  # overlapped parameter all-gathers still writing the parameters
    if grads:
        settle_main_grads(list(model.parameters()))  # main grads no backward wrote since the step began
    out = {}
    for param in model.parameters():
        info: ShardInfo = param.shard_info
        main_grad = getattr(param, "main_grad", None)  # fp32 accumulation of low-precision parameters
        source = (main_grad if main_grad is not None else param.grad) if grads else param.data
        if source is None:
            source = torch.zeros_like(param)
        out[info.name] = gather_full(source.detach(), info, state).cpu().float()
    pp = state["pp"]
    if pp.size > 1:  # each stage holds other layers: every rank gets the whole model
        parts = [None] * pp.size
        dist.all_gather_object(parts, out, group=pp.pg)
        out = {}
        for stage, part in enumerate(parts):
            for name, t in part.items():
                if name in out and not torch.equal(out[name], t):
                    name = f"{name}@pp{stage}"  # a pp_shared copy that drifted from the first stage's: show it
                out[name] = t
    return out
