"""Uniform access to the trainer's AdamW state, whichever optimizer :class:`executor.train_step.Trainer` builds.

Two shapes are supported: ``torch.optim.AdamW`` (state per parameter, ``param_groups``) and the executor's
flat-unit Adam (``units`` of master weights and moments, each this rank's shard of a gradient bucket over
the unit's group, ``step_count``, ``lr``). Everything here speaks *per-parameter local tensors* — the same
shape as the parameter on this rank — so checkpoints never see how the optimizer lays its state out.
"""

from __future__ import annotations

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from executor.parallel.collectives import all_gather_nograd

MOMENTS = ("exp_avg", "exp_avg_sq")


def _flat_units(optimizer) -> bool:
    return hasattr(optimizer, "units")


def set_lr(optimizer, lr: float) -> None:
    """Learning rate of the next step."""
    if _flat_units(optimizer):
        optimizer.lr = lr
    else:
        for group in optimizer.param_groups:
            group["lr"] = lr


def adam_step(optimizer) -> int:
    """Adam steps taken so far (drives the bias correction)."""
    if _flat_units(optimizer):
        return int(optimizer.step_count)
    for state in optimizer.state.values():
        if "step" in state:
            return int(float(state["step"]))
    return 0


def _padded(n: int, size: int) -> int:
    return -(-n // size) * size


def _gather_unit(tensor: torch.Tensor, unit) -> torch.Tensor:
    return all_gather_nograd(tensor, unit.group)[: unit.numel] if unit.group.size > 1 else tensor[: unit.numel]


@torch.no_grad()
def local_state(optimizer, params: list[torch.nn.Parameter]) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
    """Per parameter: ``master`` (fp32 weights the optimizer steps) and the two moments, at the parameter's
    local shape. Collective over each unit's group for a sharded flat-unit optimizer."""
    out: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
    if _flat_units(optimizer):
        for unit in optimizer.units:
            shapes = [torch.empty(p.shape, dtype=torch.float32, device=p.device) for p in unit.params]
            pieces = {key: _unflatten_dense_tensors(_gather_unit(unit.state(key), unit), shapes)
                      for key in ("master", *MOMENTS)}
            for i, p in enumerate(unit.params):
                out[p] = {key: pieces[key][i] for key in pieces}
        return out
    for p in params:
        state = optimizer.state.get(p, {})
        out[p] = {"master": p.detach().float(),
                  **{key: state[key].float() if key in state else torch.zeros_like(p, dtype=torch.float32)
                     for key in MOMENTS}}
    return out


@torch.no_grad()
def load_local_state(optimizer, values: dict[torch.nn.Parameter, dict[str, torch.Tensor]], step: int) -> None:
    """Install per-parameter local ``master``/moments (as from :func:`local_state`) and the Adam step; the
    parameters themselves take the master weights."""
    for p, v in values.items():
        p.copy_(v["master"].to(p.device, p.dtype))
    if _flat_units(optimizer):
        for unit in optimizer.units:
            size, rank = unit.group.size, unit.group.rank
            for key in ("master", *MOMENTS):
                flat = _flatten_dense_tensors([values[p][key].to(p.device, torch.float32) for p in unit.params])
                padded = _padded(flat.numel(), size)
                if padded > flat.numel():
                    flat = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
                unit.load_state(key, flat.chunk(size)[rank])
        optimizer.step_count = step
        return
    if step == 0:
        return
    fused = bool(optimizer.defaults.get("fused"))
    for p, v in values.items():
        optimizer.state[p] = {
            "step": torch.tensor(float(step), dtype=torch.float32, device=p.device if fused else "cpu"),
            **{key: v[key].to(p.device, p.dtype).clone() for key in MOMENTS}}
