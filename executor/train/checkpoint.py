"""Layout-independent checkpoints with ``torch.distributed.checkpoint`` (DCP) and resharding on load.

What is saved: every parameter and its AdamW moments at *full logical shape* keyed by ShardInfo name
(``model/<name>``, ``optim/<name>/exp_avg``, ``optim/<name>/exp_avg_sq``), persistent buffers by module path
(``buffer/<path>``, e.g. the routers' expert bias), and the AdamW step. The trainer state — next step (also
the data position: global batch index), layout, model name and every rank's RNG state — goes to
``trainer.pt`` on rank 0.

Why full tensors: a checkpoint then depends on nothing but the model, so a run resumes under any folded
layout by slicing each tensor with the same rules that initialise parameters (:mod:`executor.parallel.sharding`).
Every rank gathers the full tensors (collectives over its shard groups) and calls ``dcp.save``; DCP treats
plain tensors as replicated and writes each once. The price is one full copy of the model and optimizer in
host memory per rank while saving — fine up to a few billion parameters; larger models would save each
rank's slice as a DTensor instead.

Directory: ``<dir>/step-00000020/`` (DCP files + ``trainer.pt``) and ``<dir>/latest`` naming the last
complete one, replaced atomically after every rank has finished writing, so a run killed while saving
resumes from the previous checkpoint.

Loading runs no code from the checkpoint: ``trainer.pt`` holds only ints, strings, lists and tensors and is
read as plain data (:func:`executor.safe_load.load_data`), the DCP metadata through
:class:`executor.safe_load.SafeReader`; ``latest`` must name a directory directly inside the checkpoint directory. A file holding anything else
is refused with a :class:`CheckpointError`.
"""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from spec.errors import FoldtuneError
from executor.optimizer import finish_param_gather
from executor.parallel.groups import ParallelState
from executor.parallel.sharding import ShardInfo, gather_full, local_shard
from executor.train.checkpoint_names import LATEST, TRAINER_FILE, step_dir_name
from executor.train.optim_state import MOMENTS, adam_step, load_local_state, local_state
from executor.safe_load import RefusedPickle, SafeReader, load_data



class CheckpointError(FoldtuneError):
    """A checkpoint that cannot be read or does not fit the model being resumed."""


@dataclass(frozen=True)
class Resumed:
    """What :func:`load_checkpoint` restored: the next step to run and the layout the checkpoint was saved under."""

    step: int
    path: str
    saved_layout: str


def _distributed(state: ParallelState) -> bool:
    return state.config.world_size > 1


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers keyed by their module's parameter name prefix (``layers.3.router.expert_bias``):
    module paths depend on the pipeline layout, ShardInfo names do not."""
    out = {}
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        for name, t in module.named_buffers(recurse=False):
            if name in module._non_persistent_buffers_set or t is None:
                continue
            if not own:
                raise CheckpointError(f"buffer {name!r} of a {type(module).__name__} without parameters has no "
                                      f"layout-independent name")
            out[f"{own[0].shard_info.name.rsplit('.', 1)[0]}.{name}"] = t
    return out


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers by their layout-independent name (what checkpoints and Hugging Face exports hold)."""
    return _buffers(model)


def _logical_shape(info: ShardInfo) -> tuple[int, ...]:
    shape = list(info.full_shape)
    if info.rows is not None:
        shape[0] = info.rows
    return tuple(shape)


def _gate_up_keys(key: str) -> tuple[str | None, str | None]:
    """The (w1, w3) keys of a fused expert gate/up key ``...experts.w13[/moment]``, else (None, None)."""
    if ".experts.w13" not in key:
        return None, None
    return key.replace(".experts.w13", ".experts.w1"), key.replace(".experts.w13", ".experts.w3")


def _stored_keys(path: Path) -> set[str]:
    """Keys the checkpoint at ``path`` holds (empty when its metadata cannot be read: dcp.load reports it);
    CheckpointError when the metadata holds objects foldtune never writes (:mod:`executor.safe_load`)."""
    try:
        return set(SafeReader(str(path)).read_metadata().state_dict_metadata)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"checkpoint {path} refused: {exc}") from exc
    except Exception:  # noqa: BLE001 — a missing or broken checkpoint gets dcp.load's own error below
        return set()


def _local_slice(full: torch.Tensor, info: ShardInfo, state: ParallelState) -> torch.Tensor:
    """This rank's slice of a full logical tensor (re-padding vocabulary rows for this layout's TP)."""
    if info.rows is not None and full.shape[0] < info.full_shape[0]:
        full = torch.cat([full, full.new_zeros((info.full_shape[0] - full.shape[0], *full.shape[1:]))])
    return local_shard(full, info, state)


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The last complete checkpoint under ``directory``, or None when there is none."""
    marker = Path(directory) / LATEST
    if not marker.is_file():
        return None
    name = marker.read_text().strip()
    path = Path(directory) / name
    if (not name or name in (".", "..") or "/" in name or "\\" in name
            or os.path.realpath(path.parent) != os.path.realpath(directory)):
        raise CheckpointError(f"{marker} names {name!r}, not a checkpoint directly inside {directory}; refused")
    if not (path / TRAINER_FILE).is_file():
        raise CheckpointError(f"{marker} names {path.name!r}, which holds no {TRAINER_FILE}")
    return path


def save_checkpoint(directory: str | Path, next_step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, state: ParallelState, model_name: str) -> Path:
    """Save after ``next_step`` optimizer steps. Collective: every rank of the layout must call it."""
    full = model_entries(model, optimizer, state)
    path = Path(directory) / step_dir_name(next_step)
    dcp_save(full, path)
    rng = torch.get_rng_state()
    rngs = [None] * state.config.world_size
    if _distributed(state):
        dist.all_gather_object(rngs, rng)
    else:
        rngs = [rng]
    trainer = {"next_step": next_step, "layout": state.config.label(), "world_size": state.config.world_size,
               "model": model_name, "rng": rngs}
    write_trainer_state(directory, path, trainer, state.rank, _distributed(state))
    return path


def model_entries(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  state: ParallelState) -> dict[str, object]:
    """What a checkpoint holds of ``model`` and its optimizer, every tensor at full logical shape (keys as the
    module docstring names them). Collective over the layout's shard groups."""
    finish_param_gather(model)  # overlap_param_gather: the last step's all-gathers
    full: dict[str, object] = {}
    params = list(model.parameters())
    for p, values in local_state(optimizer, params).items():
        info: ShardInfo = p.shard_info
        full[f"model/{info.name}"] = gather_full(values["master"], info, state).cpu()
        for key in MOMENTS:
            full[f"optim/{info.name}/{key}"] = gather_full(values[key], info, state).cpu()
    for name, t in _buffers(model).items():
        full[f"buffer/{name}"] = t.detach().cpu()
    full["optim/step"] = torch.tensor(float(adam_step(optimizer)), dtype=torch.float64)
    return full


def dcp_save(full: dict[str, object], path: Path) -> None:
    """Write ``full`` as the DCP files of checkpoint ``path`` (collective over the world; a tensor several ranks
    hold is written once); CheckpointError when the write fails."""
    _saving(path, lambda: _dcp_save(full, path))


def write_trainer_state(directory: str | Path, path: Path, trainer: dict, rank: int, distributed: bool) -> None:
    """Rank 0 writes ``trainer.pt``, then, once every rank has finished writing, points ``latest`` at
    ``path``. Collective over the world when ``distributed``."""
    if rank == 0:
        _saving(path, lambda: torch.save(trainer, path / TRAINER_FILE))
    if distributed:
        dist.barrier()
    if rank == 0:
        _saving(path, lambda: _mark_latest(Path(directory), path.name))
    if distributed:
        dist.barrier()


def _dcp_save(full: dict[str, object], path: Path) -> None:
    with warnings.catch_warnings():  # one process without torch.distributed is a valid single-rank save
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(full, checkpoint_id=str(path))


def _mark_latest(directory: Path, name: str) -> None:
    """Point ``latest`` at ``name`` atomically (a reader sees the old or the new name, never a partial one)."""
    tmp = directory / f".{LATEST}.tmp"
    tmp.write_text(name + "\n")
    os.replace(tmp, directory / LATEST)


def _saving(path: Path, write: Callable[[], None]) -> None:
    """Run one write of the checkpoint at ``path``; CheckpointError with the OS reason when it fails (torch.save
    reports a full disk as a RuntimeError; DCP's CheckpointException is a BaseException whose text names only
    the failing ranks)."""
    try:
        write()
    except (CheckpointException, OSError, RuntimeError) as exc:
        raise CheckpointError(f"saving checkpoint {path} failed: {save_failure_reason(exc)}") from None


def save_failure_reason(exc: BaseException) -> str:
    """Why a save failed, in one line: the operating system's reason and file for an OSError (``No space left
    on device: /ckpt/step-00000050/__0_0.distcp``), the first failing rank's error inside DCP's
    CheckpointException, else the exception's type and first line."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, (inner, _trace) = min(exc.failures.items())
        return f"rank {rank}: {save_failure_reason(inner)}"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _trainer_state(file: Path) -> dict:
    """``trainer.pt`` read as plain data (:func:`executor.safe_load.load_data`); CheckpointError when it
    cannot be read, holds any other object (a pickled class or function: refused, never run) or lacks a field."""
    try:
        trainer = load_data(file)
    except RefusedPickle as exc:
        raise CheckpointError(str(exc)) from exc
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointError(f"cannot read {file}: {exc}") from exc
    fields = {"next_step": int, "layout": str, "world_size": int, "model": str, "rng": list}
    if not isinstance(trainer, dict) or any(not isinstance(trainer.get(k), t) for k, t in fields.items()):
        raise CheckpointError(f"{file} is not a foldtune trainer state ({', '.join(fields)})")
    return trainer


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    state: ParallelState, model_name: str) -> Resumed:
    """Restore model, AdamW moments and step, buffers and (same world size) RNG from ``path`` into this
    layout's slices. Collective: every rank must call it."""
    path = Path(path)
    trainer = read_trainer_state(path, model_name)
    full, split = model_load_targets(path, model)
    dcp_load(full, path)
    apply_model_entries(full, split, model, optimizer, state)
    if trainer["world_size"] == state.config.world_size:
        torch.set_rng_state(trainer["rng"][state.rank])
    return Resumed(int(trainer["next_step"]), str(path), str(trainer["layout"]))


def read_trainer_state(path: str | Path, model_name: str) -> dict:
    """``trainer.pt`` of checkpoint ``path``, refused unless it is of model ``model_name``."""
    path = Path(path)
    trainer = _trainer_state(path / TRAINER_FILE)
    if trainer["model"] != model_name:
        raise CheckpointError(f"checkpoint {path} is of model {trainer['model']!r}, not {model_name!r}")
    return trainer


def model_load_targets(path: Path, model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(empty tensors for every key of ``model`` a checkpoint at ``path`` holds, the fused gate/up keys it
    stores as separate w1 / w3 tensors) for :func:`dcp_load`, then :func:`apply_model_entries`."""
    finish_param_gather(model)  # a pending gather would overwrite the loaded parameters
    params = list(model.parameters())
    full: dict[str, torch.Tensor] = {}
    stored = _stored_keys(path)
    split: list[str] = []  # fused gate/up keys this checkpoint holds as separate w1 / w3 tensors
    for p in params:
        info: ShardInfo = p.shard_info
        shape = _logical_shape(info)
        for key in ["model/" + info.name] + [f"optim/{info.name}/{m}" for m in MOMENTS]:
            gate, up = _gate_up_keys(key)
            if gate is not None and key not in stored and gate in stored and up in stored:
                split.append(key)  # an older checkpoint: w1 and w3 [E, F, H] stored apart, not w13 [E, 2, F, H]
                half = (shape[0], *shape[2:])
                full[gate] = torch.empty(half, dtype=torch.float32)
                full[up] = torch.empty(half, dtype=torch.float32)
            else:
                full[key] = torch.empty(shape, dtype=torch.float32)
    buffers = _buffers(model)
    for name, t in buffers.items():
        full[f"buffer/{name}"] = torch.empty(t.shape, dtype=t.dtype)
    full["optim/step"] = torch.zeros((), dtype=torch.float64)
    return full, split


def dcp_load(full: dict[str, torch.Tensor], path: Path) -> None:
    """Fill ``full``'s tensors from checkpoint ``path`` (collective over the world)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(full, checkpoint_id=str(path), storage_reader=SafeReader(str(path)))
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint {path} does not fit this model: {first}") from exc


def apply_model_entries(full: dict[str, torch.Tensor], split: list[str], model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer, state: ParallelState) -> None:
    """Put the loaded tensors of :func:`model_load_targets` into this layout's slices of ``model`` and its
    optimizer."""
    params = list(model.parameters())
    buffers = _buffers(model)
    for key in split:
        gate, up = _gate_up_keys(key)
        full[key] = torch.stack([full.pop(gate), full.pop(up)], dim=1)
    values = {p: {"master": _local_slice(full[f"model/{p.shard_info.name}"], p.shard_info, state),
                  **{key: _local_slice(full[f"optim/{p.shard_info.name}/{key}"], p.shard_info, state)
                     for key in MOMENTS}}
              for p in params}
    load_local_state(optimizer, values, int(full["optim/step"]))
    with torch.no_grad():
        for name, t in buffers.items():
            t.copy_(full[f"buffer/{name}"])
