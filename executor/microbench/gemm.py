"""Dense GEMM throughput over the shapes MoE transformer layers produce (tokens x hidden x FFN)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.microbench.timing import time_op


@dataclass(frozen=True)
class GemmShape:
    """One ``(m x k) @ (k x n)`` product: m tokens, k input features, n output features."""

    m: int
    n: int
    k: int

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


# GPU: attention projections and dense/shared-expert FFNs of 1k-7k hidden models at 512-16k tokens,
# spanning ~0.5 GFLOP (launch-bound) to ~1 TFLOP (saturated).
GPU_SHAPES = (GemmShape(512, 1024, 1024), GemmShape(1024, 2048, 2048), GemmShape(2048, 4096, 4096),
              GemmShape(4096, 4096, 4096), GemmShape(4096, 14336, 4096), GemmShape(8192, 4096, 14336),
              GemmShape(16384, 7168, 7168))
# CPU: the toy models the CPU executor runs (hidden 64-256, 64-1024 tokens) up to a saturated size.
CPU_SHAPES = (GemmShape(64, 64, 64), GemmShape(128, 128, 64), GemmShape(256, 256, 64), GemmShape(256, 256, 256),
              GemmShape(512, 512, 256), GemmShape(512, 512, 512), GemmShape(1024, 1024, 1024))


def default_shapes(device: torch.device, quick: bool) -> tuple[GemmShape, ...]:
    """The shapes to measure on ``device``; ``quick`` keeps every other one (still small to large)."""
    shapes = GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    return shapes[::2] if quick else shapes


def measure_gemm(shapes: tuple[GemmShape, ...], device: torch.device, dtype: torch.dtype,
                 repeats: int = 3) -> list[dict]:
    """Seconds of one GEMM per shape: ``[{'m','n','k','flops','seconds'}]``."""
    out = []
    for shape in shapes:
        a_MK = torch.randn(shape.m, shape.k, device=device, dtype=dtype)
        b_KN = torch.randn(shape.k, shape.n, device=device, dtype=dtype)
        seconds = time_op(lambda a=a_MK, b=b_KN: a @ b, device, repeats=repeats)
        out.append({"m": shape.m, "n": shape.n, "k": shape.k, "flops": shape.flops, "seconds": seconds})
    return out
