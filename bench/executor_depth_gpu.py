"""GPU run of pipeline and context parallelism on the Mixtral-shaped proxy, against one GPU.

Full training steps (bf16, Megatron's mixed-precision Adam with the distributed optimizer, seq 4096, micro-batch
1, global batch --gbs) of ``mixtral-8x7b`` cut to --layers layers, measured by ``executor.profile``:
  one GPU (pp1 cp1), PP2 (1F1B, one stage per GPU) and CP2 (load-balanced causal attention over 2 GPUs).
Reports step time, tokens/s/GPU, peak allocated/reserved memory (max over ranks) and, for PP2, the
``pp_bubble`` phase (rank 0's time blocked in pipeline send/recv) next to the schedule's own idle fraction.
Usage: python -m bench.executor_depth_gpu [--layers 2] [--gbs 8]   (writes $OUT/executor_depth_gpu.json)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

from spec.catalog import get_model
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec
from executor.options import ExecutorOptions
from executor.pipeline import build_schedule
from executor.profile import profile_layout

GIB = 2**30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--layouts", default="pp1:1,pp2:2,cp2:2")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "executor_depth_gpu.json"))
    args = parser.parse_args()
    spec = get_model("mixtral-8x7b").with_layers(args.layers)
    # balanced routing: the comparison is about the layout, not an untrained router's skew
    options = ExecutorOptions(moe_router_force_load_balancing=True)
    training = TrainingSpec(seq_length=args.seq, global_batch_size=args.gbs, precision="bf16")
    report = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "layers": args.layers,
              "gbs": args.gbs, "seq": args.seq, "runs": {}}
    for item in args.layouts.split(","):
        label, world = item.split(":")
        config = ParallelConfig.parse(label, world_size=int(world))
        t0 = time.time()
        m = profile_layout(spec, training, config, options, warmup_steps=2, timed_steps=4, timeout_s=200,
                           device="cuda")
        run = m.to_dict()
        if config.pp > 1:
            micro = args.gbs // (config.micro_batch_size * config.dp)
            run["schedule_idle_fraction"] = build_schedule(config.pp, config.vpp, micro).bubble_fraction()
        report["runs"][label] = run
        line = (f"[{label}] {time.time() - t0:.0f} s ok={m.ok} step={m.step_time} tok/s/gpu={m.tokens_per_s_per_gpu} "
                f"peak_alloc={(m.peak_allocated_bytes or 0) / GIB:.2f} GiB "
                f"reserved={(m.peak_reserved_bytes or 0) / GIB:.2f} GiB "
                f"bubble={m.phases.get('pp_bubble')} fail={m.failure_reason}")
        print(line, flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
