"""fp8 or bf16 for each dense linear of the 4-layer proxies: what the executor's timing picks against what the cost
model prices (issue 38: fp8 as a decision that is checked).

For each dense linear of Qwen3-30B-A3B's and DeepSeek-V2-Lite's layers (attention projections, MLA's latent
projections, the shared experts) at the rows of one micro-batch of seq 4096 (micro-batch 1 and 8), the whole linear
layer, forward plus backward (dgrad and wgrad), is timed both ways on one GPU: ``F.linear`` in bf16 and
:func:`executor.kernels.fp8.gemm.linear` (torch's rowwise ``_scaled_mm`` with the activation quantisation it
needs; the weight's quantised forms cached as after a step's first micro-batch). Each as device time (CUDA events)
and as wall time with a synchronise (the host's share shows where the second is larger). The cost model's side is
``costmodel.compute.gemm_fwd_bwd`` at the h200 catalog's bf16 and fp8 rates plus, for fp8, the quantisation bytes
it prices (``costmodel.step_time.dense_linear_seconds_and_cast_bytes``, the cost model's own pricing of a linear).

    python3 -m bench.fp8_dense_choice            # GPU; prints the table and --json writes it
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from costmodel.compute import compute_rates, gemm_fwd_bwd, memory_time
from costmodel.step_time import FP8_BOTH_FORMS_BYTES, dense_linear_seconds_and_cast_bytes
from spec import get_hardware

# (model, linear, N, K) from the catalog's widths: hidden 2048 for both
SHAPES = (
    ("qwen3-30b-a3b", "q", 32 * 128, 2048),
    ("qwen3-30b-a3b", "k or v", 4 * 128, 2048),
    ("qwen3-30b-a3b", "o", 2048, 32 * 128),
    ("deepseek-v2-lite", "q", 16 * (128 + 64), 2048),
    ("deepseek-v2-lite", "kv down", 512 + 64, 2048),
    ("deepseek-v2-lite", "kv up", 16 * (128 + 128), 512),
    ("deepseek-v2-lite", "o", 2048, 16 * 128),
    ("deepseek-v2-lite", "shared fc1", 2 * 2816, 2048),
    ("deepseek-v2-lite", "shared fc2", 2048, 2816),
)


def _time(call, repeats: int) -> tuple[float, float]:
    """(median device seconds, median wall seconds) of ``call()`` after two untimed calls."""
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    device, wall = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        call()
        end.record()
        end.synchronize()
        wall.append(time.perf_counter() - t0)
        device.append(start.elapsed_time(end) / 1e3)
    return statistics.median(device), statistics.median(wall)


def measure(rows: int, n: int, k: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Seconds of one linear layer's forward + backward, bf16 and fp8 (device, wall)."""
    from executor.kernels.fp8 import gemm as fp8_gemm

    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5)
    dy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)

    def run(linear):
        def call():
            y = linear(x, w)
            gx, gw = torch.autograd.grad(y, (x, w), dy)
            return gx, gw
        return call

    return {"bf16": _time(run(F.linear), repeats), "fp8": _time(run(fp8_gemm.linear), repeats)}


def priced(rows: int, n: int, k: int) -> dict[str, float]:
    """The cost model's seconds of the same layer: bf16 GEMMs; fp8 GEMMs plus the quantisation it prices."""
    h200 = get_hardware("h200")
    bf16, fp8 = compute_rates(h200, "bf16"), compute_rates(h200, "fp8")
    fwd, bwd, cast_fwd, cast_bwd, _ = dense_linear_seconds_and_cast_bytes(fp8, None, rows, n, k, FP8_BOTH_FORMS_BYTES,
                                                                        FP8_BOTH_FORMS_BYTES)
    return {"bf16": sum(gemm_fwd_bwd(bf16, rows, n, k)),
            "fp8": fwd + bwd + memory_time(fp8, cast_fwd) + memory_time(fp8, cast_bwd)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per path (default: 20)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU with fp8 tensor cores")
    rows_out = []
    print(f"{torch.cuda.get_device_name()}, seq 4096; ms of forward + backward (device / wall); choice: faster path")
    print(f"{'model':<17} {'linear':<10} {'N x K':>11} {'rows':>6} {'bf16':>15} {'fp8':>15} {'runs':>5}"
          f" {'priced bf16':>11} {'priced fp8':>10} {'prices':>6}")
    for rows in (4096, 8 * 4096):
        for model, name, n, k in SHAPES:
            got, model_s = measure(rows, n, k, args.repeats), priced(rows, n, k)
            runs = "bf16" if got["bf16"][0] <= got["fp8"][0] else "fp8"
            prices = "bf16" if model_s["bf16"] <= model_s["fp8"] else "fp8"
            rows_out.append({"model": model, "linear": name, "n": n, "k": k, "rows": rows,
                             "bf16_device_s": got["bf16"][0], "bf16_wall_s": got["bf16"][1],
                             "fp8_device_s": got["fp8"][0], "fp8_wall_s": got["fp8"][1],
                             "priced_bf16_s": model_s["bf16"], "priced_fp8_s": model_s["fp8"],
                             "runs": runs, "prices": prices})
            print(f"{model:<17} {name:<10} {f'{n}x{k}':>11} {rows:>6} "
                  f"{got['bf16'][0] * 1e3:6.3f}/{got['bf16'][1] * 1e3:6.3f} "
                  f"{got['fp8'][0] * 1e3:6.3f}/{got['fp8'][1] * 1e3:6.3f} {runs:>5} "
                  f"{model_s['bf16'] * 1e3:11.3f} {model_s['fp8'] * 1e3:10.3f} {prices:>6}", flush=True)
    agree = sum(r["runs"] == r["prices"] for r in rows_out)
    print(f"the cost model prices the faster path for {agree} of {len(rows_out)} shapes")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows_out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
