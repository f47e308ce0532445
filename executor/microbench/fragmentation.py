"""Allocator fragmentation: what the PyTorch caching allocator reserves beyond what it hands out, measured
over real training steps of a proxy on one GPU.

The memory model predicts allocated bytes (tensors) and adds a share of its dynamic bytes for what the
caching allocator loses to block rounding and splitting (``HardwareProfile.allocator_fragmentation``; the
prior ``costmodel.memory.FRAGMENTATION`` when not measured). This benchmark runs the executor's own blocks
(attention, MoE or dense MLP and the LM head + loss, forward and backward with the fp32 main-gradient hooks,
see :mod:`executor.microbench.components`) of a one-layer proxy of a catalog model for a few steps at
alternating micro-batch sizes (the allocation pattern of a pipeline's varying working set), then reads the
peaks: ``fragmentation = max_memory_reserved / max_memory_allocated - 1`` after the steps, measured from an
empty cache. CUDA only: the CPU allocator keeps no such statistics.
"""

from __future__ import annotations

import torch

from executor.microbench.components import PRECISION_DTYPES, _blocks
from executor.options import ExecutorOptions
from spec.catalog import get_model

#: The proxy: one layer of a fine-grained MoE (many small experts, the allocation pattern of modern MoEs).
PROXY_MODEL = "qwen3-30b-a3b"
PROXY_SEQ = 4096
STEPS = 4


def fragmentation_from_peaks(allocated_peak: int, reserved_peak: int) -> float:
    """``reserved / allocated - 1`` of two peaks in bytes (0 when nothing was allocated), never below 0."""
    if allocated_peak <= 0:
        return 0.0
    return max(0.0, reserved_peak / allocated_peak - 1.0)


def measure_fragmentation(device: torch.device, precision: str = "bf16", model: str = PROXY_MODEL,
                          seq_length: int = PROXY_SEQ, steps: int = STEPS) -> dict | None:
    """Peak allocated and reserved bytes over ``steps`` proxy steps (micro-batch 1, 2, 1, 2, ...) and their
    fragmentation; None on a device without a caching allocator (CPU)."""
    if device.type != "cuda":
        return None
    dtype = PRECISION_DTYPES["bf16" if precision == "fp8" else precision]
    spec = get_model(model).with_layers(1)
    options = ExecutorOptions()
    blocks = {mbs: _blocks(spec, seq_length, mbs, device, dtype, options) for mbs in (1, 2)}
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    for step in range(steps):
        for run in blocks[1 + step % 2].values():
            run()
    torch.cuda.synchronize(device)
    allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    del blocks
    torch.cuda.empty_cache()
    return {"model": f"{model}@1L", "seq_length": seq_length, "steps": steps, "allocated_peak_bytes": allocated,
            "reserved_peak_bytes": reserved, "fragmentation": fragmentation_from_peaks(allocated, reserved)}
