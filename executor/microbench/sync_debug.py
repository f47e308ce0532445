"""Where a step makes the host wait for the device, as torch's sync debug mode reports it.

``torch.cuda.set_sync_debug_mode("warn")`` turns each synchronizing call into a warning. Setting the mode also
warns once per call that the mode "is a prototype feature and does not yet detect all synchronizing
operations": that notice names no synchronizing call and is left out (counted, it would add one call to every
step).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch


def synchronizing_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    """'file:line: message' of each warning that reports a synchronizing call (the prototype notice left out)."""
    out = []
    for w in caught:
        text = str(w.message)
        if "synchroniz" in text.lower() and "prototype" not in text:
            out.append(f"{os.path.relpath(w.filename)}:{w.lineno}: {text[:80]}")
    return out


def synchronizing_calls(step: Callable[[], object]) -> list[str]:
    """Run ``step()`` once under the sync debug mode (restored afterwards, exceptions included) and return where
    it made the host wait for the device (:func:`synchronizing_warnings`). CUDA only."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return synchronizing_warnings(caught)
