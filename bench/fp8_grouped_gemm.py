"""foldtune's grouped fp8 GEMM against torch's grouped bf16 and dense fp8 GEMMs at real expert shapes.

For Mixtral-8x7B (8 experts, hidden 4096, ffn 14336, top-2), Qwen3-30B-A3B (128 experts, 2048, 768, top-8) and
DeepSeek-V2-Lite (64 experts, 2048, 1408, top-6), a micro-batch of each of ``--tokens`` (4096 and 16384: one
sequence of 4096, and four) routed evenly: both expert weights (w13: gate and up fused, w2: down), each in
forward, dgrad and wgrad, timed as device time with the host ahead, in

- bf16 ``torch._grouped_mm`` (the executor's bf16 path),
- torch's fp8 grouped GEMM ``torch._scaled_grouped_mm`` with rowwise scales (the executor's fp8 default),
- one dense fp8 ``torch._scaled_mm`` of the same FLOPs (the rate a grouped kernel aims at),
- foldtune's kernel (executor/kernels/fp8/grouped_gemm.py), rowwise and blockwise scaling, on operands
  quantised beforehand, its launch config tuned on its first call at each shape (a compile and five runs a
  candidate: the compiles are most of this script's run time; Triton's cache makes a second run quicker).

Each product's fp8 results are first checked against bf16's: a relative Frobenius error above 0.06 (e4m3's
band is about 0.03-0.04) stops the script before anything of that product is timed (exit status 1). It then
prints TFLOP/s per product, foldtune's fraction of the dense fp8 rate, the fp8 results' error, the
quantisation of the product's activation into both its forms (ms; forward: x, dgrad: dy; the wgrad reads the
forms those made), and per linear layer the three products plus those two quantisations against bf16's
three products. Results go to bench/results/fp8_grouped_gemm_<date>.json and a section of
docs/benchmarks.md (bench/report.py, the section ``SECTION``; --no-write: the JSON only).

Usage (one H100 or H200, from the repository root; it prints its time):
    python3 -m bench.fp8_grouped_gemm
    python3 -m bench.fp8_grouped_gemm --models qwen3-30b-a3b --tokens 8192 --scalings blockwise
CPU smoke run (Triton's interpreter; no timing claim):
    TRITON_INTERPRET=1 python3 -m bench.fp8_grouped_gemm --tiny --out /tmp/gg.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from bench.report import RESULTS, machine, replace_section, save_json, utc_now
from executor.kernels.fp8 import grouped_gemm as gg
from executor.kernels.fp8.grouped_quant import SCALINGS
from executor.microbench.fp8_grouped import WrongResult, layer_rows, measure, products
from spec.catalog import get_model

MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v2-lite")
# a heading of its own (not the one-token-count section before it, which also holds a whole-step table
# written by hand that a rerun would otherwise wipe)
SECTION = ("## Grouped fp8 GEMM at 4096 and 16384 tokens: foldtune's kernel against torch's "
           "(`python3 -m bench.fp8_grouped_gemm`)")
TOKENS = (4096, 16384)  # micro-batches of one sequence of 4096 and of four
MAX_REL_ERR = 0.06  # above e4m3's band against bf16 (0.03-0.04 on Gaussian operands): a wrong result


def _cell(row: dict, key: str, fmt: str = "{:.0f}") -> str:
    value = row.get(key)
    return fmt.format(value) if value is not None else "-"


def tables(res: dict) -> str:
    scalings = res["scalings"]
    head = ["model", "tokens", "GEMM", "m × n × k, experts", "bf16", "torch fp8", "dense fp8"]
    for s in scalings:
        head += [s, "of dense", f"{s} err", f"{s} quant ms"]
    tokens = ", ".join(str(t) for t in res["tokens"])
    lines = [f"TFLOP/s per product; 'of dense': foldtune's rate over the dense fp8 GEMM's; err: relative "
             f"Frobenius error against bf16; quant ms: quantising the product's activation into both forms "
             f"(forward x, dgrad dy; not in the TFLOP/s). {res['device']}, micro-batches of {tokens} tokens"
             + ("; rowwise forward and dgrad with fast accumulation." if res.get("fast_accum") else "."), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * 4 + "---:|" * (len(head) - 4)]
    for r in res["rows"]:
        cells = [r["model"], str(r["tokens"]), r["name"], f"{r['m']} × {r['n']} × {r['k']}, {r['groups']}",
                 _cell(r, "bf16_tflops"), _cell(r, "torch_fp8_tflops"), _cell(r, "dense_fp8_tflops")]
        for s in scalings:
            quant = f"{r[f'{s}_quant_s'] * 1e3:.3f}" if r["product"] != "wgrad" else "-"
            cells += [_cell(r, f"{s}_tflops"), _cell(r, f"{s}_of_dense", "{:.2f}"), _cell(r, f"{s}_rel_err", "{:.3f}"),
                      quant]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Configs: " + "; ".join(f"{r['model']} {r['tokens']} {r['name']}: " + ", ".join(
        f"{s} {r[f'{s}_config']}" for s in scalings) for r in res["rows"]), "",
              "Per linear layer (three products; foldtune's with the quantisation of x and dy into both forms), ms:",
              "", "| model | tokens | weight | bf16 | " + " | ".join(f"{s} | bf16 / {s}" for s in scalings) + " |",
              "|---|---|---|" + "---:|" * (1 + 2 * len(scalings))]
    for layer in res["layers"]:
        cells = [layer["model"], str(layer["tokens"]), layer["weight"], f"{layer['bf16_s'] * 1e3:.3f}"]
        for s in scalings:
            cells += [f"{layer[f'{s}_s'] * 1e3:.3f}", _cell(layer, f"{s}_speedup", "{:.2f}")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="catalog models (default: %(default)s)")
    ap.add_argument("--tokens", default=",".join(str(t) for t in TOKENS),
                    help="micro-batch sizes in tokens, before top-k routing (default: %(default)s)")
    ap.add_argument("--scalings", default=",".join(SCALINGS), help="foldtune's scalings (default: %(default)s)")
    ap.add_argument("--calls", type=int, default=8, help="calls a timed window (default 8)")
    ap.add_argument("--fast-accum", action="store_true",
                    help="rowwise forward and dgrad without promoting the partial sums (the wgrad always promotes)")
    ap.add_argument("--out", help=f"the JSON here (default {RESULTS.name}/fp8_grouped_gemm_<date>.json)")
    ap.add_argument("--no-write", action="store_true", help="leave docs/benchmarks.md alone")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny-moe, 64 tokens, on the CPU (under TRITON_INTERPRET=1 through the kernels): a smoke test")
    args = ap.parse_args(argv)
    scalings = tuple(args.scalings.split(","))
    if any(s not in SCALINGS for s in scalings):
        ap.error(f"--scalings must name {', '.join(SCALINGS)}, got {args.scalings}")
    start = time.perf_counter()
    if args.tiny:
        device, models, token_counts = torch.device("cpu"), ("tiny-moe",), (64,)
        kernel = os.environ.get("TRITON_INTERPRET") == "1" and gg.triton is not None
    else:
        if not torch.cuda.is_available():
            print("fp8_grouped_gemm: needs a CUDA GPU (sm90 for torch's fp8 kernels); --tiny runs on the CPU",
                  file=sys.stderr)
            return 2
        device, models = torch.device("cuda"), tuple(args.models.split(","))
        token_counts = tuple(int(t) for t in args.tokens.split(","))
        kernel = gg.kernels_ok(device)
        if not kernel:
            why = gg._kernels_absent(device) or "they failed their first-use check (the warning above)"
            print(f"fp8_grouped_gemm: foldtune's kernels are off on this GPU ({why}): timing their emulation",
                  file=sys.stderr)
    print(f"fp8_grouped_gemm: {', '.join(models)} at {', '.join(map(str, token_counts))} tokens on {machine()}; "
          f"foldtune's kernels {'on' if kernel else 'EMULATED'} (the first call at a shape tunes its config)")
    rows = []
    try:
        for tokens in token_counts:
            for name in models:
                rows += measure(products(name, get_model(name), tokens), device, kernel, scalings, calls=args.calls,
                                fast_accum=args.fast_accum, max_rel_err=MAX_REL_ERR)
    except WrongResult as wrong:
        print(f"fp8_grouped_gemm: WRONG RESULT, stopped before timing it: {wrong}", file=sys.stderr)
        return 1
    res = {"date": utc_now(), "device": machine(), "torch": torch.__version__,
           "triton": getattr(gg.triton, "__version__", None), "tokens": list(token_counts),
           "scalings": list(scalings),
           "fast_accum": args.fast_accum,
           "kernels": kernel, "command": " ".join(["python3 -m bench.fp8_grouped_gemm", *(argv or sys.argv[1:])]),
           "rows": rows, "layers": layer_rows(rows, scalings), "seconds": time.perf_counter() - start}
    text = tables(res)
    print(text)
    print(f"fp8_grouped_gemm: {res['seconds']:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    else:
        day = res["date"][:10]
        print(f"wrote {save_json(res, f'fp8_grouped_gemm_{day}.json')}")
    if not (args.no_write or args.tiny):
        replace_section(SECTION, f"{SECTION}\n\nMeasured {res['date']} on {res['device']} (torch {res['torch']}, "
                                 f"Triton {res['triton']}) by `{res['command']}`, {res['seconds']:.0f} s.\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
