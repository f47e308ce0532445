"""CUDA graphs (the layout knob ``cuda_graphs``) on and off: the whole training step of 4-layer proxies on one GPU.

Full training steps (bf16, Adam, seq 4096, micro-batch 1, global batch 4: four micro-batches) of Qwen3-30B-A3B
and DeepSeek-V2-Lite cut to --layers layers at their real widths, measured by ``executor.profile`` (the product
path: the knob travels in the layout's label, ``dp1 mbs1`` against ``dp1 mbs1`` with the graphs on). Each model
runs off then on, --rounds times (2 or more alternate them, so both see the card's clock drift alike); the table gives the median step time of
each setting, the measured gain (off / on), the cost model's predicted gain on the named hardware
(``costmodel.step_time``: the host launch work the graphs remove, only where the host sets the step time), peak
memory, and the largest loss difference between the settings over the timed steps (same seeds and data: the
graphs replay the same arithmetic).

Usage: python -m bench.cuda_graphs_gpu [--models qwen3-30b-a3b,deepseek-v2-lite] [--layers 4] [--rounds 1]
                                       [--seq 4096] [--gbs 4]   (--seq 1024 or 256: where the host limits)
       python -m bench.cuda_graphs_gpu --predict-only      (the cost model's side alone, on any machine)
Writes $OUT/cuda_graphs_gpu.json (or --out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

from costmodel.step_time import estimate_step_time
from spec.catalog import get_hardware, get_model
from spec.hardware import ClusterSpec
from spec.errors import FoldtuneError
from spec.profile_io import load_profile
from spec.parallel_config import ParallelConfig
from spec.proxy import proxy_model
from spec.training_spec import TrainingSpec

GIB = 2**30
LABEL = "dp1 mbs1"


def predicted(model, training, hardware: str, profile: str | None = None) -> dict:
    """The cost model's step seconds off and on, and their ratio, for one GPU of ``hardware`` (or of the
    hardware profile stored at ``profile``: a calibrated one prices the host from its measured MoE layer)."""
    cluster = ClusterSpec(load_profile(profile) if profile else get_hardware(hardware), 1)
    off = ParallelConfig.parse(LABEL, world_size=1)
    t_off = estimate_step_time(model, training, cluster, off).step_time
    t_on = estimate_step_time(model, training, cluster, off.replace(cuda_graphs=True)).step_time
    return {"off_s": t_off, "on_s": t_on, "gain": t_off / t_on}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen3-30b-a3b,deepseek-v2-lite")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--gbs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1, help="off/on pairs per model")
    parser.add_argument("--timed-steps", type=int, default=6)
    parser.add_argument("--hardware", default="h200", help="catalog hardware of the cost model's prediction")
    parser.add_argument("--profile", help="price against this stored hardware profile (JSON) instead of --hardware's "
                                          "catalog entry")
    parser.add_argument("--predict-only", action="store_true", help="the cost model only (no GPU needed)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "cuda_graphs_gpu.json"))
    args = parser.parse_args()
    if args.profile:
        try:
            load_profile(args.profile)
        except FoldtuneError as exc:
            parser.error(f"--profile: {exc}")
    training = TrainingSpec(seq_length=args.seq, global_batch_size=args.gbs, precision="bf16")
    report: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "layers": args.layers,
                    "seq": args.seq, "gbs": args.gbs, "layout": LABEL, "models": {}}
    if not args.predict_only:
        import torch

        from executor.options import ExecutorOptions
        from executor.profile import profile_layout
        report.update(device=torch.cuda.get_device_name(0), torch=torch.__version__)
    rows = []
    for name in args.models.split(","):
        model = proxy_model(get_model(name), args.layers)
        entry = report["models"][name] = {"predicted": predicted(model, training, args.hardware, args.profile),
                                         "runs": []}
        if args.predict_only:
            rows.append((name, None, None, None, entry["predicted"]["gain"], None, None))
            continue
        options = ExecutorOptions.for_training(training, model=model)  # cuda_graphs: the layout's (None)
        times: dict[bool, list[float]] = {False: [], True: []}
        losses: dict[bool, list[float]] = {}
        peak: dict[bool, int] = {}
        for _ in range(args.rounds):
            for on in (False, True):
                config = ParallelConfig.parse(LABEL + (" cuda_graphs=on" if on else ""), world_size=1)
                t0 = time.time()
                m = profile_layout(model, training, config, options, warmup_steps=2, timed_steps=args.timed_steps,
                                   timeout_s=240, device="cuda", hardware=args.hardware)
                entry["runs"].append(m.to_dict())
                print(f"[{name} {config.label()}] {time.time() - t0:.0f} s ok={m.ok} step={m.step_time} "
                      f"fail={m.failure_reason}", flush=True)
                if m.ok:
                    times[on].append(m.step_time)
                    losses.setdefault(on, m.losses)
                    peak[on] = max(peak.get(on, 0), m.peak_allocated_bytes or 0)
                with open(args.out, "w") as f:
                    json.dump(report, f, indent=1)
        if times[False] and times[True]:
            off_s, on_s = statistics.median(times[False]), statistics.median(times[True])
            diff = max((abs(a - b) for a, b in zip(losses.get(False, []), losses.get(True, []))), default=None)
            entry.update(off_s=off_s, on_s=on_s, gain=off_s / on_s, loss_max_abs_diff=diff,
                         peak_gib={str(k): v / GIB for k, v in peak.items()})
            rows.append((name, off_s, on_s, off_s / on_s, entry["predicted"]["gain"], peak, diff))
        else:
            rows.append((name, None, None, None, entry["predicted"]["gain"], None, None))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n{'model':<20} {'off ms':>9} {'on ms':>9} {'gain':>7} {'priced':>7} {'peak off/on GiB':>16} "
          f"{'max |dloss|':>11}")
    for name, off_s, on_s, gain, priced, peak, diff in rows:
        cell = (lambda x, f: f.format(x) if x is not None else "-")
        mem = f"{peak[False] / GIB:.1f}/{peak[True] / GIB:.1f}" if peak else "-"
        print(f"{name:<20} {cell(off_s and off_s * 1e3, '{:9.1f}'):>9} {cell(on_s and on_s * 1e3, '{:9.1f}'):>9} "
              f"{cell(gain, '{:7.3f}'):>7} {cell(priced, '{:7.3f}'):>7} {mem:>16} {cell(diff, '{:11.2e}'):>11}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
