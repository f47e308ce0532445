"""The one JSON shape of a cost-model Estimate, shared by ``POST /v1/plans`` and ``foldtune plan --json``.

Kept apart from the plan use case so that ``foldtune plan`` needs neither the database nor the HTTP
schemas to write it."""

from __future__ import annotations

from typing import Any


def estimate_dict(e) -> dict[str, Any]:
    """An Estimate as JSON: layout, config, step time (s), throughput, memory (bytes) and their terms."""
    mem = e.memory
    t = e.time
    return {
        "layout": e.config.label(),
        "config": e.config.to_dict(),
        "step_time_s": t.step_time,
        "tokens_per_s_per_gpu": t.tokens_per_s_per_gpu,
        "tflops_per_gpu": t.tflops_per_gpu,
        "mfu": t.mfu,
        "fits": e.fits,
        "memory_headroom_bytes": e.memory_headroom_bytes,
        "limiter": e.limiter,
        "explanation": e.explanation,
        "bottleneck": t.bottleneck,
        "time_terms_s": dict(t.terms),
        "time_hidden_s": dict(t.hidden),
        "memory_bytes": {"total": mem.total, "stage": mem.stage, "weights": mem.weights, "grads": mem.grads,
                         "optimizer": mem.optimizer, "activations": mem.activations, "logits": mem.logits,
                         "comm_buffers": mem.comm_buffers, "allocator_overhead": mem.allocator_overhead,
                         "details": dict(mem.details)},
    }
