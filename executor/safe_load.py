"""Reading files foldtune wrote (checkpoints, rank results) without running code from them: the one place
that turns such bytes back into objects.

Every file here may have been written by someone else: a checkpoint directory on a shared volume, a rank's
result file in a temporary directory. Plain :mod:`pickle` (``torch.load(weights_only=False)``, DCP's own
metadata reader) runs whatever callable the file names, so none of it is used:

* DCP's ``.metadata`` is read by :class:`SafeReader`, whose unpickler builds only DCP's own metadata records,
  ``torch.Size``, dtypes and layouts and ``pathlib`` paths, and then checks what the records say: every entry
  is a tensor (foldtune never saves pickled bytes, which DCP would load with ``torch.load(weights_only=False)``),
  and every data file it names is a plain file name inside the checkpoint directory. The tensors themselves
  DCP loads with ``torch.load(weights_only=True)``. Pass it to every ``dcp.load`` as ``storage_reader``.
* Other files go through :func:`load_data`: ``torch.load(weights_only=True)`` (tensors, numbers, strings,
  lists, dicts), optionally also building the plain data types a caller names; :func:`load_rank_result`
  names foldtune's own (dataclasses, enums and named tuples of its packages, which unpickle by setting
  fields, never by calling code of the file's choosing).

A refused file raises :class:`RefusedPickle` (an ``UnpicklingError``) naming what it held.
"""

from __future__ import annotations

import dataclasses
import enum
import pickle
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import filesystem as dcp_filesystem

_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "ChunkStorageMetadata", "MetadataIndex", "StorageMeta",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
}


class RefusedPickle(pickle.UnpicklingError):
    """A checkpoint file holds something other than the plain data foldtune writes."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise RefusedPickle(f"the checkpoint metadata names {module}.{name}, which a DCP checkpoint of foldtune "
                            "never holds; refused (it could run code)")


def _plain_file_name(name: object) -> bool:
    return isinstance(name, str) and bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")


class SafeReader(dcp.FileSystemReader):
    """A ``FileSystemReader`` whose metadata is read without running code (see the module docstring)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        with self.fs.create_stream(self._get_metadata_path(rank), "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise RefusedPickle(f"the checkpoint metadata is a {type(metadata).__name__}, not DCP metadata")
        for key, entry in (metadata.state_dict_metadata or {}).items():
            if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
                raise RefusedPickle(f"checkpoint entry {key!r} is not a tensor; refused")
        for info in (metadata.storage_data or {}).values():
            if not isinstance(info, dcp_filesystem._StorageInfo) or not _plain_file_name(info.relative_path):
                raise RefusedPickle("the checkpoint metadata names a data file outside its directory; refused")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_data(path: str | Path, types: Iterable[type] = ()) -> Any:
    """The object ``torch.save`` wrote to ``path``, read with ``torch.load(weights_only=True)``: tensors,
    numbers, strings, lists, tuples and dicts, and instances of ``types`` (built by setting their fields).
    :class:`RefusedPickle` when the file names any other callable (it is not called)."""
    try:
        with torch.serialization.safe_globals(list(types)):
            return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RefusedPickle(f"{path} holds objects other than plain data; refused (torch.load weights_only=True: "
                            f"{first})") from None


_OWN_PACKAGES = ("spec.", "costmodel.", "executor.")


def _is_plain_data(cls: object) -> bool:
    if not isinstance(cls, type):
        return False
    named_tuple = issubclass(cls, tuple) and hasattr(cls, "_fields")
    return dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum) or named_tuple


def foldtune_data_types() -> list[type]:
    """The dataclasses, enums and named tuples defined in foldtune's loaded ``spec``, ``costmodel`` and
    ``executor`` modules: what a rank function may return besides plain data."""
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(_OWN_PACKAGES):
            continue
        for value in list(vars(module).values()):
            if _is_plain_data(value) and value.__module__ == name:
                found.append(value)
    return found


def load_rank_result(path: str | Path) -> Any:
    """A launched rank's result file (``torch.save`` of what its function returned): :func:`load_data` with
    foldtune's own data types (:func:`foldtune_data_types`)."""
    return load_data(path, foldtune_data_types())
