"""Where the executor's fp8 dense linear spends its time, host against device (issue 38: "fp8 that pays").

For one shape (default: weight 4096 x 2048, 4096 rows, bf16) each piece of
:func:`executor.kernels.fp8.gemm.linear` is timed on its own: ``quantize_rowwise`` and ``quantize_both`` of the
activation, a cached ``quantized_weight`` lookup, ``torch._scaled_mm`` on operands quantised beforehand, the
linear's forward (grad on) and its forward + backward, and ``F.linear``'s forward + backward in bf16 beside
them. Per call, in microseconds:

- wall: perf_counter around ``--calls`` calls and a synchronise, divided by the calls;
- events: CUDA events around the same loop (the device's span, which holds the GPU's idle time where the host
  is slower);
- host: the host's seconds to issue one call, nothing synchronised (``timing.time_host_issue``);
- gpu: device time with the host queued ahead behind a GPU sleep (``timing.time_host_ahead``): the kernels'
  own time.

The forward + backward is timed three ways: through ``torch.autograd.grad`` (whose engine runs a CUDA
backward on a device thread of its own), with the backward's node called directly on this thread, and
through ``torch.autograd.grad`` under ``torch.autograd.set_multithreading_enabled(False)``.

Where wall ≈ events ≈ host and gpu is far less, the host is what the GPU waits on. Then the gates and small
host-side calls the linear makes each call are timed alone (``--calls`` x 20 calls each), ``torch.profiler``
records five forward + backward calls (top host self time by op, and the kernels' summed device time a call),
``cProfile`` the Python functions of 20 calls (top own time), and torch's sync debug mode lists any
synchronising call. Run it once as is and once with FOLDTUNE_FP8_TRITON=0 (the torch quantisation) to compare.

    python3 -m bench.fp8_linear_host [--rows 4096 --n 4096 --k 2048] [--json FILE] [--top 25]

CUDA only (the fp8 kernels are sm90's); on the CPU ``--smoke`` runs every step on tiny shapes through the
emulation, to check the script itself.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time

import torch
import torch.nn.functional as F

from executor.kernels.fp8 import gemm, quantize, weight_cache
from executor.microbench.script_args import add_linear_shape_arguments, linear_operands
from executor.microbench.sync_debug import synchronizing_calls
from executor.microbench.timing import synchronize, time_host_ahead, time_host_issue


def time_loop(op, device: torch.device, calls: int) -> tuple[float, float]:
    """(wall seconds, event seconds) per call of ``calls`` calls back to back after two untimed ones (events:
    the wall clock on the CPU)."""
    for _ in range(2):
        op()
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        op()
    if device.type == "cuda":
        end.record()
    synchronize(device)
    wall = (time.perf_counter() - t0) / calls
    return wall, (start.elapsed_time(end) / 1e3 / calls if device.type == "cuda" else wall)


def pieces(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> dict:
    """name -> a call of one piece of the fp8 linear (and the bf16 linear beside it)."""
    kernel = gemm.kernels_ok(x.device)
    xq = quantize.quantize_rowwise(x)
    wq = weight_cache.quantized_weight(w)

    def scaled_mm():
        if kernel:
            return torch._scaled_mm(xq[0], wq[0].t(), xq[1].unsqueeze(1), wq[1].unsqueeze(0), out_dtype=torch.bfloat16)
        return gemm.scaled_mm_nt(None, None, False, wq, a_quantised=xq)

    def fwd_bwd(linear):
        def call():
            y = linear(x, w)
            return torch.autograd.grad(y, (x, w), dy)
        return call

    def single_thread(call):  # the backward on this thread instead of autograd's device thread
        def run():
            with torch.autograd.set_multithreading_enabled(False):
                return call()
        return run

    return {
        "quantize_rowwise(x)": lambda: quantize.quantize_rowwise(x),
        "quantize_both(x)": lambda: quantize.quantize_both(x),
        "quantized_weight(w) cached": lambda: weight_cache.quantized_weight(w),
        "quantized_weight(w, T) cached": lambda: weight_cache.quantized_weight(w, transposed=True),
        "_scaled_mm alone" if kernel else "scaled_mm_nt emulated": scaled_mm,
        "fp8 linear fwd": lambda: gemm.linear(x, w),
        "fp8 linear fwd+bwd": fwd_bwd(gemm.linear),
        "fp8 fwd + bwd on this thread": direct_fwd_bwd(x, w, dy),
        "bf16 F.linear fwd+bwd": fwd_bwd(F.linear),
        "fp8 fwd+bwd, autograd 1 thread": single_thread(fwd_bwd(gemm.linear)),
        "bf16 fwd+bwd, autograd 1 thread": single_thread(fwd_bwd(F.linear)),
    }


def gates(x: torch.Tensor, w: torch.Tensor) -> dict:
    """name -> a host-side call the linear makes every call (gates, checks, buffers), to time alone; a name a
    version of the code lacks is left out."""
    device = x.device
    calls = {
        "gemm.kernels_ok": lambda: gemm.kernels_ok(device),
        "gemm.fast_accum_ok": lambda: gemm.fast_accum_ok(device),
        "torch.ones(4096) on device": lambda: torch.ones(4096, device=device),
        "torch.zeros(4096) on device": lambda: torch.zeros(4096, device=device),
        "torch.empty(4096) on device": lambda: torch.empty(4096, device=device),
        "tensor.view x2 + unsqueeze": lambda: (x.view(torch.int16).view(torch.bfloat16), x[0].unsqueeze(0)),
        "bare add on device (one launch)": lambda: torch.add(x[0], x[0]),
    }
    for name in ("_use_triton", "_hw_cast", "_both_ok", "_fused_rows_ok"):
        if hasattr(quantize, name):
            calls[f"quantize.{name}"] = (lambda f: lambda: f(device))(getattr(quantize, name))
    if hasattr(weight_cache, "_cacheable"):
        calls["weight_cache._cacheable(w)"] = lambda: weight_cache._cacheable(w)
    return calls


def profile_ops(call, device: torch.device, runs: int, top: int) -> tuple[str, float]:
    """(a table of the ops with most host self time over ``runs`` calls, the kernels' device seconds a call)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(runs):
            call()
        synchronize(device)
    averages = prof.key_averages()
    table = averages.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60)
    kernels = sum(getattr(e, "self_device_time_total", 0.0) for e in averages
                  if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    return table, kernels / 1e6 / runs


def direct_fwd_bwd(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor):
    """The fp8 linear's forward, then its backward called on this thread (autograd's engine runs a CUDA
    backward on a thread of its own, which cProfile does not see)."""
    def call():
        y = gemm.linear(x, w)  # held until the backward ran: its graph holds what the backward reads
        node = y.grad_fn
        while type(node).__name__ != "_LinearBackward":  # past the reshape's view, where there is one
            node = node.next_functions[0][0]
        grads = node.apply(dy)
        del y
        return grads
    return call


def profile_python(call, device: torch.device, runs: int, top: int) -> str:
    """cProfile's top ``top`` Python functions over ``runs`` calls (the GPU runs asynchronously), by own time
    and by time with callees, in microseconds a call."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(runs):
        call()
    synchronize(device)
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (primitive calls, calls, own s, with callees s, ..)}
    lines = []
    for title, col in (("own", 2), ("with callees", 3)):
        lines.append(f"{'us a call (' + title + ')':>24} {'calls a call':>12}  function")
        for (file, line, name), row in sorted(stats.items(), key=lambda kv: -kv[1][col])[:top]:
            where = f"{os.path.relpath(file) if file != '~' else ''}:{line}({name})"
            lines.append(f"{row[col] / runs * 1e6:24.1f} {row[1] / runs:12.1f}  {where[-110:]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_linear_shape_arguments(parser)
    parser.add_argument("--calls", type=int, default=50, help="calls per timed loop (default: 50)")
    parser.add_argument("--top", type=int, default=25, help="rows of the profiles (default: 25)")
    parser.add_argument("--json", metavar="FILE", help="also write the numbers as JSON")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU allowed (checks the script)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        parser.error("needs a CUDA GPU with fp8 tensor cores (--smoke runs on the CPU)")
    if args.smoke:
        args.rows, args.n, args.k, args.calls, args.top = 64, 48, 32, 3, 8
    x, w, dy = linear_operands(args.rows, args.n, args.k, device)
    env = {k: v for k, v in os.environ.items() if k.startswith("FOLDTUNE_FP8")}
    print(f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}; "
          f"x {args.rows}x{args.k}, w {args.n}x{args.k}, bf16; env {env or 'default'}; "
          f"kernels: {gemm.emulation_reason(device) or 'yes'}")
    result: dict = {"rows": args.rows, "n": args.n, "k": args.k, "env": env, "pieces": {}, "gates_us": {}}
    print(f"{'piece':<32} {'wall us':>9} {'events us':>9} {'host us':>9} {'gpu us':>9}")
    fwd_bwd = None
    for name, op in pieces(x, w, dy).items():
        wall, events = time_loop(op, device, args.calls)
        host = time_host_issue(op, device, iters=args.calls)
        gpu = time_host_ahead(op, device, calls=8, windows=3)
        result["pieces"][name] = {"wall_us": wall * 1e6, "events_us": events * 1e6, "host_us": host * 1e6,
                                  "gpu_us": gpu.seconds * 1e6, "gpu_method": gpu.method}
        print(f"{name:<32} {wall * 1e6:9.1f} {events * 1e6:9.1f} {host * 1e6:9.1f} {gpu.seconds * 1e6:9.1f}"
              f"{'' if gpu.method.startswith('device time, host ahead') else '  (' + gpu.method + ')'}")
        if name == "fp8 linear fwd+bwd":
            fwd_bwd = op
    print(f"\n{'host-side call':<34} {'us a call':>9}")
    for name, op in gates(x, w).items():
        per = time_host_issue(op, device, iters=args.calls * 20)
        result["gates_us"][name] = per * 1e6
        print(f"{name:<34} {per * 1e6:9.2f}")
    table, kernels = profile_ops(fwd_bwd, device, 5, args.top)
    result["profiler_kernels_us_per_call"] = kernels * 1e6
    print(f"\ntorch.profiler, 5 fp8 fwd+bwd calls: kernels {kernels * 1e6:.1f} us a call (device self time)")
    print(table)
    print("\ncProfile, 20 fp8 forward + backward calls (the backward called directly, on this thread):")
    try:
        print(profile_python(direct_fwd_bwd(x, w, dy), device, 20, args.top))
    except RuntimeError as exc:  # a profile lost is no reason to lose the sync check after it
        print(f"failed: {exc}")
    if device.type == "cuda":
        syncs = synchronizing_calls(lambda: [fwd_bwd() for _ in range(3)])
        result["synchronizing_calls"] = syncs
        print(f"sync debug mode, 3 fp8 fwd+bwd calls: {len(syncs)} synchronizing call(s)")
        for s in syncs:
            print("  " + s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
