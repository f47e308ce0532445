"""Where one training step of a layout spends its device time, rank by rank (torch.profiler, CUDA kernels).

The cost model prices a layout term by term; the executor's phase timer (CUDA events at phase boundaries)
folds the wait for a slower peer into the collective that waits. This bench runs the layouts of a stored
layout table (the same configs the accuracy tables measured) and profiles one steady step per rank, so a
miss can be read as kernels: per rank, the step's wall time, the device's busy time (union of kernel
intervals) and idle time, NCCL kernels (their duration includes waiting for the peer), and the top kernels.

    python3 -m bench.layout_trace_gpu --table T.json --match "tp2 cp1,cp2 pp1 vpp1 ep2" --out trace.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from executor.microbench.step_trace import trace_worker
from executor.microbench.table_rows import launch_rows, matching_rows
from spec.catalog import get_model
from spec.training_spec import TrainingSpec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", required=True, help="a stored layout table (JSON) whose configs to run")
    p.add_argument("--match", required=True, help="comma list of substrings of layout labels to run")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    table = json.load(open(args.table))
    model = get_model(table["model"].split("@")[0]).with_layers(args.layers)  # labels read "name@2L"
    training = TrainingSpec(**table["training"])
    rows = matching_rows(table, args.match)
    results = []

    def announced(rows):
        for r in rows:
            print(f"== {r['layout']} (table: {1e3 * r['step_time']:.1f} ms)" if r.get("ok") else f"== {r['layout']}",
                  flush=True)
            yield r

    for r, config, launched in launch_rows(announced(rows), trace_worker,
                                           lambda c: (model, training, c, args.warmup, args.top), results):
        for rep in launched.results:
            nccl = sum(rep["nccl_ms"].values())
            print(f"   rank {rep['rank']}: wall {rep['wall_ms']:.1f} busy {rep['busy_ms']:.1f} "
                  f"(without NCCL {rep['busy_without_nccl_ms']:.1f}) NCCL {nccl:.1f} ms in "
                  f"{sum(rep['nccl_calls'].values())} calls, {rep['kernels']} kernels", flush=True)
            if rep.get("unprofiled_wall_ms") is not None:
                print(f"      unprofiled: wall {rep['unprofiled_wall_ms']:.1f} ms, {rep['host_syncs']} synchronizing "
                      f"calls", flush=True)
            for k in rep["top"][:12]:
                print(f"      {k['ms']:8.2f} ms {k['calls']:5d}x {k['name'][:90]}")
        results.append({"layout": r["layout"], "table_step_ms": 1e3 * r["step_time"] if r.get("ok") else None,
                        "ranks": launched.results})
        with open(args.out, "w") as f:
            json.dump({"model": table["model"], "training": table["training"],
                       "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
