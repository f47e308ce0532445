"""Device-memory (HBM, or RAM on CPU) copy bandwidth."""

from __future__ import annotations

import torch

from executor.microbench.timing import time_op

GPU_COPY_BYTES = (64 << 20, 256 << 20, 1 << 30)
CPU_COPY_BYTES = (64 << 20, 128 << 20)  # well above a server's last-level cache (32 MiB here): RAM, not cache


def default_sizes(device: torch.device, quick: bool) -> tuple[int, ...]:
    sizes = GPU_COPY_BYTES if device.type == "cuda" else CPU_COPY_BYTES
    return sizes[-1:] if quick else sizes


def measure_copy(sizes: tuple[int, ...], device: torch.device, repeats: int = 3) -> list[dict]:
    """Seconds to copy ``nbytes`` into another buffer; traffic counted as read + write (2 x nbytes),
    the convention of the cost model's memory-bound terms. Returns ``[{'bytes', 'traffic_bytes', 'seconds'}]``."""
    out = []
    for nbytes in sizes:
        src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).uniform_()
        dst = torch.empty_like(src)
        seconds = time_op(lambda s=src, d=dst: d.copy_(s), device, repeats=repeats)
        out.append({"bytes": nbytes, "traffic_bytes": 2 * nbytes, "seconds": seconds})
        del src, dst
    return out
