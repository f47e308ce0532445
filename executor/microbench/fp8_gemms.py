"""Every GEMM of a step timed in bf16 and in fp8 at its own shape, as the executor calls the kernels
(``torch._grouped_mm``/``torch.mm`` in bf16; ``torch._scaled_grouped_mm``/``torch._scaled_mm`` with per-row
scales in fp8, as :mod:`executor.kernels.fp8.gemm` calls them), each as device time with the host ahead
(:func:`executor.microbench.timing.time_host_ahead`). The shapes come from ``costmodel.fp8_bound.step_gemms``
(any object with the :class:`GemmShape` fields)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from executor.kernels.fp8 import padded_groups, quantize_groups_colwise, quantize_rowwise
from executor.microbench.timing import time_host_ahead


@dataclass(frozen=True)
class GemmShape:
    """out [m, n] = a [m, k] · b [n, k]ᵀ; ``groups`` > 1 for a grouped GEMM (rows split evenly over the
    groups; ``wgrad``: k split over the groups, one [m, n] output per group). The functions here take any
    object with these fields, a ``name`` and ``flops`` (``costmodel.fp8_bound.Gemm``: the executor imports
    no cost model)."""

    m: int
    n: int
    k: int
    groups: int = 1
    wgrad: bool = False

    @property
    def name(self) -> str:
        return f"{self.m}x{self.n}x{self.k}" + (f" in {self.groups}" if self.groups > 1 else "")

    @property
    def flops(self) -> int:
        """FLOPs of one call: 2·m·n·k (a wgrad's k is all groups' rows: the same sum)."""
        return 2 * self.m * self.n * self.k


def offsets(total: int, groups: int, device: torch.device) -> torch.Tensor:
    """The cumulative ends (int32) of ``groups`` equal spans of ``total`` rows, as torch's grouped GEMMs take them."""
    return torch.arange(1, groups + 1, device=device, dtype=torch.int32) * (total // groups)


def _e4m3(shape, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A random operand as the executor's quantisation leaves it (e4m3 bytes, per-row fp32 scales)."""
    return quantize_rowwise(torch.randn(*shape, device=device, dtype=torch.bfloat16))


def bf16_op(g: GemmShape, device: torch.device):
    """A zero-argument call running ``g`` once in bf16, as the bf16 step does."""
    bf = dict(device=device, dtype=torch.bfloat16)
    if g.groups == 1:
        a, b = torch.randn(g.m, g.k, **bf), torch.randn(g.n, g.k, **bf)
        return lambda: torch.mm(a, b.t())
    if g.wgrad:  # dyᵀ [n, rows] · x [rows, k] per group, rows along the contraction
        dy, x = torch.randn(g.k, g.m, **bf), torch.randn(g.k, g.n, **bf)
        offs = offsets(g.k, g.groups, device)
        return lambda: torch._grouped_mm(dy.t(), x, offs=offs)
    a, w = torch.randn(g.m, g.k, **bf), torch.randn(g.groups, g.n, g.k, **bf)
    offs = offsets(g.m, g.groups, device)
    return lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)


def fp8_op(g: GemmShape, device: torch.device, grouped_as_dense: bool = False):
    """A zero-argument call running ``g`` once in fp8 on operands quantised beforehand (per row along the
    contraction; the wgrad per (group, column)); ``grouped_as_dense``: a grouped GEMM as one dense
    ``torch._scaled_mm`` of the same FLOPs."""
    out = torch.bfloat16
    if g.groups == 1 or grouped_as_dense:  # out [m, n], contraction k: a wgrad's too (its k is all rows)
        (qa, sa), (qb, sb) = _e4m3((g.m, g.k), device), _e4m3((g.n, g.k), device)
        return lambda: torch._scaled_mm(qa, qb.t(), sa.unsqueeze(1), sb.unsqueeze(0), out_dtype=out)
    if g.wgrad:  # as executor.kernels.fp8.gemm.scaled_grouped_wgrad calls the kernel: dy, x per (group, column)
        bf = dict(device=device, dtype=torch.bfloat16)
        dy, x = torch.randn(g.k, g.m, **bf), torch.randn(g.k, g.n, **bf)
        groups = padded_groups(offsets(g.k, g.groups, device), g.k)
        (qa, sa), (qb, sb) = quantize_groups_colwise(dy, groups), quantize_groups_colwise(x, groups)
        return lambda: torch._scaled_grouped_mm(qa, qb.t(), sa.flatten(), sb.flatten(), offs=groups.offs_G,
                                                out_dtype=out)
    (qa, sa), (qw, sw) = _e4m3((g.m, g.k), device), _e4m3((g.groups, g.n, g.k), device)
    offs = offsets(g.m, g.groups, device)
    return lambda: torch._scaled_grouped_mm(qa, qw.transpose(-2, -1), sa, sw, offs=offs, out_dtype=out)


def _seconds(op, device: torch.device) -> float:
    return time_host_ahead(op, device, calls=8, windows=5).seconds


def time_gemms(gemms: Sequence[GemmShape], device: torch.device,
               progress: Callable[[str], object] = print) -> list[dict]:
    """Per GEMM (a dataclass): its fields and one call's device seconds in bf16 (``bf16_s``), in fp8
    (``fp8_s``) and, for grouped GEMMs, in fp8 as one dense GEMM of the same FLOPs (``fp8_dense_s``), with
    the TFLOP/s of each."""
    rows = []
    for g in gemms:
        row = asdict(g) | {"bf16_s": _seconds(bf16_op(g, device), device),
                           "fp8_s": _seconds(fp8_op(g, device), device)}
        row["fp8_dense_s"] = _seconds(fp8_op(g, device, True), device) if g.groups > 1 else row["fp8_s"]
        for key in ("bf16", "fp8", "fp8_dense"):
            row[f"{key}_tflops"] = g.flops / row[f"{key}_s"] / 1e12
        progress(f"  {g.name:14s} bf16 {row['bf16_tflops']:6.0f}  fp8 {row['fp8_tflops']:6.0f}  "
                 f"fp8 as dense {row['fp8_dense_tflops']:6.0f} TFLOP/s")
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows
