"""Causal attention throughput of the executor's kernel (SDPA: flash / cuDNN on a GPU) vs key length.

Two head shapes: ``mha`` (query, key and value heads of one width, Llama/Mixtral-like) and ``mla`` (MLA's
query/key heads wider than its value heads, DeepSeek-V2/V3's 192/128): SDPA's flash kernel needs one width
for all three, so the second runs on another kernel at another speed, which the time model prices from its
own curve.

The time model prices the attention core as FLOPs over the 16-bit peak times an efficiency; this measures
that efficiency, forward and backward, at the key lengths a step produces. FLOPs are the time model's own
(``spec.flops.attention_fwd_flops``, causal; backward ``ATTENTION_BWD_FLOP_RATIO`` times that),
whatever the kernel actually executes.
"""

from __future__ import annotations

import torch

from spec.flops import ATTENTION_BWD_FLOP_RATIO, attention_fwd_flops
from executor.kernels.torch_backend import TorchBackend
from executor.microbench.timing import time_op

# kind -> (heads, query/key head dim, value head dim): Llama/Mixtral-like and DeepSeek-V2/V3's MLA on GPU
# (heads equal to KV heads: the kernel itself, no GQA copy), small on CPU; tokens per call kept near
# ``TOKENS`` by the batch size.
GPU_SHAPES = {"mha": (32, 128, 128), "mla": (16, 192, 128)}
CPU_SHAPES = {"mha": (4, 32, 32), "mla": (4, 48, 32)}
KINDS = tuple(GPU_SHAPES)
GPU_SEQS = (256, 512, 1024, 2048, 4096, 8192)
CPU_SEQS = (64, 128, 256)
GPU_TOKENS = 16384
CPU_TOKENS = 512


def default_seqs(device: torch.device, quick: bool) -> tuple[int, ...]:
    """Key lengths to measure on ``device``."""
    seqs = GPU_SEQS if device.type == "cuda" else CPU_SEQS
    return seqs[1::2] if quick and len(seqs) > 3 else seqs


def measure_attention(seqs: tuple[int, ...], device: torch.device, dtype: torch.dtype, repeats: int = 3,
                      kind: str = "mha") -> list[dict]:
    """Forward and backward seconds of causal attention per key length, for the head shape ``kind``
    (:data:`GPU_SHAPES`).

    Returns ``[{'kind', 'seq', 'batch', 'heads', 'head_dim', 'v_head_dim', 'fwd_flops', 'bwd_flops',
    'fwd_seconds', 'bwd_seconds'}]``; the backward is timed as forward+backward minus the forward.
    """
    heads, head_dim, v_head_dim = (GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)[kind]
    tokens = GPU_TOKENS if device.type == "cuda" else CPU_TOKENS
    backend = TorchBackend()
    out = []
    for seq in seqs:
        batch = max(1, tokens // seq)
        q, k = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
                for _ in range(2))
        v = torch.randn(batch, heads, seq, v_head_dim, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn(batch, heads, seq, v_head_dim, device=device, dtype=dtype)

        def fwd():
            with torch.no_grad():
                return backend.attention(q, k, v)

        def fwd_bwd():
            torch.autograd.grad(backend.attention(q, k, v), (q, k, v), grad)

        t_fwd = time_op(fwd, device, repeats=repeats)
        t_both = time_op(fwd_bwd, device, repeats=repeats)
        flops = attention_fwd_flops(batch * seq, seq, heads, head_dim, v_head_dim)
        out.append({"kind": kind, "seq": seq, "batch": batch, "heads": heads, "head_dim": head_dim,
                    "v_head_dim": v_head_dim, "fwd_flops": flops,
                    "bwd_flops": ATTENTION_BWD_FLOP_RATIO * flops, "fwd_seconds": t_fwd,
                    "bwd_seconds": max(t_both - t_fwd, 1e-9)})
    return out
