"""Where the host's time goes in one MoE-layer forward+backward: the ops the layer issues, by host time.

A layer whose device time is close to the host's issue time (the Qwen3-30B-A3B layer at one micro-batch on
an H200: ~2.1 ms on the device, ~2.2 ms to issue) runs as fast as the host can queue it, so the bar is won or
lost on the host. This prints the torch profiler's CPU view of ``--steps`` steady fwd+bwd steps of the bar's
layer (forced balancing, as the bar runs it): every op with its calls per step and its self host time per
step, the total host time per step, and the Python-level functions of the executor that take the most
cumulative time (cProfile), so the launches worth removing are named rather than guessed.

    python3 -m bench.moe_host_profile --shape qwen3-30b-a3b            (on a GPU)
    python3 -m bench.moe_host_profile --device cpu --tiny              (CPU smoke run)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats

import torch

from executor.microbench.moe_bar import MOE_SHAPES, SEQ, TINY_MOE_SHAPES, TINY_SEQ, bar_inputs, layer_fwd_bwd
from executor.microbench.timing import synchronize, time_host_issue


def profile_layer(shape_name: str, dev: torch.device, dtype: torch.dtype, tiny: bool, steps: int,
                  mbs: int = 1, top: int = 30) -> dict:
    """Host profile of ``steps`` fwd+bwd steps of the bar's layer (forced balancing): per-op calls and self
    host microseconds per step, host seconds per step, and the top cumulative Python functions."""
    shape = (TINY_MOE_SHAPES if tiny else MOE_SHAPES)[shape_name]
    seq = TINY_SEQ if tiny else SEQ
    bar = bar_inputs(shape.spec, seq, mbs, dev, dtype, shape.options(moe_router_force_load_balancing=True))
    step = layer_fwd_bwd(bar.layer, bar.x, bar.gy)
    for _ in range(5):  # first-use checks, compilation, allocator warm-up
        step()
    host_s = time_host_issue(step, dev, steps)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        synchronize(dev)
    ops = []
    for e in prof.key_averages():
        ops.append({"op": e.key, "calls_per_step": e.count / steps,
                    "self_host_us_per_step": e.self_cpu_time_total / steps})
    ops.sort(key=lambda o: -o["self_host_us_per_step"])
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    synchronize(dev)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(r"(executor|bench)/", top)
    return {"shape": shape_name, "mbs": mbs, "device": str(dev), "steps": steps, "host_s_per_step": host_s,
            "aten_calls_per_step": sum(o["calls_per_step"] for o in ops if o["op"].startswith("aten::")),
            "ops": ops[:top], "python_cumulative": text.getvalue()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(MOE_SHAPES))
    parser.add_argument("--mbs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke runs)")
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args()
    dev = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    result = profile_layer(args.shape, dev, dtype, args.tiny, args.steps, args.mbs)
    print(f"{args.shape} mbs{args.mbs} on {dev}: host {result['host_s_per_step'] * 1e3:.3f} ms per fwd+bwd, "
          f"{result['aten_calls_per_step']:.0f} aten calls per step")
    print(f"{'op':48s} {'calls/step':>10s} {'self host us/step':>18s}")
    for o in result["ops"]:
        print(f"{o['op'][:48]:48s} {o['calls_per_step']:10.1f} {o['self_host_us_per_step']:18.1f}")
    print(result["python_cumulative"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
