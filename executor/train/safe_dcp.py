"""Reading a ``torch.distributed.checkpoint`` (DCP) directory without running code from it.

``dcp.FileSystemReader`` unpickles the checkpoint's ``.metadata`` with plain :mod:`pickle`, so whoever can
write a checkpoint directory could run code in every rank that resumes from it. :class:`SafeReader` reads
the same file with an unpickler that builds only DCP's own metadata records, ``torch.Size``, dtypes and
layouts and ``pathlib`` paths, and then checks what the records say: every entry is a tensor (foldtune
never saves pickled bytes, which DCP would load with ``torch.load(weights_only=False)``), and every data
file it names is a plain file name inside the checkpoint directory. The tensors themselves DCP loads with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import pickle
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
