"""``foldtune verify`` on one GPU (issue 37's slices bar): the top 3 of a 128-GPU Qwen3-30B-A3B plan, each layout
checked by one of its ranks built at real widths on this GPU.

Plans ``--model qwen3-30b-a3b --gpus 128 --gpu h100-sxm --seq 4096 --gbs 256`` (the defaults), takes the top
``--top`` layouts and, for each, builds the rank that holds expert 0 (``executor/slices.py``): up to
``--slice-layers`` of its decoder layers at the model's widths (4 by default: the 48-layer model's per-layer
time, a proxy of the stage's 24), its local experts, micro-batch, sequence and TP shards, under even routing and
with the hottest expert at ``--hot-expert`` times the mean. Prints and writes, per layout and routing, the
measured compute of the slowest pipeline stage per micro-batch against the cost model's prediction on this GPU
(``--slice-gpu``, default: the detected one), term by term, and the re-ranking by the checked step (measured
compute + communication, optimizer and host priced on the 128-GPU cluster).

Torch and the repository only: no Ray, no database. The slices run in this process, one layout after the other
(a layout whose slice fails, e.g. out of memory, is reported and ranked last).

Usage (GPU, one H200, about 2-4 minutes):
    python3 -m bench.verify_slices --out $OUT/verify_slices.json
``--tiny``: the tiny proxy of the model at seq 64 on the CPU, one layer per slice: a smoke test of the script,
no timing claim (its table is not written to docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from api.cli._shape_args import detected_gpu
from api.worker.verify import run_verify
from bench.report import machine, replace_section, save_json, utc_now
from planner.verify import VerifyReport
from spec.catalog import get_hardware, get_model
from spec.inputs import build_specs
from spec.proxy import proxy_model

HEADING = "## Slices: a 128-GPU plan's top layouts checked on one GPU (foldtune verify)"


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--gpus", type=int, default=128)
    p.add_argument("--gpu", default="h100-sxm", help="the planned cluster's GPU")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--gbs", type=int, default=256)
    p.add_argument("--top", type=int, default=3)
    p.add_argument("--slice-gpu", default=None, help="the hardware the slices run on (default: detected)")
    p.add_argument("--slice-layers", type=int, default=4)
    p.add_argument("--hot-expert", type=float, default=2.0)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: the tiny proxy at seq 64")
    p.add_argument("--out", default=None, help="also write the report as JSON here")
    return p.parse_args(argv)


def table(report: VerifyReport) -> list[str]:
    """The per-term table (markdown): per layout and routing, measured vs predicted seconds per micro-batch of
    the slowest stage, then the steps and the ranks."""
    lines = ["| plan # | layout | routing | term | measured (ms) | predicted (ms) | measured / predicted |",
             "|---|---|---|---|---:|---:|---:|"]
    for layout in report.layouts:
        if layout.error:
            lines.append(f"| {layout.plan_rank} | `{layout.config.label()}` | - | not measured: {layout.error} "
                         f"| | | |")
            continue
        for name, check in layout.scenarios.items():
            for term, (measured, predicted) in check.terms.items():
                ratio = f"{measured / predicted:.2f}" if predicted > 0 else "-"
                lines.append(f"| {layout.plan_rank} | `{layout.config.label()}` | {name} | {term} | "
                             f"{measured * 1e3:.3f} | {predicted * 1e3:.3f} | {ratio} |")
    lines += ["", "| plan # | layout | routing | estimate (s) | compute measured (s) | compute predicted (s) | "
                  "priced rest (s) | checked step (s) | rank by slices |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for layout in report.layouts:
        for name, check in layout.scenarios.items():
            lines.append(f"| {layout.plan_rank} | `{layout.config.label()}` | {name} | {check.predicted_step_s:.4f} | "
                         f"{check.compute_measured['total']:.4f} | {check.compute_predicted['total']:.4f} | "
                         f"{sum(check.priced.values()):.4f} | {check.checked_step_s:.4f} | "
                         f"{layout.rank.get(name, '-')} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    model = get_model(args.model)
    seq, layers, slice_gpu = args.seq, args.slice_layers, args.slice_gpu
    if args.tiny:
        model, seq, layers, slice_gpu = proxy_model(model, 4, "tiny"), 64, 1, "cpu"
    model, training, cluster = build_specs(model, args.gpus, gpu=args.gpu, seq_length=seq,
                                           global_batch_size=args.gbs, precision="fp32" if args.tiny else "bf16")
    slice_hardware = get_hardware(slice_gpu or detected_gpu())
    start = time.perf_counter()

    def progress(layout) -> None:
        state = f"not measured: {layout.error}" if layout.error else "measured"
        print(f"[{time.perf_counter() - start:6.1f} s] #{layout.plan_rank} {layout.config.label()}: {state}",
              flush=True)

    report = run_verify(model, training, cluster, slice_hardware, top=args.top, hot_factor=args.hot_expert,
                        cap=layers, on_layout=progress)
    seconds = time.perf_counter() - start
    lines = table(report)
    print("\n".join(lines))
    for name, labels in report.order.items():
        print(f"ranked by checked step, {name} routing: " + " > ".join(labels))
    print(f"took {seconds:.1f} s")
    data = {"measured_at": utc_now(), "machine": machine(), "seconds": seconds, "argv": sys.argv[1:],
            **report.to_dict()}
    if args.out:
        out = Path(args.out)
        save_json(data, out.name, results_dir=out.parent)
    if not args.tiny:
        save_json(data, "verify_slices.json")
        text = [HEADING, "",
                f"`python3 -m bench.verify_slices` ({' '.join(sys.argv[1:]) or 'defaults'}) on {machine()}, "
                f"{utc_now()}, {seconds:.0f} s: the top {args.top} layouts of `foldtune plan --model {args.model} "
                f"--gpus {args.gpus} --gpu {args.gpu} --seq {args.seq} --gbs {args.gbs}`, each by the rank holding "
                f"expert 0, {layers} decoder layers at real widths on one {report.device}, predicted on "
                f"{report.slice_gpu}'s profile. Terms per micro-batch of the slowest pipeline stage "
                "(docs/verify.md says what each is and what is priced instead of measured).", "", *lines, ""]
        text += [f"Ranked by checked step, {name} routing: " + " > ".join(f"`{label}`" for label in labels)
                 for name, labels in report.order.items()]
        replace_section(HEADING, "\n".join(text))
    return 0 if any(layout.error is None for layout in report.layouts) else 1


if __name__ == "__main__":
    sys.exit(main())
