"""Dense GEMM throughput over the shapes MoE transformer layers produce (tokens x hidden x FFN).

Each shape is timed as a linear layer's forward GEMM and as its backward: the input-gradient GEMM
``dy (m x n) @ W (n x k)`` and the weight-gradient GEMM ``dyᵀ (n x m) @ x (m x k)``, in the operand layouts
training gives them (PyTorch's linear backward; Transformer Engine's fp8 backward, which feeds
``torch._scaled_mm``-style kernels explicitly transposed operands). The backward runs other kernels than the
forward (a transposed operand, a reduction over the tokens), so its efficiency is measured, not assumed.
"""

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


FP8 = torch.float8_e4m3fn


def gemm_product(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype):
    """A call running one ``(m x k) @ (k x n)`` GEMM on random operands in ``dtype``; float8_e4m3fn runs it
    as Transformer Engine's linears do: ``torch._scaled_mm``, per-tensor scales, bf16 output."""
    if dtype == FP8:
        a_MK = torch.randn(m, k, device=device).to(FP8)
        b_KN = torch.randn(n, k, device=device).to(FP8).t()  # _scaled_mm wants the second operand column-major
        one = torch.ones((), device=device, dtype=torch.float32)
        return lambda: torch._scaled_mm(a_MK, b_KN, one, one, out_dtype=torch.bfloat16)
    a_MK = torch.randn(m, k, device=device, dtype=dtype)
    b_KN = torch.randn(k, n, device=device, dtype=dtype)
    return lambda: a_MK @ b_KN


def backward_products(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype):
    """A call running the backward GEMMs of a linear layer whose forward is ``(m x k) @ (k x n)``: the input
    gradient ``(m x n) @ (n x k)`` and the weight gradient ``(n x m) @ (m x k)``, 2·(2·m·n·k) FLOPs together.

    16/32-bit: as PyTorch's linear backward runs them (``dy @ W`` and ``dy.t() @ x``, the latter on a
    transposed view). float8_e4m3fn: two ``torch._scaled_mm`` calls on explicitly transposed operands, as
    Transformer Engine's fp8 backward does."""
    if dtype == FP8:
        dgrad, wgrad = gemm_product(m, k, n, device, dtype), gemm_product(n, k, m, device, dtype)
        return lambda: (dgrad(), wgrad())
    dy_MN = torch.randn(m, n, device=device, dtype=dtype)
    w_NK = torch.randn(n, k, device=device, dtype=dtype)
    x_MK = torch.randn(m, k, device=device, dtype=dtype)
    return lambda: (dy_MN @ w_NK, dy_MN.t() @ x_MK)


def measure_gemm(shapes: tuple[GemmShape, ...], device: torch.device, dtype: torch.dtype,
                 repeats: int = 3) -> list[dict]:
    """Seconds per shape of the forward GEMM and of the linear layer's two backward GEMMs together:
    ``[{'m','n','k','flops','seconds','bwd_seconds'}]`` (``flops`` is the forward's; the backward does twice
    that). ``dtype`` float8_e4m3fn times ``torch._scaled_mm`` (CUDA GPUs with fp8 tensor cores only)."""
    out = []
    for shape in shapes:
        seconds = time_op(gemm_product(shape.m, shape.n, shape.k, device, dtype), device, repeats=repeats)
        bwd = time_op(backward_products(shape.m, shape.n, shape.k, device, dtype), device, repeats=repeats)
        out.append({"m": shape.m, "n": shape.n, "k": shape.k, "flops": shape.flops, "seconds": seconds,
                    "bwd_seconds": bwd})
    return out
