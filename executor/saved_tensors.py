"""What autograd keeps for backward: the bytes of the distinct storages a forward saves."""

from __future__ import annotations

from collections.abc import Callable

import torch


def saved_storage_bytes(run: Callable[[], object], skip: list[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves while ``run()`` executes (each storage counted once,
    however many views of it are saved), leaving out the storages of ``skip`` (inputs and parameters that
    live anyway). Returns bytes; ``run``'s result is dropped."""
    skipped = {t.untyped_storage().data_ptr() for t in skip}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skipped:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(storages.values())
