"""Time the memory-bound op classes on this machine's first GPU (executor/microbench/memory_bound.py) and write
the raw rows and the curves they give against a catalog GPU's datasheet bandwidth.

    python3 -m bench.memory_bound_gpu --gpu h200 --out /tmp/memory_bound.json
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch

from costmodel.calibrate.memory_bound import memory_bound_curves
from executor.microbench.memory_bound import default_sizes, measure_memory_bound
from spec.catalog import get_hardware


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h200", help="catalog GPU whose datasheet bandwidth the curves are over")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    rows = measure_memory_bound(default_sizes(device, quick=False), device, dtype)
    datasheet = get_hardware(args.gpu).gpu.hbm_bandwidth
    curves = {op: list(c.points) for op, c in memory_bound_curves(rows, datasheet)}
    record = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": args.dtype, "datasheet_bandwidth": datasheet,
              "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "rows": rows, "memory_bound_efficiency": curves}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    for row in rows:
        print(f"{row['op']:<11} {row['rows']:>6}x{row['width']:<5} {row['seconds'] * 1e6:10.1f} us")
    for op, pts in curves.items():
        print(op, ", ".join(f"{x:.3g}:{y:.3f}" for x, y in pts))


if __name__ == "__main__":
    main()
