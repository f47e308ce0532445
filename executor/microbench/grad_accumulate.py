"""The fp32 main-gradient accumulation, torch's ``main.add_(grad)`` against the Triton kernel
(executor/kernels/triton_grad_accumulate.py) that replaces it: per gradient size milliseconds per call, the
HBM rate (:data:`BYTES_PER_ELEMENT` bytes an element) and whether one call of each gives the same bits; the
kernel's launch configurations on one large gradient (:data:`SWEEP`). ``bench/grad_accumulate_gpu.py``
prints and stores it.
"""

from __future__ import annotations

import os

import torch

from executor.kernels import triton_grad_accumulate as acc
from executor.microbench.timing import time_op

# (name, elements): Mixtral-8x7B (h 4096, ffn 14336, 8 experts, 32 q / 8 kv heads of 128) on one rank
# without TP/EP, plus small and odd sizes
SIZES = (
    ("experts w13 (8·2·14336·4096)", 8 * 2 * 14336 * 4096),
    ("experts w2 (8·4096·14336)", 8 * 4096 * 14336),
    ("one expert w13 (2·14336·4096)", 2 * 14336 * 4096),
    ("attention qkv (4096·6144)", 4096 * 6144),
    ("attention o (4096·4096)", 4096 * 4096),
    ("odd (1000003)", 1000003),
    ("router (8·4096)", 8 * 4096),
    ("norm (4096)", 4096),
    ("one element", 1),
)
TINY_SIZES = (("odd (1000003)", 1000003), ("three blocks + 5", 3 * acc.BLOCK + 5), ("norm (4096)", 4096),
              ("one element", 1))
HUGE = ("over 2^31 (2^31 + 4099)", 2 ** 31 + 4099)
#: (block, vec, num_warps) tried by --sweep on the w2 gradient (bf16); the first is the kernel's default
SWEEP = ((acc.BLOCK, acc.VEC, acc.NUM_WARPS), (4096, 0, 8), (1024, 4, 4), (2048, 4, 4), (2048, 4, 8),
         (8192, 4, 8), (8192, 4, 16), (16384, 4, 16), (8192, 0, 16))
SWEEP_SIZE = 8 * 4096 * 14336
#: HBM bytes per element: read the 16-bit gradient and the fp32 main gradient, write the main gradient
BYTES_PER_ELEMENT = 2 + 4 + 4


def kernel_runs(device: str) -> bool:
    """The kernel runs on CUDA tensors, and on CPU ones under Triton's interpreter."""
    if acc.triton is None:
        return False
    return device.startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1"


def _timed_ms(fn, device: str, iters: int) -> float:
    """Mean milliseconds of one ``fn()`` over one loop of ``iters`` calls after 3 warm-up calls."""
    return 1e3 * time_op(fn, torch.device(device), iters=iters, repeats=1, warmup=3)


def _iters(n: int, tiny: bool) -> int:
    """About 10 GB of traffic per timed loop on a GPU (at least 10, at most 1000 calls); 3 when tiny."""
    if tiny:
        return 3
    return max(10, min(1000, int(1e10 / (BYTES_PER_ELEMENT * max(n, 1)))))


def measure(name: str, n: int, dtype: torch.dtype, device: str, tiny: bool, run_kernel: bool) -> dict:
    """One row: torch's add_ and (where it runs) the kernel on ``n`` elements, ms, GB/s and bitwise agreement."""
    gen = torch.Generator(device=device).manual_seed(n % 1000)
    main = torch.randn(n, device=device, generator=gen)
    grad = torch.randn(n, device=device, generator=gen).to(dtype)
    row = {"name": name, "elements": n, "grad_dtype": str(dtype).removeprefix("torch."),
           "bytes": BYTES_PER_ELEMENT * n}
    if run_kernel:
        want = main.clone().add_(grad)
        got = acc.accumulate_(main.clone(), grad)
        row["bitwise_equal"] = bool(torch.equal(got.view(torch.int32), want.view(torch.int32)))
        del want, got
    iters = _iters(n, tiny)
    row["iters"] = iters
    row["torch_ms"] = _timed_ms(lambda: main.add_(grad), device, iters)
    row["torch_GBps"] = row["bytes"] / row["torch_ms"] / 1e6
    if run_kernel:
        row["kernel_ms"] = _timed_ms(lambda: acc.accumulate_(main, grad), device, iters)
        row["kernel_GBps"] = row["bytes"] / row["kernel_ms"] / 1e6
        row["speedup"] = row["torch_ms"] / row["kernel_ms"]
    del main, grad
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def sweep(device: str, tiny: bool) -> list[dict]:
    """Each SWEEP configuration of the kernel on one bf16 gradient: ms, GB/s, bitwise agreement with torch."""
    n = 3 * 4096 + 5 if tiny else SWEEP_SIZE
    gen = torch.Generator(device=device).manual_seed(1)
    main = torch.randn(n, device=device, generator=gen)
    grad = torch.randn(n, device=device, generator=gen).to(torch.bfloat16)
    want = main.clone().add_(grad)
    work = main.clone()  # the timed calls accumulate into this one, ``main`` stays the checks' input
    rows = []
    for block, vec, warps in SWEEP:
        got = acc.accumulate_(main.clone(), grad, block, vec, warps)
        ms = _timed_ms(lambda: acc.accumulate_(work, grad, block, vec, warps), device, _iters(n, tiny))
        rows.append({"block": block, "vec": vec, "num_warps": warps, "elements": n, "ms": ms,
                     "GBps": BYTES_PER_ELEMENT * n / ms / 1e6,
                     "bitwise_equal": bool(torch.equal(got.view(torch.int32), want.view(torch.int32)))})
    return rows


def run(device: str, tiny: bool, huge: bool, dtypes: list[torch.dtype], with_sweep: bool = False) -> dict:
    """Every row (see :func:`measure`) for every gradient dtype, plus the first-use check's verdicts."""
    run_kernel = kernel_runs(device)
    sizes = list(TINY_SIZES if tiny else SIZES)
    if huge and device.startswith("cuda") and not tiny:
        sizes.append(HUGE)
    checks = {}
    if run_kernel:
        for dtype in dtypes:
            checks[str(dtype).removeprefix("torch.")] = acc.checked(dtype, torch.device(device))
    rows = [measure(name, n, dtype, device, tiny, run_kernel) for dtype in dtypes for name, n in sizes]
    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
    return {"device": name, "torch": torch.__version__,
            "triton": getattr(acc.triton, "__version__", None), "kernel_ran": run_kernel,
            "interpreter": os.environ.get("TRITON_INTERPRET") == "1", "block": acc.BLOCK,
            "num_warps": acc.NUM_WARPS, "bytes_per_element": BYTES_PER_ELEMENT, "first_use_check": checks,
            "rows": rows, "sweep": sweep(device, tiny) if with_sweep and run_kernel else []}


def passed(result: dict) -> bool:
    """Whether a :func:`run` found the kernel right: every row and sweep entry bitwise equal to torch and every
    first-use check passed (a kernel that disagrees with torch is a failed run)."""
    bad = [r for r in result["rows"] + result["sweep"] if r.get("bitwise_equal") is False]
    return not bad and all(result["first_use_check"].values())
