"""Where the whole training step of the 4-layer proxies spends its device time, kernel by kernel (one GPU).

Issue 38 asks what lies between foldtune's step and the GEMM ceiling. For each model, precision and micro-batch
this profiles one steady step (``executor.microbench.step_trace.trace_worker``: two warm-up steps, one unprofiled
step timed, one profiled step) and sorts every CUDA kernel into a class by its name (grouped GEMMs, dense GEMMs,
attention, fp8 quantisation, optimizer, gradient accumulation, norms, routing and permutation, loss, other
element-wise work, copies). It prints, per run, the step's wall time, the device's busy time, the model TFLOP/s
and its share of the dense bf16 peak, and the milliseconds of each class; the JSON keeps the top kernels too.

Usage: python -m bench.step_kernels_gpu [--models qwen3-30b-a3b,deepseek-v2-lite] [--layers 4] [--seq 4096]
                                        [--gbs 8] [--runs bf16:8,bf16:1,fp8:8,fp8:1] [--keep-logits B,...] [--out F]
                                        [--no-write]
On a GPU the table also replaces its own section of docs/benchmarks.md (``--no-write``: print only); CPU runs
(smoke tests: no CUDA kernels to sort) never write it.

``--keep-logits`` runs each row once per value of ``ExecutorOptions.cross_entropy_keep_logits`` (bytes; 0: the
loss blocked over the vocabulary, computing each block again in backward; 'default': the executor's default),
one after the other in this process's order, so a before/after of that knob comes from one call.
Writes $OUT/step_kernels_gpu.json (or --out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

from bench.report import add_report_arguments, machine, replace_section

from spec.catalog import get_hardware, get_model
from spec.flops import flops_per_step
from spec.parallel_config import ParallelConfig
from spec.proxy import proxy_model
from spec.training_spec import TrainingSpec

# First match wins: a kernel's class is the first whose substrings its lower-cased name contains.
CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl",)),
    ("copies", ("memcpy", "memset")),
    ("grouped GEMM", ("groupproblemshape", "grouped_mm", "grouped_gemm", "_gg_", "grouped_fp8", "ptrarray")),
    ("fp8 quantisation", ("quant", "amax", "_cast_", "to_fp8", "float8")),
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa")),
    ("dense GEMM", ("gemm", "xmma", "nvjet", "cutlass", "matmul", "sm90_", "cublas")),
    ("optimizer", ("multi_tensor", "adam", "foreach", "fused_adam")),
    ("gradient accumulation", ("grad_accum", "accumulate", "main_grad")),
    ("norms", ("rms", "norm")),
    ("routing and permutation", ("router", "topk", "sort", "permute", "scatter", "gather", "index", "histc",
                                 "bincount", "cumsum", "scan")),
    ("loss and head", ("cross_entropy", "softmax", "log_softmax", "nll", "logsumexp")),
    ("SwiGLU and rope", ("swiglu", "silu", "rope", "rotary")),
    ("reductions", ("reduce",)),
    ("element-wise", ("elementwise", "vectorized", "unrolled", "fill", "copy")),
)


def kernel_class(name: str) -> str:
    """The class of a CUDA kernel name (see ``CLASSES``); 'other' where none matches."""
    lowered = name.lower()
    for label, needles in CLASSES:
        if any(n in lowered for n in needles):
            return label
    return "other"


def classes_ms(top: list[dict]) -> dict[str, float]:
    """Milliseconds of device time per kernel class, largest first."""
    out: dict[str, float] = {}
    for k in top:
        label = kernel_class(k["name"])
        out[label] = out.get(label, 0.0) + k["ms"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


SECTION = "## The whole step's kernels by class (`python3 -m bench.step_kernels_gpu`)"


def section(report: dict, command: str) -> str:
    """The docs/benchmarks.md section of one run: per row its step, TFLOP/s, share of the peak, peak memory and
    its three largest kernel classes."""
    lines = [SECTION, "",
             f"`{command}` at {report.get('commit') or 'an unnamed commit'}, "
             f"{report['date'][:16].replace('T', ' ')} UTC on {report.get('machine', report['device'])} (torch "
             f"{report['torch']}): the {report['layers']}-layer proxies at seq {report['seq']}, global batch "
             f"{report['gbs']}, one steady step a row (unprofiled step time; classes from the profiled step).", "",
             "| model | precision | mbs | keep_logits | step ms | TFLOP/s | % of dense bf16 peak | peak GiB | "
             "largest kernel classes, ms |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in report["runs"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['precision']} | {r['mbs']} | {r['keep_logits']} | failed: "
                         f"{r['error']} | | | | |")
            continue
        top = ", ".join(f"{k} {v:.1f}" for k, v in list(r["classes_ms"].items())[:3])
        peak = r.get("peak_reserved_bytes")
        lines.append(f"| {r['model']} | {r['precision']} | {r['mbs']} | {r['keep_logits']} | {r['step_ms']:.1f} | "
                     f"{r['tflops']:.0f} | {100 * r['peak_share']:.1f} | "
                     f"{peak / 2**30:.2f} | {top} |" if peak is not None else
                     f"| {r['model']} | {r['precision']} | {r['mbs']} | {r['keep_logits']} | {r['step_ms']:.1f} | "
                     f"{r['tflops']:.0f} | {100 * r['peak_share']:.1f} | - | {top} |")
    return "\n".join(lines) + "\n"


def parse_runs(text: str) -> list[tuple[str, int]]:
    """'bf16:8,fp8:1' -> [('bf16', 8), ('fp8', 1)]."""
    runs = []
    for part in text.split(","):
        precision, _, mbs = part.partition(":")
        runs.append((precision.strip(), int(mbs or 1)))
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen3-30b-a3b,deepseek-v2-lite")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--runs", default="bf16:8,bf16:1,fp8:8,fp8:1", help="precision:micro-batch, comma list")
    parser.add_argument("--keep-logits", default="default",
                        help="comma list of cross_entropy_keep_logits values (bytes) or 'default'")
    parser.add_argument("--hardware", default="h200", help="catalog hardware whose dense bf16 peak is the yardstick")
    add_report_arguments(parser, "step_kernels_gpu.json")
    args = parser.parse_args()

    import dataclasses

    import torch

    from executor.launch_local import launch
    from executor.microbench.step_trace import trace_worker
    from executor.options import DEFAULT_KEEP_LOGITS, ExecutorOptions

    peak = get_hardware(args.hardware).gpu.peak("bf16")
    report: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                    "machine": machine(), "commit": args.commit, "torch": torch.__version__, "layers": args.layers,
                    "seq": args.seq, "gbs": args.gbs, "peak_bf16_flops": peak, "runs": []}
    failed = 0
    for name in args.models.split(","):
        model = proxy_model(get_model(name), args.layers)
        flops = flops_per_step(model, args.seq, args.gbs)
        for (precision, mbs), keep_text in ((run, k) for run in parse_runs(args.runs)
                                            for k in args.keep_logits.split(",")):
            keep = DEFAULT_KEEP_LOGITS if keep_text == "default" else int(keep_text)
            training = TrainingSpec(seq_length=args.seq, global_batch_size=args.gbs, precision=precision)
            config = ParallelConfig.parse(f"dp1 mbs{mbs}", world_size=1)
            options = dataclasses.replace(ExecutorOptions.for_training(training, model=model),
                                          cross_entropy_keep_logits=keep)
            print(f"== {name}@{args.layers}L {precision} mbs{mbs} keep_logits {keep}", flush=True)
            launched = launch(trace_worker, 1, (model, training, config, 2, 400, options), timeout_s=900)
            if not launched.ok:
                failed += 1
                print(f"   failed: {launched.failure_reason}", flush=True)
                report["runs"].append({"model": name, "precision": precision, "mbs": mbs, "keep_logits": keep,
                                       "error": launched.failure_reason})
                continue
            rep = launched.results[0]
            wall = rep["unprofiled_wall_ms"] or rep["wall_ms"]
            tflops = flops / (wall / 1e3) / 1e12
            classes = classes_ms(rep["top"])
            print(f"   step {wall:.1f} ms (profiled {rep['wall_ms']:.1f}), busy {rep['busy_ms']:.1f} ms, "
                  f"{tflops:.0f} TFLOP/s = {100 * tflops * 1e12 / peak:.1f} % of dense bf16 peak, "
                  f"{rep['kernels']} kernels, peak {rep.get('peak_reserved_bytes', 0) / 2**30:.2f} GiB reserved",
                  flush=True)
            for label, ms in classes.items():
                print(f"      {ms:8.2f} ms  {label}", flush=True)
            for k in rep["top"][:15]:
                print(f"      {k['ms']:8.2f} ms {k['calls']:5d}x [{kernel_class(k['name'])}] {k['name'][:80]}",
                      flush=True)
            report["runs"].append({"model": name, "precision": precision, "mbs": mbs, "keep_logits": keep,
                                   "step_ms": wall,
                                   "tflops": tflops, "peak_share": tflops * 1e12 / peak, "classes_ms": classes,
                                   "busy_ms": rep["busy_ms"], "profiled_wall_ms": rep["wall_ms"],
                                   "peak_allocated_bytes": rep.get("peak_allocated_bytes"),
                                   "peak_reserved_bytes": rep.get("peak_reserved_bytes"),
                                   "kernels": rep["kernels"], "top": rep["top"][:60]})
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    if torch.cuda.is_available() and not args.no_write:
        replace_section(SECTION, section(report, "python3 -m bench.step_kernels_gpu " + " ".join(sys.argv[1:])))
        print("wrote its section of docs/benchmarks.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
