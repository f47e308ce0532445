"""Why the fp8 dense linear's backward costs more host time through autograd's engine than called directly (issue 38).

bench/fp8_linear_host.py found, on one H200, the fp8 linear's forward + backward at ~360 us of host time with the
backward's node called directly on the main thread but ~760 us through ``torch.autograd.grad`` (~980 us with the
engine on one thread), the same kernels either way. This script times one forward + backward of
:func:`executor.kernels.fp8.gemm.linear` (weight 4096 x 2048, 4096 rows by default) every way the backward can be
reached, and custom autograd Functions that each keep one piece of it, so that the extra cost is pinned on a piece:

- ways: ``direct`` (``grad_fn.apply(dy)`` on this thread, grad mode on), ``direct no_grad`` (the same under
  ``torch.no_grad``, as the engine runs it), ``worker thread`` (``grad_fn.apply`` on a long-lived Python thread:
  a Triton launch off the main thread), ``engine`` (``torch.autograd.grad``), ``engine 1 thread`` (under
  ``set_multithreading_enabled(False)``), ``.backward()`` (gradients accumulated into ``.grad``);
- Functions: the fp8 linear itself; ``empty`` (the same inputs, saved tensors and ctx attributes, a backward that
  only allocates its two gradients: the engine's own cost a node); ``triton`` (a backward that runs
  ``quantize_both`` of dy, two Triton launches and a fill); ``scaled_mm`` (a backward of two ``torch._scaled_mm``
  calls on operands quantised beforehand); ``bf16`` (a backward of two bf16 matmuls).

Per call, us: ``issue`` (host seconds of ``--calls`` calls, before the closing synchronise) and ``wall`` (the same
with the synchronise), median of ``--repeats`` loops; the fp8 linear's backward body is also timed from inside
(perf_counter around ``_Linear.backward`` and its pieces). Then torch.profiler's host self time by op, direct
against engine, shows which ops grow.

    python3 -m bench.fp8_autograd_overhead [--rows 4096 --n 4096 --k 2048] [--json FILE]
    taskset -c 3 python3 -m bench.fp8_autograd_overhead     # the process on one core: threads share it

What it found on one H200 (docs/benchmarks.md, "fp8 linear: the autograd engine's overhead"): every piece of
host work costs about twice as much on a thread other than the one that ran the forward (the engine's device
thread and a plain Python thread alike), and the engine's own cost a node is ~50-110 us; pinned to one core,
engine and direct calls come within ~100 us of each other.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import threading
import time
from collections import defaultdict

import torch

from executor.kernels.fp8 import gemm, quantize, weight_cache
from executor.microbench.script_args import add_linear_shape_arguments, linear_operands
from executor.microbench.timing import sleep_cycles_per_second


class _Empty(torch.autograd.Function):
    """The fp8 linear's interface (x, w, kernel, grad), two saved tensors and ctx attributes, no work."""

    @staticmethod
    def forward(ctx, x, w, kernel, grad):
        ctx.kernel, ctx.x_dtype, ctx.x_shape, ctx.weight = kernel, x.dtype, x.shape, w
        ctx.save_for_backward(x, x)
        return x.new_empty(x.shape[0], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        _ = ctx.saved_tensors, ctx.needs_input_grad[:2]  # read as the fp8 linear's backward reads them
        x = ctx.saved_tensors[0]
        return torch.empty_like(x), torch.empty_like(ctx.weight), None, None


def _work_function(name: str, body):
    """_Empty with ``body(ctx, dy)`` run in the backward before the gradients are allocated."""
    def backward(ctx, dy):
        body(ctx, dy)
        return _Empty.backward(ctx, dy)
    return type(name, (torch.autograd.Function,), {"forward": staticmethod(_Empty.forward),
                                                   "backward": staticmethod(backward)})


def ways(apply, x, w, dy, worker) -> dict:
    """name -> one forward + backward of ``apply(x, w)`` reaching the backward that way."""
    def direct():
        y = apply(x, w)
        out = y.grad_fn.apply(dy)
        del y
        return out

    def direct_no_grad():
        y = apply(x, w)
        with torch.no_grad():
            out = y.grad_fn.apply(dy)
        del y
        return out

    def on_worker():
        y = apply(x, w)
        out = worker(lambda: y.grad_fn.apply(dy))
        del y
        return out

    def engine():
        return torch.autograd.grad(apply(x, w), (x, w), dy)

    def engine_one_thread():
        with torch.autograd.set_multithreading_enabled(False):
            return torch.autograd.grad(apply(x, w), (x, w), dy)

    def backward():
        x.grad = w.grad = None
        apply(x, w).backward(dy)

    return {"direct": direct, "direct no_grad": direct_no_grad, "worker thread": on_worker, "engine": engine,
            "engine 1 thread": engine_one_thread, ".backward()": backward}


def make_worker():
    """A long-lived Python thread running the calls handed to it (returns a call-and-wait function)."""
    jobs: queue.Queue = queue.Queue()

    def loop():
        while True:
            fn, done = jobs.get()
            if fn is None:
                return
            done.put(fn())

    thread = threading.Thread(target=loop, daemon=True, name="bench-worker")
    thread.start()

    def call(fn):
        done: queue.Queue = queue.Queue()
        jobs.put((fn, done))
        return done.get()
    return call


def time_call(op, calls: int, repeats: int) -> tuple[float, float]:
    """(issue, wall) seconds a call: medians over ``repeats`` loops of ``calls`` calls after two untimed ones."""
    for _ in range(2):
        op()
    torch.cuda.synchronize()
    issue, wall = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            op()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        issue.append((t1 - t0) / calls)
        wall.append((t2 - t0) / calls)
    return statistics.median(issue), statistics.median(wall)


class PieceTimer:
    """perf_counter around the fp8 linear's backward and the calls it makes (patched in, restored on exit)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.saved: list = []

    def wrap(self, owner, name, label, static=False):
        original = owner.__dict__[name]
        fn = original.__func__ if static else original

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - t0
        setattr(owner, name, staticmethod(timed) if static else timed)
        self.saved.append((owner, name, original))

    def __enter__(self):
        self.wrap(gemm._Linear, "backward", "backward body", static=True)
        self.wrap(gemm, "quantize_both", "quantize_both")
        self.wrap(gemm, "scaled_mm_nt", "scaled_mm_nt")
        self.wrap(gemm, "quantized_weight", "quantized_weight")
        self.wrap(quantize, "_quantize_both_triton", "both: Triton path")
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self.saved):
            setattr(owner, name, original)


def top_ops(op, runs: int, top: int) -> dict[str, tuple[float, int]]:
    """op name -> (host self us a call, count a call) over ``runs`` calls, the ``top`` largest."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            op()
        torch.cuda.synchronize()
    rows = [(e.key, e.self_cpu_time_total / runs, e.count / runs) for e in prof.key_averages()]
    rows.sort(key=lambda r: -r[1])
    return {k: (round(t, 1), c) for k, t, c in rows[:top]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_linear_shape_arguments(parser)
    parser.add_argument("--calls", type=int, default=30, help="calls per timed loop (default: 30)")
    parser.add_argument("--repeats", type=int, default=3, help="timed loops, the median taken (default: 3)")
    parser.add_argument("--json", metavar="FILE", help="also write the numbers as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU with fp8 tensor cores")
    x, w, dy = linear_operands(args.rows, args.n, args.k, "cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; x {args.rows}x{args.k}, w {args.n}x{args.k}; "
          f"kernels: {gemm.emulation_reason('cuda') or 'yes'}; python threads: "
          f"{[t.name for t in threading.enumerate()]}")
    worker = make_worker()
    xq = quantize.quantize_rowwise(x.detach())
    wq = weight_cache.quantized_weight(w)

    def two_scaled_mm(ctx, g):
        for _ in range(2):
            torch._scaled_mm(xq[0], wq[0].t(), xq[1].unsqueeze(1), wq[1].unsqueeze(0), out_dtype=torch.bfloat16)

    seen: list = []

    def where(ctx, g):
        seen.append((threading.current_thread().name, torch.cuda.current_stream().cuda_stream,
                     torch.is_grad_enabled(), torch.cuda.current_device()))

    probe = _work_function("Probe", where).apply
    for wname, op in ways(lambda x_, w_: probe(x_, w_, True, True), x, w, dy, worker).items():
        seen.clear()
        op()
        print(f"backward context, {wname}: thread, stream, grad mode, device = {seen[0]}; main stream "
              f"{torch.cuda.current_stream().cuda_stream}")

    functions = {
        "fp8 linear": gemm.linear,
        "empty": _Empty.apply,
        "triton (quantize_both dy)": _work_function("Triton", lambda ctx, g: quantize.quantize_both(g)).apply,
        "scaled_mm x2": _work_function("ScaledMM", two_scaled_mm).apply,
        "bf16 matmul x2": _work_function("Bf16", lambda ctx, g: (g.t() @ x.detach(), g @ w.detach())).apply,
    }
    result: dict = {"shape": vars(args), "times_us": {}, "pieces_us": {}, "ops": {}}
    print(f"\n{'function':<28} {'way':<16} {'issue us':>9} {'wall us':>9}")
    for fname, apply in functions.items():
        kernel_args = (lambda a: lambda x_, w_: a(x_, w_, True, True))(apply) if apply is not gemm.linear else apply
        for wname, op in ways(kernel_args, x, w, dy, worker).items():
            issue, wall = time_call(op, args.calls, args.repeats)
            result["times_us"][f"{fname} | {wname}"] = (issue * 1e6, wall * 1e6)
            print(f"{fname:<28} {wname:<16} {issue * 1e6:9.1f} {wall * 1e6:9.1f}", flush=True)
    print("\nhost seconds of one fp8 linear fwd+bwd queued behind a 3 ms GPU sleep (about 3000 us here: the call "
          "waited for the GPU somewhere)")
    cycles = int(3e-3 * sleep_cycles_per_second(torch.device("cuda")))
    for wname, op in ways(gemm.linear, x, w, dy, worker).items():
        samples = []
        for _ in range(5):
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)
            t0 = time.perf_counter()
            op()
            samples.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        result["times_us"][f"behind sleep | {wname}"] = statistics.median(samples) * 1e6
        print(f"  {wname:<16} {statistics.median(samples) * 1e6:9.1f} us")
    print("\nthe fp8 linear's backward timed from inside, us a call (perf_counter; the host's own time where the "
          "call does not wait)")
    linear_ways = ways(gemm.linear, x, w, dy, worker)
    for wname in ("direct", "direct no_grad", "worker thread", "engine", "engine 1 thread"):
        op = linear_ways[wname]
        op()
        torch.cuda.synchronize()
        with PieceTimer() as timer:
            for _ in range(args.calls):
                op()
            torch.cuda.synchronize()
        per = {k: v / args.calls * 1e6 for k, v in timer.seconds.items()}
        result["pieces_us"][wname] = per
        print(f"  {wname:<16} " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(per.items())), flush=True)
    for wname in ("direct", "engine"):
        result["ops"][wname] = top_ops(linear_ways[wname], 5, 22)
        print(f"\ntorch.profiler, fp8 linear fwd+bwd, {wname}: host self us a call, count a call")
        for k, (t, c) in result["ops"][wname].items():
            print(f"  {t:8.1f} {c:5.1f}  {k[:70]}")
    # a failed first-use check switches a fast path off (and slows the kernels): say so beside the numbers
    result["checks"] = {str(k): v for k, v in {**quantize._CHECKED, **gemm._CHECKED}.items()}
    print(f"\nfirst-use checks: {result['checks']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
