"""Hugging Face safetensors checkpoints into the executor under any folded layout, and back out.

:func:`load_hf_weights` reads a model directory (``model.safetensors`` or the shards its
``model.safetensors.index.json`` lists), maps the tensors to foldtune's full logical ones
(:mod:`executor.hf.names`) and copies into every parameter this rank's slice of each — TP, ETP, EP cut as the
parameter's ShardInfo says, the padded vocabulary rows zero, each pipeline stage only its own layers —
plus persistent buffers (DeepSeek-V3's expert bias). Every rank reads the files itself (no collective).

:func:`export_hf` gathers the full parameters (collective over the layout) and rank 0 writes
``model.safetensors`` and ``config.json`` in the family's Hugging Face names, which ``transformers`` loads.

``safetensors`` is optional (the ``foldtune[hf]`` extra): the executor imports without it and these
functions say what to install.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spec.errors import FoldtuneError
from spec.hf_config import HFModel
from executor.hf.files import make_readable
from executor.hf.names import foldtune_to_hf, hf_to_foldtune
from executor.optimizer import finish_param_gather
from executor.parallel.groups import ParallelState
from executor.parallel.sharding import ShardInfo, gather_model, local_shard
from executor.train.checkpoint import persistent_buffers

try:  # optional: foldtune[hf]
    from safetensors.torch import load_file as _load_file
    from safetensors.torch import save_file as _save_file
except ImportError:  # pragma: no cover - the dev extra installs it
    _load_file = _save_file = None

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class HFWeightsError(FoldtuneError):
    """A Hugging Face checkpoint that cannot be read, or does not fit the model."""


def _need_safetensors() -> None:
    if _load_file is None:
        raise HFWeightsError("Hugging Face weights need the safetensors package: pip install 'foldtune[hf]'")


def read_hf_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in ``directory``, by its Hugging Face name (in fp32)."""
    _need_safetensors()
    d = Path(directory)
    if (d / INDEX_FILE).is_file():
        try:
            files = sorted(set(json.loads((d / INDEX_FILE).read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise HFWeightsError(f"{d / INDEX_FILE} is not a safetensors index: {exc}") from None
    elif (d / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise HFWeightsError(f"{d} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        path = (d / name).resolve()
        if path.parent != d.resolve():  # an index naming a file elsewhere
            raise HFWeightsError(f"{d / INDEX_FILE} names {name!r} outside the model directory")
        try:
            out.update({k: v.float() for k, v in _load_file(str(path)).items()})
        except Exception as exc:  # safetensors raises its own types; one line is what the user needs
            raise HFWeightsError(f"cannot read {path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    return out


def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters (by ShardInfo name) and persistent buffers (by their checkpoint name)."""
    out: dict[str, torch.Tensor] = {p.shard_info.name: p for p in model.parameters()}
    out.update(_weight_buffers(model))
    return out


def _weight_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers that are part of the model (the expert bias), not of a step's bookkeeping (the
    routers' token counts since the last bias update, zero between steps)."""
    return {k: v for k, v in persistent_buffers(model).items() if not k.endswith(".step_counts")}


def check_loadable(hf: HFModel) -> None:
    """Refuse a model whose reference forward the executor does not reproduce (the reasons listed)."""
    if hf.executor_issues:
        raise HFWeightsError(f"{hf.spec.name}: the executor cannot reproduce this {hf.family} model: "
                             + "; ".join(hf.executor_issues))


def load_hf_weights(model: torch.nn.Module, state: ParallelState, directory: str | Path, hf: HFModel) -> None:
    """Copy the Hugging Face checkpoint in ``directory`` into this rank's slices of ``model`` (built from
    ``hf.spec`` with ``hf.executor_options()``). Call before the optimizer takes the parameters."""
    check_loadable(hf)
    spec = model.spec
    tensors = _model_tensors(model)
    full = hf_to_foldtune(spec, hf.family, read_hf_tensors(directory), set(tensors),
                          strict=state["pp"].size == 1)  # a stage holds only its layers: others' tensors stay
    copy_full_weights(model, state, full)


def copy_full_weights(model: torch.nn.Module, state: ParallelState, full: dict[str, torch.Tensor]) -> None:
    """Copy full logical tensors ``full`` (by ShardInfo name: every parameter and persistent buffer of
    ``model``) into this rank's slices of them."""
    tensors = _model_tensors(model)
    finish_param_gather(model)
    with torch.no_grad():
        for name, target in tensors.items():
            info: ShardInfo | None = getattr(target, "shard_info", None)
            source = full[name]
            if info is None:  # a buffer: replicated, full shape
                _check_shape(name, source, tuple(target.shape))
                target.copy_(source)
                continue
            if info.rows is not None:  # the vocabulary, padded for this layout
                _check_shape(name, source, (info.rows, *info.full_shape[1:]))
                source = torch.cat([source, source.new_zeros((info.full_shape[0] - info.rows, *source.shape[1:]))])
            _check_shape(name, source, info.full_shape)
            target.copy_(local_shard(source, info, state))


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise HFWeightsError(f"{name}: the checkpoint's tensor is {tuple(t.shape)}, the model's {tuple(shape)}")


def export_hf(model: torch.nn.Module, state: ParallelState, directory: str | Path, family: str,
              config: dict[str, Any], dtype: torch.dtype = torch.float32) -> Path | None:
    """Write the model as a Hugging Face directory (``config`` as config.json, the weights in ``dtype``).
    Collective: every rank calls it; rank 0 writes and returns the directory, the others None."""
    _need_safetensors()
    full = gather_model(model, state)  # full parameters on every rank (the pipeline stages all-gathered)
    buffers = {name: t.detach().cpu().float() for name, t in _weight_buffers(model).items()}
    if state["pp"].size > 1:
        parts: list[dict | None] = [None] * state["pp"].size
        dist.all_gather_object(parts, buffers, group=state["pp"].pg)
        buffers = {k: v for part in parts for k, v in part.items()}
    if state.rank != 0:
        return None
    drifted = [n for n in full if "@pp" in n]
    if drifted:
        raise HFWeightsError(f"pipeline copies of {drifted} differ; the export would be ambiguous")
    return write_hf_directory(foldtune_to_hf(model.spec, family, {**full, **buffers}), config, directory, dtype)


def write_hf_directory(tensors: dict[str, torch.Tensor], config: dict[str, Any], directory: str | Path,
                       dtype: torch.dtype = torch.float32) -> Path:
    """Write HF-named ``tensors`` (as ``dtype``) to ``model.safetensors`` and ``config`` to ``config.json``, its
    dtype set to what was written and its quantization_config dropped (the weights are not quantised)."""
    _need_safetensors()
    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
        _save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(out / SINGLE_FILE),
                   metadata={"format": "pt"})
        config = {k: v for k, v in config.items() if k not in ("torch_dtype", "quantization_config")}
        config["dtype"] = str(dtype).removeprefix("torch.")
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        make_readable(out / SINGLE_FILE, out / "config.json")  # safetensors writes its file private
    except OSError as exc:
        raise HFWeightsError(f"cannot write the Hugging Face directory {out}: {exc.strerror}") from None
    return out
