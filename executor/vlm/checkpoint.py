"""Checkpoints of a vision-language training: the LLM's part as :mod:`executor.train.checkpoint` saves a text
model's (every tensor at full logical shape), plus the encoder's parameters and Adam moments, also whole
(``encoder/<name>``, ``encoder_optim/<name>/exp_avg``, ``encoder_optim/<name>/exp_avg_sq``,
``encoder_optim/step``), so a run resumes under any multimodal layout: the encoder's TP shards are gathered on
save and cut again on load (:func:`executor.vlm.boundary.shard_encoder_state`).

Every rank of the world saves and loads together (one DCP write): under the separate placement the LLM's ranks
hold only the LLM's keys, the encoder's ranks only the encoder's; a tensor held by several ranks (replicas) is
written once. ``trainer.pt`` holds the next step, the multimodal label, the world size, the model's name and
every rank's RNG state.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from executor.parallel.groups import Group
from executor.train.checkpoint import (Resumed, apply_model_entries, dcp_load, dcp_save, model_entries,
                                       model_load_targets, read_trainer_state, write_trainer_state)
from executor.train.checkpoint_names import step_dir_name
from executor.vlm.boundary import is_tp_split, shard_encoder_state

MOMENTS = ("exp_avg", "exp_avg_sq")


def _gather(t: torch.Tensor, group: Group | None) -> list[torch.Tensor]:
    if group is None or group.size == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(group.size)]
    dist.all_gather(parts, t.contiguous(), group=group.pg)
    return parts


def unshard_encoder_tensor(name: str, shards: list[torch.Tensor], heads: int) -> torch.Tensor:
    """The whole encoder tensor ``name`` from its TP shards in TP-rank order: the inverse of
    :func:`executor.vlm.boundary.shard_encoder_state`'s cut."""
    if len(shards) == 1 or not is_tp_split(name):
        return shards[0]
    if name.endswith(("qkv.weight", "qkv.bias")):
        per = heads // len(shards)
        parts = [s.reshape(3, per, -1, *s.shape[1:]) for s in shards]
        return torch.cat(parts, dim=1).reshape(-1, *shards[0].shape[1:])
    return torch.cat(shards, dim=0 if name.endswith(("fc1.weight", "fc1.bias")) else 1)


def encoder_entries(encoder: torch.nn.Module, optimizer: torch.optim.Optimizer, group: Group | None,
                    heads: int) -> dict[str, object]:
    """The encoder's parameters and Adam state, whole. Collective over the encoder's TP group."""
    full: dict[str, object] = {}
    step = 0.0
    for name, p in encoder.named_parameters():
        full[f"encoder/{name}"] = unshard_encoder_tensor(name, _gather(p.detach(), group), heads).float().cpu()
        state = optimizer.state.get(p, {})
        for key in MOMENTS:
            local = state.get(key, torch.zeros_like(p))
            whole = unshard_encoder_tensor(name, _gather(local, group), heads)
            full[f"encoder_optim/{name}/{key}"] = whole.float().cpu()
        step = float(state.get("step", 0.0))
    full["encoder_optim/step"] = torch.tensor(step, dtype=torch.float64)
    return full


def _whole_shape(name: str, shape: torch.Size, tp: int) -> tuple[int, ...]:
    """The whole shape of encoder tensor ``name`` whose TP shard has ``shape``."""
    out = list(shape)
    if tp > 1 and is_tp_split(name):
        out[0 if name.endswith(("qkv.weight", "qkv.bias", "fc1.weight", "fc1.bias")) else 1] *= tp
    return tuple(out)


def _encoder_targets(encoder: torch.nn.Module, group: Group | None) -> dict[str, torch.Tensor]:
    tp = 1 if group is None else group.size
    full: dict[str, torch.Tensor] = {}
    for name, p in encoder.named_parameters():
        for key in [f"encoder/{name}"] + [f"encoder_optim/{name}/{m}" for m in MOMENTS]:
            full[key] = torch.empty(_whole_shape(name, p.shape, tp), dtype=torch.float32)
    full["encoder_optim/step"] = torch.zeros((), dtype=torch.float64)
    return full


def _apply_encoder(full: dict[str, torch.Tensor], encoder: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   group: Group | None, heads: int) -> None:
    tp, rank = (1, 0) if group is None else (group.size, group.rank)

    def mine(prefix: str, suffix: str = "") -> dict[str, torch.Tensor]:
        whole = {name: full[f"{prefix}/{name}{suffix}"] for name, _ in encoder.named_parameters()}
        return shard_encoder_state(whole, heads, tp, rank)

    weights = mine("encoder")
    moments = {key: mine("encoder_optim", f"/{key}") for key in MOMENTS}
    step = float(full["encoder_optim/step"])
    with torch.no_grad():
        for name, p in encoder.named_parameters():
            p.copy_(weights[name])
            if step > 0:
                optimizer.state[p] = {"step": torch.tensor(step),
                                      **{key: moments[key][name].to(p.device, p.dtype).clone() for key in MOMENTS}}


def save_vl_checkpoint(directory: str | Path, next_step: int, model, trainer, label: str, model_name: str) -> Path:
    """Save after ``next_step`` optimizer steps (``model``: this rank's :class:`VisionLanguageMoE` part,
    ``trainer``: its :mod:`executor.vlm.train` trainer). Collective: every rank of the world calls it."""
    full: dict[str, object] = {}
    if model.llm is not None:
        full.update(model_entries(model.llm, trainer.optimizer, model.llm.state))
    if model.encoder is not None:
        full.update(encoder_entries(model.encoder, trainer.encoder_optimizer, model.encoder.group,
                                    model.spec.vision.num_attention_heads))
    path = Path(directory) / step_dir_name(next_step)
    dcp_save(full, path)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    rngs = [None] * world
    if world > 1:
        dist.all_gather_object(rngs, torch.get_rng_state())
    else:
        rngs = [torch.get_rng_state()]
    trainer_state = {"next_step": next_step, "layout": label, "world_size": world, "model": model_name,
                     "rng": rngs}
    write_trainer_state(directory, path, trainer_state, rank, world > 1)
    return path


def load_vl_checkpoint(path: str | Path, model, trainer, model_name: str) -> Resumed:
    """Restore both parts, their optimizers and (same world size) the RNG from ``path`` into this rank's
    slices. Collective: every rank of the world calls it."""
    path = Path(path)
    saved = read_trainer_state(path, model_name)
    full: dict[str, torch.Tensor] = {}
    split: list[str] = []
    if model.llm is not None:
        llm_full, split = model_load_targets(path, model.llm)
        full.update(llm_full)
    if model.encoder is not None:
        full.update(_encoder_targets(model.encoder, model.encoder.group))
    dcp_load(full, path)
    if model.llm is not None:
        apply_model_entries(full, split, model.llm, trainer.optimizer, model.llm.state)
    if model.encoder is not None:
        _apply_encoder(full, model.encoder, trainer.encoder_optimizer, model.encoder.group,
                       model.spec.vision.num_attention_heads)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if saved["world_size"] == world:
        torch.set_rng_state(saved["rng"][dist.get_rank() if dist.is_initialized() else 0])
    return Resumed(int(saved["next_step"]), str(path), str(saved["layout"]))
