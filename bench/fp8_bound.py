"""How fast fp8 could make the Mixtral-shaped proxy step of bench/fp8_step.py with the GEMM kernels torch
has: an upper bound on the fp8 / bf16 tokens/s quotient (issue 19's bar is >= 1.25).

Only the GEMMs change with the precision; the optimizer, the fp32 main-gradient accumulation, attention's
SDPA, the norms, the permutation and the loss run the same bytes in both. So, for a bf16 step of T seconds
whose GEMMs fp8 would replace, fp8 steps in at least

    T - sum over the step's GEMMs of (bf16 seconds - fp8 seconds)

with the fp8 seconds of each GEMM as its kernel runs on operands already quantised: quantisation counted
free, no cast, pad or copy. The bench times every GEMM of the step at its own shape (one micro-batch of
seq 4096, top-2 routing spread evenly over the 8 experts: each expert gets 1024 of the 8192 routed rows),
in bf16 (``torch._grouped_mm``, ``torch.mm``) and in fp8 (``torch._scaled_grouped_mm``, ``torch._scaled_mm``
with per-row scales, as :mod:`executor.kernels.fp8.gemm` calls them), each as device time with the host
ahead (:func:`executor.microbench.timing.time_host_ahead`).

Four bounds, each ``T / (T - saving)``:

- ``torch_kernels``: every GEMM of the step in fp8 (the expert forward, dgrad and wgrad, the attention
  projections, and the LM head, which the executor keeps in bf16 as Megatron does) with torch's kernels;
- ``executor_choices``: what the executor runs in fp8 (the LM head bf16; the expert wgrad in whichever
  precision times faster here: bf16 by default, FOLDTUNE_FP8_WGRAD=fp8);
- ``grouped_at_dense_rate``: as ``torch_kernels``, with each grouped GEMM's fp8 time replaced by a dense
  ``torch._scaled_mm`` of the same FLOPs (the rows of all experts against one weight): what a grouped
  kernel as good as cuBLAS's dense fp8 GEMM would give, which torch does not have;
- ``bf16_head_at_dense_rate``: the LM head bf16, every other GEMM in the faster of bf16 and fp8 with the
  grouped ones at that dense rate: the most any fp8 kernel can gain a step that keeps the head in bf16.

T is the bf16 step's median from a ``bench.fp8_step`` report (``--step-json``; run it first in the same
device call), or, for any catalog model's proxy (``--model``, ``--mbs``), the bf16 row's step of a
``bench.step_kernels_gpu`` report, whose proxy (layers, sequence, micro-batches) the GEMMs then follow.
Because the step's grouped GEMMs run slower than here (uneven groups from the random router, the card at its power
cap), each grouped saving is also scaled by the step's profiled grouped-GEMM time over this bench's (``scaled``
bounds; the larger of the two is the one to quote as the bound).

Usage (GPU, sm90): python3 -m bench.fp8_step --runs bf16,fp8 --out $OUT/fp8_step.json &&
    python3 -m bench.fp8_bound --step-json $OUT/fp8_step.json --out $OUT/fp8_bound.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch

from costmodel.fp8_bound import (LAYERS, MICRO_BATCHES, SEQ, bounds, grouped_seconds, profiled_grouped_seconds,
                                 step_gemms)
from executor.microbench.fp8_gemms import time_gemms
from executor.microbench.fp8_step_bar import BAR_SPEEDUP
from spec.catalog import get_model


def table(rows: list[dict], results: dict) -> str:
    lines = ["| GEMM | calls a step | bf16 TFLOP/s | fp8 TFLOP/s | fp8 / bf16 | fp8 as one dense GEMM |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        dense = f"{r['fp8_dense_tflops']:.0f}" if r["groups"] > 1 else ""
        lines.append(f"| {r['name']}{'' if r['in_fp8'] else ' (bf16 in the executor)'} | {r['per_step']} | "
                     f"{r['bf16_tflops']:.0f} | {r['fp8_tflops']:.0f} | {r['bf16_s'] / r['fp8_s']:.2f} | {dense} |")
    lines += ["", f"| bound | GEMM saving a step | fp8 step | fp8 / bf16 (bar {BAR_SPEEDUP}) |", "|---|---:|---:|---:|"]
    for kind in ("plain", "scaled"):
        for name, b in results.get(kind, {}).items():
            lines.append(f"| {name} ({kind}) | {b['saving_s'] * 1e3:.1f} ms | {b['fp8_step_s'] * 1e3:.1f} ms | "
                         f"{b['speedup']:.3f} |")
    return "\n".join(lines)


def step_of(report: dict, model: str, mbs: int) -> dict:
    """The bf16 step a bound is taken against, from a ``bench.fp8_step`` report (its bf16 run: the 2-layer proxy,
    seq 4096, 4 micro-batches of 1) or a ``bench.step_kernels_gpu`` report (its bf16 row of ``model`` at
    micro-batch ``mbs``): seconds, the profiled grouped-GEMM seconds (None if unprofiled) and the proxy's
    layers, sequence and micro-batches. KeyError/ValueError where the report has no such step."""
    if "runs" not in report:  # bench.fp8_step
        return {"step_s": float(report["bf16"]["median_step_s"]), "grouped_s": profiled_grouped_seconds(report),
                "layers": LAYERS, "seq": SEQ, "micro_batches": MICRO_BATCHES, "mbs": 1}
    rows = [r for r in report["runs"] if r.get("model") == model and r.get("precision") == "bf16"
            and r.get("mbs") == mbs and "step_ms" in r]
    if not rows:
        raise KeyError(f"no bf16 row of {model} at micro-batch {mbs}")
    grouped = rows[0].get("classes_ms", {}).get("grouped GEMM")
    return {"step_s": rows[0]["step_ms"] / 1e3, "grouped_s": grouped / 1e3 if grouped else None,
            "layers": int(report["layers"]), "seq": int(report["seq"]),
            "micro_batches": int(report["gbs"]) // mbs, "mbs": mbs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step-json", required=True,
                    help="a bench.fp8_step report with a bf16 run, or a bench.step_kernels_gpu report")
    ap.add_argument("--model", default="mixtral-8x7b")
    ap.add_argument("--mbs", type=int, default=1, help="with a step_kernels_gpu report: the bf16 row's micro-batch")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    try:
        with open(args.step_json) as fh:
            step = json.load(fh)
        base = step_of(step, args.model, args.mbs)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"fp8_bound: --step-json {args.step_json!r} is not a bench.fp8_step report with a bf16 run or a "
              f"bench.step_kernels_gpu report with a bf16 row of {args.model} at micro-batch {args.mbs} "
              f"({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    bf16_step_s = base["step_s"]
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("fp8_bound: needs a CUDA GPU of compute capability 9.0 or later (torch._scaled_mm, "
              "torch._scaled_grouped_mm); none here", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    gemms = step_gemms(get_model(args.model), base["seq"], base["layers"], base["micro_batches"], base["mbs"])
    print(f"fp8_bound: {len(gemms)} GEMMs of the {args.model} {base['layers']}-layer proxy step "
          f"({base['micro_batches']} x {base['mbs']} x {base['seq']}) on {torch.cuda.get_device_name()}")
    rows = time_gemms(gemms, device)
    results = {"plain": bounds(rows, bf16_step_s, BAR_SPEEDUP)}
    profiled = base["grouped_s"]
    scale = None
    if profiled:
        scale = max(1.0, profiled / grouped_seconds(rows))
        results["scaled"] = bounds(rows, bf16_step_s, BAR_SPEEDUP, scale)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
              "command": " ".join(["python3 -m bench.fp8_bound", *(argv if argv is not None else sys.argv[1:])]),
              "bf16_step_s": bf16_step_s, "step_json": args.step_json, "proxy": base,
              "grouped_bench_s": grouped_seconds(rows), "grouped_profiled_s": profiled, "grouped_scale": scale,
              "gemms": rows, "bounds": results}
    print(table(rows, results))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
