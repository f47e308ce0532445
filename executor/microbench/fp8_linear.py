"""The executor's fp8 dense linear against bf16's, forward + backward as the step runs them, per shape.

fp8 buys GEMM throughput but each call also quantises its input and output gradient and pays more host work
(launches, scales); at a few thousand rows that can cost more than the GEMMs save. ``foldtune calibrate
--precision fp8`` times :func:`executor.kernels.fp8.gemm.linear` (its weight's fp8 forms cached, as from a
step's second micro-batch on) and ``F.linear`` in bf16, each forward + input and weight gradients through
autograd, in a loop (:func:`executor.microbench.timing.time_op`: wall time, the host queued ahead where it
can be), so the cost model reads the measured bf16 / fp8 time by the linear's forward FLOPs
(``HardwareProfile.dense_fp8_over_bf16``) instead of pricing the fp8 GEMMs from their peak.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from executor.kernels.fp8.gemm import linear as fp8_linear
from executor.microbench.script_args import linear_operands
from executor.microbench.timing import time_op

#: (rows, out features, in features): attention projections and shared experts of the proxies at one and
#: eight micro-batches of 4096 tokens
GPU_SHAPES = tuple((m, n, k) for m in (4096, 32768) for n, k in ((512, 2048), (2048, 2048), (4096, 2048),
                                                                  (5632, 2048)))


def _fwd_bwd(fn, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor):
    def op():
        return torch.autograd.grad(fn(x, w), (x, w), g)
    return op


def measure_linear_fp8(shapes: tuple[tuple[int, int, int], ...], device: torch.device,
                       repeats: int = 3) -> list[dict]:
    """Per (m, n, k): ``{'m', 'n', 'k', 'flops', 'seconds', 'bf16_seconds'}``: seconds of one forward +
    backward of the executor's fp8 linear (y [m, n] = x [m, k] · wᵀ) and of bf16's ``F.linear``; ``flops``
    is the forward's 2·m·n·k. CUDA only."""
    out = []
    for m, n, k in shapes:
        x, w, g = linear_operands(m, n, k, device)
        bf16 = time_op(_fwd_bwd(F.linear, x, w, g), device, repeats=repeats)
        fp8 = time_op(_fwd_bwd(fp8_linear, x, w, g), device, repeats=repeats)
        out.append({"m": m, "n": n, "k": k, "flops": 2.0 * m * n * k, "seconds": fp8, "bf16_seconds": bf16})
    return out
