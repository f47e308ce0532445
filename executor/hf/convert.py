"""A foldtune checkpoint (``torch.distributed.checkpoint``, any layout) → a Hugging Face directory, offline.

Checkpoints hold every parameter at full logical shape (:mod:`executor.train.checkpoint`), so converting one
needs no process group and no model: the keys ``model/<name>`` and ``buffer/<name>`` are read at the sizes the
checkpoint's metadata records, mapped to the family's HF names (:mod:`executor.hf.names`) and written with the
model's ``config.json``. Checkpoints written before the gate/up fusion (``experts.w1`` and ``experts.w3``) are
stacked into ``experts.w13`` first.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from spec.hf_config import model_from_hf_config
from executor.hf.names import foldtune_to_hf
from executor.hf.weights import write_hf_directory
from executor.safe_load import RefusedPickle, SafeReader
from executor.train.checkpoint import CheckpointError, latest_checkpoint

PREFIXES = ("model/", "buffer/")


def _step_dir(path: Path) -> Path:
    """``path`` itself when it is one step's checkpoint, else the latest one of a checkpoint directory."""
    if (path / ".metadata").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{path} holds no foldtune checkpoint (no .metadata, no 'latest')")
    return latest


def read_checkpoint_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Full parameters and buffers (by ShardInfo-derived name, fp32) of the checkpoint at ``path``, read
    without running code from it (:class:`executor.safe_load.SafeReader`); CheckpointError when it cannot be
    read or holds anything but tensors."""
    step = _step_dir(Path(path))
    try:
        metadata = SafeReader(str(step)).read_metadata().state_dict_metadata
    except RefusedPickle as exc:
        raise CheckpointError(f"checkpoint {step} refused: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - DCP raises many types; one line for the user
        raise CheckpointError(f"cannot read checkpoint metadata of {step}: {exc}") from None
    full = {key: torch.empty(tuple(meta.size), dtype=getattr(meta.properties, "dtype", torch.float32))
            for key, meta in metadata.items() if key.startswith(PREFIXES) and hasattr(meta, "size")}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(full, checkpoint_id=str(step), storage_reader=SafeReader(str(step)))
    out = {key.split("/", 1)[1]: t.float() for key, t in full.items() if not key.endswith(".step_counts")}
    for name in [n for n in out if n.endswith(".experts.w1")]:
        up = name.removesuffix("w1") + "w3"
        if up in out and name.removesuffix("w1") + "w13" not in out:
            out[name.removesuffix("w1") + "w13"] = torch.stack([out.pop(name), out.pop(up)], dim=1)
    return out


def export_checkpoint(checkpoint: str | Path, config: dict[str, Any], target: str | Path,
                      dtype: torch.dtype = torch.float32) -> Path:
    """Write the model of ``checkpoint`` as a Hugging Face directory ``target`` with ``config`` (a config.json
    object: of the Hugging Face model it was trained from, or :func:`spec.hf_config.hf_config_from_spec`'s)."""
    hf = model_from_hf_config(config, "checkpoint", where="the export's config")
    weights = read_checkpoint_weights(checkpoint)
    vocab = hf.spec.vocab_size
    for name in ("embedding.weight", "lm_head.weight"):  # older checkpoints may hold padded rows
        if name in weights and weights[name].shape[0] > vocab:
            weights[name] = weights[name][:vocab]
    return write_hf_directory(foldtune_to_hf(hf.spec, hf.family, weights), config, target, dtype)
