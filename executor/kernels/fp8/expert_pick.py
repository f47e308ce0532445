"""fp8 or bf16, shape by shape, for the routed experts' grouped GEMMs (``ExecutorOptions.fp8_expert_gemm``
'fastest') and, despite the module's name, the dense linears of the 'torch-fp8' backend (FOLDTUNE_FP8_DENSE, below).

fp8 does not pay at every expert shape: on an H200 torch's rowwise ``_scaled_grouped_mm`` runs the
fine-grained experts (Qwen3-30B-A3B's 128 of 2048 × 768, DeepSeek-V2-Lite's 64 of 2048 × 1408) at about half
bf16's grouped GEMM rate, and quantising the activations costs on top, while on Mixtral's wide experts fp8
wins (docs/benchmarks.md, "Grouped fp8 GEMM at 4096 and 16384 tokens"). So the first call at a shape on a
CUDA GPU times the whole linear layer both ways, forward, dgrad and wgrad (the wgrad only where the weight
gets a gradient): bf16 (``torch._grouped_mm``, the 'torch' backend's) and fp8
(:func:`executor.kernels.fp8.gemm.grouped_mm`, torch's rowwise kernel, its activation quantisation
included), on the call's own rows and weight and a random output gradient. The weight's quantisation is not
timed: the untimed first run of each path puts the weight's forms in the weight cache, as the training step's
first micro-batch does for the rest. The chosen path (below) is kept per (device, experts, N, K, rows rounded
up to a power of two, whether a backward runs), and every later call at that shape runs it (:func:`grouped_mm`).

The timing (:func:`choose`) runs :data:`ROUNDS` rounds, each timing both paths with
:func:`executor.kernels.fp8.grouped_gemm.time_launch` (CUDA events, one untimed call, median of three) and alternating
which path goes first; it keeps fp8 only where fp8's median beats bf16's by more than
:data:`spec.fp8_choice.FP8_CHOICE_MARGIN`. It runs on a thread of its own
(:func:`executor.kernels.first_use.run_apart`: out of activation checkpointing's saved-tensor hooks) on the caller's
stream; it asks ``torch.autograd.grad`` for the gradients, so nothing accumulates into the parameters. A path that
raises (out of memory) is skipped; if both do, fp8.

Where nothing is timed (no CUDA, a CUDA graph being captured) the call runs fp8, as precision fp8 asks, and
no verdict is kept: on CPU that is the emulation of the 'torch' path, so the CPU numerics of fp8 are the
'torch' option's. :data:`TIMER` (or ``timer``) replaces the timing: ``timer(path, call)`` returns the
seconds of ``call`` on ``path`` ('bf16' or 'fp8'); given one, CPU calls are timed with it too (how the tests
force either verdict).

The choice may differ between ranks (each times its own rows) and between runs (two paths within noise of
each other); each rank's numbers are those of the path it runs. :func:`report` says which shapes ran which
path since :func:`reset_counts`.

Dense linears (:func:`linear`: attention's projections, dense MLPs, shared experts) get the same choice, timed the
same way on F.linear and :func:`executor.kernels.fp8.gemm.linear`: with every expert already on bf16, the whole
fp8 step of a DeepSeek-V2-Lite proxy at micro-batch 1 was still slower than bf16, its attention phase 2.5x
bf16's (docs/benchmarks.md; a small projection's fp8 path is four launches where bf16's is one, the likely
but unprofiled reason). FOLDTUNE_FP8_DENSE=fp8 keeps every
dense linear on fp8 (the behaviour before this choice); 'fastest' (the default) chooses. Their shapes are
reported as "dense N x K".
"""

from __future__ import annotations

import os
import statistics
import warnings
from collections import Counter

import torch
import torch.nn.functional as F

from executor.kernels.first_use import run_apart
from executor.kernels.fp8 import gemm as fp8_gemm
from executor.kernels.fp8.grouped_gemm import time_launch
from executor.kernels.torch_backend import TorchBackend
from spec.fp8_choice import fp8_chosen

PATHS = ("bf16", "fp8")
#: rounds of the per-shape timing, each timing both paths with the first one alternating, so that a clock or
#: power change during the timing falls on both; the paths' medians are compared
ROUNDS = 3
#: timer(path, call) -> seconds, replacing the CUDA timing (and timing CPU calls); None: CUDA events on CUDA
TIMER = None
_VERDICTS: dict[tuple, str] = {}  # shape key -> 'bf16' | 'fp8', kept for the process
_RUNS: Counter = Counter()  # (shape key, path) -> calls since reset_counts; path 'fp8 untimed' where none was timed


def dense_choice() -> str:
    """FOLDTUNE_FP8_DENSE: 'fastest' (the default: bf16 or fp8 per dense linear shape) or 'fp8' (always fp8)."""
    value = os.environ.get("FOLDTUNE_FP8_DENSE", "fastest")
    return value if value in ("fastest", "fp8") else "fastest"


def _run(path: str, x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor | None) -> torch.Tensor:
    if offs_G is None:  # a dense linear: w is [N, K]
        return F.linear(x_MK, w_GNK) if path == "bf16" else fp8_gemm.linear(x_MK, w_GNK)
    if path == "bf16":
        return TorchBackend().grouped_mm(x_MK, w_GNK, offs_G)
    return fp8_gemm.grouped_mm(x_MK, w_GNK, offs_G)


def _bucket(m: int) -> int:
    """Row counts that share a verdict: the next power of two (the grouped fp8 tuner's buckets)."""
    return 1 << max(0, m - 1).bit_length()


def shape_key(x_MK: torch.Tensor, w_GNK: torch.Tensor, grad: bool) -> tuple:
    """(device, experts (0: a dense linear), N, K, rows bucket, whether a backward runs)."""
    g, n, k = w_GNK.shape if w_GNK.dim() == 3 else (0, *w_GNK.shape)
    return (str(x_MK.device), g, n, k, _bucket(x_MK.shape[0]), grad)


def _time_paths(x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor, grad: bool, timer) -> str:
    """The faster path of the whole linear layer on these operands (see the module docstring)."""
    stream = torch.cuda.current_stream(x_MK.device) if x_MK.is_cuda else None

    def time_both() -> str:
        x = x_MK.detach().requires_grad_(grad and x_MK.requires_grad)
        inputs = tuple(t for t in (x, w_GNK) if t.requires_grad)
        gen = torch.Generator(device=x_MK.device).manual_seed(0)  # the training's RNG streams stay untouched
        dy = torch.randn(x_MK.shape[0], w_GNK.shape[-2], generator=gen, device=x_MK.device).to(x_MK.dtype)

        def linear(path: str):
            def call() -> None:
                y = _run(path, x, w_GNK, offs_G)
                if grad:
                    torch.autograd.grad(y, inputs, dy)
            return call

        key = shape_key(x_MK, w_GNK, grad)
        return choose(PATHS, lambda path: timer(path, linear(path)),
                      lambda path: f"the {path} GEMM not timed at {key}")

    device = x_MK.device if x_MK.is_cuda else None
    return run_apart(time_both, device, "fp8-or-bf16", stream)


def choose(paths: tuple[str, str], seconds, skipped) -> str:
    """'bf16' or 'fp8' from :data:`ROUNDS` rounds of ``seconds(path)`` (one timing of the whole layer on that
    path) over both ``paths``, alternating which goes first; fp8 where its median is below bf16's by more than
    :data:`spec.fp8_choice.FP8_CHOICE_MARGIN`, else bf16. A path whose timing raises is dropped, with a warning
    that starts with ``skipped(path)`` and gives the exception; the other path then runs. If both raise, fp8."""
    times: dict[str, list[float]] = {path: [] for path in paths}
    dropped: set[str] = set()
    for round_ in range(ROUNDS):
        for path in (paths if round_ % 2 == 0 else paths[::-1]):
            if path in dropped:
                continue
            try:
                times[path].append(seconds(path))
            except Exception as exc:  # noqa: BLE001
                warnings.warn(f"{skipped(path)}: {type(exc).__name__}: {str(exc)[:200]}", stacklevel=3)
                dropped.add(path)
    medians = {path: statistics.median(t) for path, t in times.items() if path not in dropped and t}
    if "bf16" not in medians or "fp8" not in medians:
        return "bf16" if "bf16" in medians else "fp8"
    return "fp8" if fp8_chosen(medians["fp8"], medians["bf16"]) else "bf16"


def verdict(x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor, timer=None) -> str | None:
    """'bf16' or 'fp8' for this call's shape: kept from the first call at the shape, timed then; None where
    it cannot be timed (no CUDA and no ``timer`` nor :data:`TIMER`, or a CUDA graph being captured)."""
    grad = torch.is_grad_enabled() and (x_MK.requires_grad or w_GNK.requires_grad)
    key = shape_key(x_MK, w_GNK, grad)
    if key in _VERDICTS:
        return _VERDICTS[key]
    timer = timer or TIMER
    if timer is None:
        if not x_MK.is_cuda or torch.cuda.is_current_stream_capturing():
            return None
        timer = lambda path, call: time_launch(call)  # noqa: E731
    _VERDICTS[key] = _time_paths(x_MK, w_GNK, offs_G, grad, timer)
    return _VERDICTS[key]


def grouped_mm(x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor, timer=None) -> torch.Tensor:
    """KernelBackend.grouped_mm on whichever of bf16 and fp8 :func:`verdict` keeps for this shape (fp8 where
    none can be timed): rows offs[g-1]:offs[g] of x times w[g]ᵀ (offs int32 cumulative, offs[-1] == M)."""
    if x_MK.shape[0] == 0:  # no rows: the bf16 path's empty product keeps the graph connected
        return TorchBackend().grouped_mm(x_MK, w_GNK, offs_G)
    path = verdict(x_MK, w_GNK, offs_G, timer)
    grad = torch.is_grad_enabled() and (x_MK.requires_grad or w_GNK.requires_grad)
    _RUNS[(shape_key(x_MK, w_GNK, grad), path or "fp8 untimed")] += 1
    return _run(path or "fp8", x_MK, w_GNK, offs_G)


def linear(x: torch.Tensor, w_NK: torch.Tensor, timer=None) -> torch.Tensor:
    """F.linear(x, w) (no bias) on whichever of bf16 and fp8 :func:`verdict` keeps for this shape (fp8 where
    none can be timed, or FOLDTUNE_FP8_DENSE=fp8); x is [..., K], the result [..., N]."""
    x_MK = x.reshape(-1, x.shape[-1])
    if x_MK.shape[0] == 0 or dense_choice() == "fp8":
        return fp8_gemm.linear(x, w_NK)
    path = verdict(x_MK, w_NK, None, timer)
    grad = torch.is_grad_enabled() and (x_MK.requires_grad or w_NK.requires_grad)
    _RUNS[(shape_key(x_MK, w_NK, grad), path or "fp8 untimed")] += 1
    return _run(path or "fp8", x_MK, w_NK, None).view(*x.shape[:-1], w_NK.shape[0])


def report() -> dict:
    """Expert GEMM shapes run since :func:`reset_counts`, by path: 'bf16', 'fp8' (timed faster), 'fp8
    untimed' (no timing possible: fp8 as asked) — each a count of shapes, and 'bf16_shapes' /
    'fp8_shapes' the shapes "experts x N x K, rows <= R" that ran bf16 / fp8, with their calls."""
    shapes: dict[str, dict[str, int]] = {path: {} for path in ("bf16", "fp8", "fp8 untimed")}
    for (key, path), calls in sorted(_RUNS.items()):
        _, g, n, k, rows, _ = key
        label = f"dense {n} x {k}, rows <= {rows}" if g == 0 else f"{g} x {n} x {k}, rows <= {rows}"
        shapes[path][label] = shapes[path].get(label, 0) + calls
    return {"bf16": len(shapes["bf16"]), "fp8": len(shapes["fp8"]), "fp8 untimed": len(shapes["fp8 untimed"]),
            "bf16_shapes": shapes["bf16"], "fp8_shapes": shapes["fp8"]}


def reset_counts() -> None:
    """Start :func:`report` afresh (a rank kept between trials); the verdicts are kept, like the tuner's."""
    _RUNS.clear()
