"""Grouped-GEMM throughput of the executor's expert kernel vs tokens per expert, at several expert shapes.

The kernel's efficiency at a given number of tokens per expert depends on the expert's size too. At t
tokens per expert every shape does 2·t FLOPs per weight element (t per weight byte in 16 bits), but a
fine-grained expert (hidden 2048, FFN 768: 1.6 M weights) is a far smaller GEMM than a Mixtral one (4096 x
14336: 58.7 M): fewer output tiles to fill the SMs with and a shorter reduction loop per tile. Each shape gets
its own curve; the time model reads a GEMM's efficiency at its weight size.
"""

from __future__ import annotations

import torch

from executor.kernels.fp8.gemm import OUT, fast_accum_ok
from executor.kernels.fp8.quantize import quantize_rowwise
from executor.kernels.torch_backend import TorchBackend
from executor.microbench.timing import time_op

# (experts on the rank, hidden, expert FFN). GPU: a Mixtral-8x7B slice (the reference: its curve is the
# profile's grouped_gemm_efficiency), a DeepSeek-V3-like slice (8 of 256 experts) and a fine-grained one
# (hidden 2048, FFN 768, as the executor benchmark's fine-grained MoE layer). CPU: tiny-moe-like toys.
GPU_EXPERT_SHAPE = (8, 4096, 14336)
GPU_EXPERT_SHAPES = (GPU_EXPERT_SHAPE, (8, 7168, 2048), (16, 2048, 768))
CPU_EXPERT_SHAPE = (4, 64, 128)
CPU_EXPERT_SHAPES = (CPU_EXPERT_SHAPE, (8, 32, 64))
GPU_TOKENS = (16, 64, 256, 1024, 4096, 16384)
CPU_TOKENS = (4, 16, 64, 256, 1024)


def default_tokens(device: torch.device, quick: bool) -> tuple[int, ...]:
    """Tokens per expert to measure on ``device``."""
    tokens = GPU_TOKENS if device.type == "cuda" else CPU_TOKENS
    return tokens[::2] if quick and len(tokens) > 3 else tokens


def default_shapes(device: torch.device) -> tuple[tuple[int, int, int], ...]:
    """(experts, hidden, expert FFN) shapes to measure on ``device``, the reference shape first."""
    return GPU_EXPERT_SHAPES if device.type == "cuda" else CPU_EXPERT_SHAPES


def measure_grouped_gemm(tokens_per_expert: tuple[int, ...], device: torch.device, dtype: torch.dtype,
                         shape: tuple[int, int, int] | None = None, repeats: int = 3) -> list[dict]:
    """Seconds of one grouped fc1 GEMM (``experts`` x ``(t x hidden) @ (hidden x ffn)``) per t.

    Returns ``[{'tokens_per_expert', 'experts', 'hidden', 'ffn', 'flops', 'seconds'}]``.
    """
    experts, hidden, ffn = shape or (GPU_EXPERT_SHAPE if device.type == "cuda" else CPU_EXPERT_SHAPE)
    backend = TorchBackend()
    w_GNK = torch.randn(experts, ffn, hidden, device=device, dtype=dtype)
    out = []
    for t in tokens_per_expert:
        x_MK = torch.randn(experts * t, hidden, device=device, dtype=dtype)
        offs_G = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * t
        flops = 2.0 * experts * t * hidden * ffn
        seconds = time_op(lambda x=x_MK, o=offs_G: backend.grouped_mm(x, w_GNK, o), device, repeats=repeats)
        out.append({"tokens_per_expert": t, "experts": experts, "hidden": hidden, "ffn": ffn, "flops": flops,
                    "seconds": seconds})
    return out


def measure_grouped_gemm_fp8(tokens_per_expert: tuple[int, ...], device: torch.device,
                             shape: tuple[int, int, int] | None = None, repeats: int = 3) -> list[dict]:
    """Seconds of the same grouped fc1 GEMM as :func:`measure_grouped_gemm` on the fp8 path the executor's
    experts take (torch's scaled grouped GEMM, e4m3 operands with per-row scales, bf16 out, the fast
    accumulation where its first-use check passed), operands quantised beforehand: the GEMM alone, since the
    cost model prices the activations' quantisation as its own bytes. CUDA only.

    Returns ``[{'tokens_per_expert', 'experts', 'hidden', 'ffn', 'flops', 'seconds', 'precision': 'fp8'}]``.
    """
    experts, hidden, ffn = shape or GPU_EXPERT_SHAPE
    w_GNK = torch.randn(experts, ffn, hidden, device=device, dtype=torch.bfloat16)
    qw, sw = quantize_rowwise(w_GNK)
    fast = fast_accum_ok(device)
    out = []
    for t in tokens_per_expert:
        qx, sx = quantize_rowwise(torch.randn(experts * t, hidden, device=device, dtype=torch.bfloat16))
        offs_G = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * t
        flops = 2.0 * experts * t * hidden * ffn

        def gemm(qx=qx, sx=sx, offs=offs_G):
            return torch._scaled_grouped_mm(qx, qw.transpose(-2, -1), sx, sw, offs=offs, out_dtype=OUT,
                                            use_fast_accum=fast)

        seconds = time_op(gemm, device, repeats=repeats)
        out.append({"tokens_per_expert": t, "experts": experts, "hidden": hidden, "ffn": ffn, "flops": flops,
                    "seconds": seconds, "precision": "fp8"})
    return out
