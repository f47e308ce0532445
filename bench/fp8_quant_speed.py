"""The fp8 quantisation kernels (executor/kernels/fp8/quantize.py) at one step's shapes, and their launch tiles.

For the Mixtral-shaped proxy of ``bench/fp8_step.py`` (2 layers, seq 4096, 4 micro-batches of 1: 8192 routed
rows a layer and micro-batch, hidden 4096, ffn 14336, 8 experts) every quantisation a step runs, at its shape,
with how often a step runs it:

- rowwise (``_quantize_rows_fused``): the expert GEMMs' A operands, x and h in the forward, dy and d(gate,up)
  in dgrad — 8 each a step;
- per (expert, column) in the padded wgrad layout (``quantize_groups_colwise``): the same four for wgrad — 8 each;
- both forms (``quantize_both``): w13 and w2 once a step per layer; the dense linears' x and dy (q/k/v and o
  projections) per layer and micro-batch.

For each kernel family the bench (:mod:`executor.microbench.quant_tiles`) times the current launch tiles
(``quantize.TILES``), the same with the integer rounding instead of the GPU's conversion, and each value of
its ``SWEEP`` in turn; it checks every
variant's bytes and scales against the torch path (a tile that changes a byte is reported, never picked) and
prints per variant the step's time in that family (Σ calls × time) and its bandwidth against a device copy of
the same bytes. Times are device time with the host ahead (``time_host_ahead``). Bytes counted: the operand
read once, the e4m3 outputs and scales written once — the least any implementation moves (the both-forms
kernels read twice).

Usage (GPU): python3 -m bench.fp8_quant_speed --out quant.json
CPU smoke run (Triton's interpreter): TRITON_INTERPRET=1 python3 -m bench.fp8_quant_speed --tiny --families rows
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch

from executor.microbench.quant_tiles import TINY_SCALE, measure

def table(res: dict) -> str:
    lines = [f"copy bandwidth (same device, largest operand): {res['copy_GBps']:.0f} GB/s; rounding by the "
             f"GPU's conversion: {res.get('hw_cast')}"]
    for family, fam in res["families"].items():
        lines.append(f"{family}: ms a step (Σ calls × time), per case GB/s; best {fam['best']}")
        for r in fam["variants"]:
            if "error" in r:
                lines.append(f"  {str(r['tiles']):<34} ERROR {r['error'][:120]}")
                continue
            cells = ", ".join(f"{name.split(' ')[0]} {v['GBps']:.0f}{'' if v['equal'] else ' DIFFERS'}"
                              for name, v in r["per_case"].items())
            lines.append(f"  {str(r['tiles']):<34} {r['step_s'] * 1e3:7.2f}  {cells}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON results")
    ap.add_argument("--families", default="rows,groups,both")
    ap.add_argument("--tiny", action="store_true", help=f"every dim / {TINY_SCALE} (CPU interpreter smoke test)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda" and not args.tiny:
        print("fp8_quant_speed: the Triton kernels need a GPU (or --tiny under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    res = measure(dev, TINY_SCALE if args.tiny else 1, tuple(args.families.split(",")),
                  iters=1 if args.tiny else None)
    res.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", torch=torch.__version__,
               command=" ".join(sys.argv))
    print(table(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
