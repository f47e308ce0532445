"""The fp32 main-gradient accumulation, torch's ``main.add_(grad)`` against the Triton kernel
(executor/kernels/triton_grad_accumulate.py) that replaces it, at Mixtral-8x7B's gradient sizes (issue 19).

Per size: milliseconds per call and the HBM rate, counting 10 bytes per element for a bf16/fp16 gradient
(read 2 + 4, write 4: the cost model's MAIN_GRAD_ACCUM_BYTES), and whether one call of each gives the same
bits. Before timing, the kernel's first-use check (the one the executor runs) is reported. On CUDA a buffer of
more than 2^31 elements is checked and timed too (``--no-huge`` skips it: ~22 GB of device memory).

On CPU the kernel runs only under Triton's interpreter (TRITON_INTERPRET=1 in the environment); without it
the kernel columns are empty. ``--tiny`` takes small sizes and few iterations (the CPU smoke test).

Usage (one GPU, well under a minute):
  python3 -m bench.grad_accumulate_gpu --sweep --out $OUT/grad_accumulate.json
  TRITON_INTERPRET=1 python3 -m bench.grad_accumulate_gpu --device cpu --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from executor.microbench.grad_accumulate import passed, run

def table(result: dict) -> str:
    """The rows as a fixed-width text table."""
    lines = [f"main-grad accumulation (fp32 += 16-bit) on {result['device']}, torch {result['torch']}, "
             f"triton {result['triton']}; first-use check {result['first_use_check'] or 'not run'}",
             f"{'size':32s} {'dtype':8s} {'elements':>13s} {'torch ms':>9s} {'GB/s':>7s} {'kernel ms':>9s} "
             f"{'GB/s':>7s} {'x':>5s} bitwise"]
    for r in result["rows"]:
        kernel = (f"{r['kernel_ms']:9.4f} {r['kernel_GBps']:7.0f} {r['speedup']:5.2f} "
                  f"{'yes' if r['bitwise_equal'] else 'NO'}" if "kernel_ms" in r else f"{'-':>9s} {'-':>7s} {'-':>5s} -")
        lines.append(f"{r['name']:32s} {r['grad_dtype']:8s} {r['elements']:13d} {r['torch_ms']:9.4f} "
                     f"{r['torch_GBps']:7.0f} {kernel}")
    if result["sweep"]:
        lines.append(f"kernel configurations on {result['sweep'][0]['elements']} bf16 elements (vec 0: flat block)")
        for r in result["sweep"]:
            lines.append(f"  block {r['block']:6d} vec {r['vec']} warps {r['num_warps']:2d}: {r['ms']:8.4f} ms "
                         f"{r['GBps']:6.0f} GB/s{'' if r['bitwise_equal'] else '  NOT BITWISE'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="small sizes, 3 iterations (CPU smoke test)")
    parser.add_argument("--no-huge", action="store_true", help="skip the > 2^31-element buffer on CUDA")
    parser.add_argument("--fp16", action="store_true", help="also fp16 gradients (default: bf16 only)")
    parser.add_argument("--sweep", action="store_true", help="also time kernel block/vec/warps choices")
    parser.add_argument("--out", default=None,
                        help="JSON path (default: $OUT/grad_accumulate.json where OUT is set, else none)")
    args = parser.parse_args(argv)
    dtypes = [torch.bfloat16] + ([torch.float16] if args.fp16 else [])
    result = run(args.device, args.tiny, not args.no_huge, dtypes, args.sweep)
    print(table(result))
    out = args.out or (os.path.join(os.environ["OUT"], "grad_accumulate.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {out}")
    return 0 if passed(result) else 1


if __name__ == "__main__":
    sys.exit(main())
