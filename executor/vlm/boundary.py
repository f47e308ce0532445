"""Boundary communicators of a colocated multimodal layout: the encoder in its own tensor-parallel groups over
the LLM's ranks, the LLM in its folded layout.

Forward: each LLM data-parallel rank's images are gathered into its encoder group (:func:`gather_images`), the
group encodes all of them tensor-parallel, and each rank takes back the tokens of its own images
(:func:`take_share`). Backward: ``take_share``'s transpose puts each rank's token gradients in its images'
rows and sums them over the group, so every encoder rank sees the gradient of every image it encoded.

The encoder's groups (:func:`encoder_groups`): ``tp`` consecutive ranks per encoder TP group; the ranks with the
same encoder TP rank form its data-parallel group, over which its gradients are summed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from executor.parallel.collectives import _all_reduce_in_place, all_gather_nograd
from executor.parallel.groups import Group


class _EnterGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (the input of column-parallel layers)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        _all_reduce_in_place(grad, ctx.group)
        return grad, None


class _TakeShare(torch.autograd.Function):
    """Rows [start, end) of a tensor every group member holds whole; backward: this member's gradient in those
    rows, zeros elsewhere, summed over the group (each member's share joins the whole's gradient)."""

    @staticmethod
    def forward(ctx, x, start, end, group):
        ctx.shape, ctx.start, ctx.end, ctx.group = x.shape, start, end, group
        return x[start:end]

    @staticmethod
    def backward(ctx, grad):
        full = grad.new_zeros(ctx.shape)
        full[ctx.start:ctx.end] = grad
        _all_reduce_in_place(full, ctx.group)
        return full, None, None, None


def enter_group(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    return x if group is None or group.size == 1 else _EnterGroup.apply(x, group)


def take_share(x: torch.Tensor, start: int, end: int, group: Group | None) -> torch.Tensor:
    return x[start:end] if group is None or group.size == 1 else _TakeShare.apply(x, start, end, group)


def gather_images(patches: torch.Tensor, group: Group | None) -> tuple[torch.Tensor, int, int]:
    """(the patches of the whole encoder group, in group-rank order; this rank's first and end patch row).
    Every member sends the same number of patches (its micro-batch's images, alike)."""
    if group is None or group.size == 1:
        return patches, 0, patches.shape[0]
    n = patches.shape[0]
    return all_gather_nograd(patches, group), group.rank * n, (group.rank + 1) * n


def encoder_groups(world_size: int, tp: int, rank: int) -> tuple[Group, Group]:
    """(encoder TP group, encoder DP group) of ``rank``: every rank must call this, in the same order (it
    creates the process groups of all ranks)."""
    if world_size % tp:
        raise ValueError(f"encoder tp {tp} does not divide the {world_size} ranks")
    found: dict[str, Group] = {}
    layouts = {"enc_tp": [list(range(k * tp, (k + 1) * tp)) for k in range(world_size // tp)],
               "enc_dp": [list(range(r, world_size, tp)) for r in range(tp)]}
    for name, groups in layouts.items():
        for ranks in groups:
            pg = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                found[name] = Group(name, tuple(ranks), ranks.index(rank), pg)
    return found["enc_tp"], found["enc_dp"]


def is_tp_split(name: str) -> bool:
    """Whether encoder parameter ``name`` is cut over the encoder's TP group (:func:`shard_encoder_state`'s
    choice), not whole on every member."""
    return (name.endswith(("qkv.weight", "qkv.bias", "fc1.weight", "fc1.bias"))
            or (name.endswith(("proj.weight", "fc2.weight")) and not name.startswith("patch_embed")))


def shard_encoder_state(full: dict[str, torch.Tensor], heads: int, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Encoder TP rank ``rank``'s part of a whole encoder state dict (:class:`executor.vlm.vision.VisionEncoder`
    names): qkv rows by head (each of q, k, v), MLP and projector fc1 rows, proj / fc2 columns; the rest whole."""
    if tp == 1:
        return dict(full)
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        if name.endswith("qkv.weight") or name.endswith("qkv.bias"):
            per = heads // tp
            shaped = t.reshape(3, heads, -1, *t.shape[1:])
            out[name] = shaped[:, rank * per:(rank + 1) * per].reshape(-1, *t.shape[1:]).clone()
        elif name.endswith(("fc1.weight", "fc1.bias")):
            out[name] = t.chunk(tp, dim=0)[rank].clone()
        elif name.endswith(("proj.weight", "fc2.weight")) and not name.startswith("patch_embed"):
            out[name] = t.chunk(tp, dim=1)[rank].clone()
        else:
            out[name] = t
    return out
