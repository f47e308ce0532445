"""Host seconds per micro-batch of stored layouts, measured where the device cannot hide them.

The cost model floors each micro-batch at the host's time to issue it (costmodel/host.py: counted ops x
seconds per op). Whether that floor is right decides the layouts that run many small micro-batches per rank
(TP2, CP2, EP2 with full recompute on 2 GPUs), which the accuracy tables under-predict by up to 41 %. This
bench runs each layout of a stored layout table again with a short sequence (``--seq``, default 256), so
every kernel finishes before the host has issued the next one and the step's wall time is what the host
(its launches, its synchronizing calls, the collectives' cross-rank waits) costs. Adjacent pairs of steps of
``M`` and ``2M`` micro-batches per rank (``--micro``) give the per-micro-batch host seconds as their difference
over ``M`` (the once-per-step work, optimizer included, cancels); phases are timed as in the tables. The worker
is ``foldtune calibrate --model``'s host probe (executor.microbench.host_probe.host_probe_worker). The
H200 run of 2026-11-27 11:02 used an earlier form of this bench: two steps' medians (3 steps each) in one
process, M = 4.

    python3 -m bench.host_probe_gpu --table T.json [--match "tp2 cp1,cp2 pp1"] --out host_probe.json

Prints, per layout, the measured host ms per micro-batch (slowest rank) and the two step times; the JSON keeps
every rank's. Off the device, ``--price`` compares a stored probe with the model's host floor
(``costmodel.step_time.host_seconds_per_micro_batch``) under a profile:

    python3 -m bench.host_probe_gpu --price host_probe.json[,more.json] --profile P.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch

from executor.microbench.table_rows import launch_rows, matching_rows
from executor.microbench.host_probe import host_probe_worker
from planner.accuracy import host_floor_ratios
from spec.catalog import get_model
from spec.training_spec import TrainingSpec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", help="a stored layout table (JSON) whose configs to run")
    p.add_argument("--price", metavar="PROBES", help="comma list of stored probe JSONs to price (no device needed)")
    p.add_argument("--profile", help="with --price: the hardware profile (JSON) whose host floor to compare with")
    p.add_argument("--match", default="", help="comma list of substrings of layout labels to run (default all)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=256, help="sequence length of the probe (tokens)")
    p.add_argument("--micro", type=int, default=8, help="M: steps of M and 2M micro-batches per rank")
    p.add_argument("--repeats", type=int, default=5, help="pairs of steps (the median pair counts)")
    p.add_argument("--out")
    args = p.parse_args()
    if args.price:
        if not args.profile:
            p.error("--price needs --profile")
        rows = [row for path in args.price.split(",") for row in host_floor_ratios(json.load(open(path)), args.profile)]
        for row in rows:
            print(f"{row['layout']:75s} measured {row['measured_ms']:7.2f} ms, model {row['model_ms']:6.2f} ms, "
                  f"ratio {row['ratio']:5.2f}")
        ratios = sorted(row["ratio"] for row in rows)
        print(f"{len(ratios)} layouts: measured / model median {statistics.median(ratios):.2f}, "
              f"range {ratios[0]:.2f}-{ratios[-1]:.2f}")
        return 0
    if not args.table or not args.out:
        p.error("--table and --out are needed to measure (or --price to price stored probes)")
    if not torch.cuda.is_available():
        print("host_probe_gpu: needs CUDA GPUs (the host floor is a property of the CUDA launch path)")
        return 2
    table = json.load(open(args.table))
    model = get_model(table["model"].split("@")[0]).with_layers(args.layers)
    training = dataclasses.replace(TrainingSpec(**table["training"]), seq_length=args.seq)
    rows = matching_rows(table, args.match, ok_only=True)
    results = []
    for r, config, launched in launch_rows(rows, host_probe_worker,
                                           lambda c: (model, training, c, args.micro, args.repeats), results):
        host = max(rep["host_s"] for rep in launched.results) * 1e3
        print(f"{r['layout']:75s} host {host:7.2f} ms per micro-batch  (steps "
              f"{', '.join(f'{k} mb {v * 1e3:.1f} ms' for k, v in launched.results[0]['steps_s'].items())})",
              flush=True)
        results.append({"layout": r["layout"], "config": r["config"], "host_ms_per_micro_batch": host,
                        "ranks": launched.results})
        with open(args.out, "w") as f:
            json.dump({"model": table["model"], "training": dataclasses.asdict(training), "micro": args.micro,
                       "device": torch.cuda.get_device_name(0), "measured_at": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                             time.gmtime()),
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
