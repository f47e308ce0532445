"""What offloading costs on this machine: pinned host<->GPU copy bandwidth and the CPU Adam step's throughput.

``measure_host_link``: one pinned CPU buffer and one device buffer of ``nbytes``, copied device-to-host and
host-to-device (``non_blocking`` from/to pinned memory, as the executor's offload does); bytes/s of each
direction and their minimum, the figure the time model prices both directions with. GPUs only (None on CPU:
no host link). ``measure_cpu_adam``: the executor's offloaded AdamW step (``executor.optimizer.HostPart.step``:
torch's fused AdamW where this torch has it, in the executor's blocks, then the weights' cast to bf16) over
``elements`` fp32 master weights, two moments and a gradient in CPU memory; bytes
of optimizer state (12 per element) stepped per second. Every rank measures at once, as training offloads on
every GPU of a node together (they share the PCIe switches and the CPU's cores and memory bandwidth).
"""

from __future__ import annotations

import torch

from executor.microbench.timing import time_op
from executor.optimizer import HostPart, offload_threads

GPU_LINK_BYTES = 256 << 20
# 1.5 GiB of optimizer state: nearer the working set of a real offloaded shard (GBs). At 24 << 20 elements one
# H200 host measured 24.5 GB/s, which priced the CPU part of a 4.5e9-element offloaded step at 2.2 s while its
# whole optimizer phase, copies included, took 1.82 s (bench/offload_gpu.py, docs/benchmarks.md); the rate
# rises with the working set (35.8 / 39.1 / 42.8 GB/s at 24 M, 128 M and 512 M elements).
CPU_ADAM_ELEMENTS = 128 << 20
QUICK_CPU_ADAM_ELEMENTS = 1 << 20


def measure_host_link(device: torch.device, nbytes: int = GPU_LINK_BYTES, repeats: int = 3) -> dict | None:
    """``{'bytes', 'd2h_bytes_per_s', 'h2d_bytes_per_s', 'host_link_bytes_per_s'}``, or None off CUDA."""
    if device.type != "cuda":
        return None
    gpu = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=True)
    d2h = time_op(lambda: host.copy_(gpu, non_blocking=True), device, repeats=repeats)
    h2d = time_op(lambda: gpu.copy_(host, non_blocking=True), device, repeats=repeats)
    out = {"bytes": nbytes, "d2h_bytes_per_s": nbytes / d2h, "h2d_bytes_per_s": nbytes / h2d}
    out["host_link_bytes_per_s"] = min(out["d2h_bytes_per_s"], out["h2d_bytes_per_s"])
    return out


def measure_cpu_adam(elements: int = CPU_ADAM_ELEMENTS, repeats: int = 3, device: torch.device | None = None,
                     pinned: bool | None = None) -> dict:
    """``{'elements', 'threads', 'seconds', 'cpu_adam_bytes_per_s', 'pinned'}`` of one AdamW step over ``elements``
    on the CPU, in the blocks, with the threads and on the kind of host memory (pinned gradient and weight
    buffers for a rank on a GPU) the executor's offloaded step uses for a rank on ``device``. ``pinned`` False
    keeps them pageable on a GPU rank (a comparison; True needs a GPU)."""
    cpu = torch.device("cpu")
    if pinned and (device is None or device.type != "cuda"):
        raise ValueError("pinned host buffers need a GPU rank (device cuda)")
    # From a device tensor, as the executor builds it: its gradient and weight buffers are then pinned (page-
    # locked) host memory, which the CPU step reads and writes; from a CPU tensor they would be pageable.
    gpu = device is not None and device.type == "cuda" and pinned is not False
    source = torch.randn(elements, device=device if gpu else cpu)
    part = HostPart(source, torch.bfloat16)
    del source
    part.grad.normal_()
    hyper = (1e-4, (0.9, 0.95), 1e-8, 0.1, 0.1, 0.05)
    count = torch.tensor(1.0) if hasattr(torch, "_fused_adamw_") else None  # as MixedPrecisionAdam(fused=True)

    def step() -> None:
        part.step(hyper, count)

    threads, before = offload_threads(device or cpu), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seconds = time_op(step, cpu, repeats=repeats, warmup=1, iters=1)
    finally:
        torch.set_num_threads(before)
    return {"elements": elements, "threads": threads, "seconds": seconds,
            "cpu_adam_bytes_per_s": 12 * elements / seconds, "pinned": part.grad.is_pinned()}
