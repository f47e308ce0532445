"""Which grouped GEMM of the fp8-against-bf16 step comparison (issue 19) computes wrong, if any: each one
against an fp64 per-group loop on the same operands, at routing-like group sizes (an empty expert, sizes
that are no multiple of 16 or 8, one large group).

The fp8 step run (bench/fp8_step.py, H100) trains *faster* than bf16 while the CPU runs of both agree: the
two runs also differ in code, not only in precision — bf16 runs the experts through one autograd node
(:mod:`executor.grouped_swiglu`: ``torch._grouped_mm`` forward, dgrad and the 2D×2D wgrad over unpadded
token groups), fp8 through :mod:`executor.kernels.fp8.gemm` (wgrad over groups padded to 16 rows). This
probe checks, on the device given, each product in both paths:

- ``bf16 fwd`` / ``bf16 dgrad`` / ``bf16 wgrad``: ``torch._grouped_mm`` as grouped_swiglu calls it
  (2D×3D, 2D×3D against the untransposed weight, 2D×2D with the transposed gradient);
- ``fp8 fwd`` / ``fp8 dgrad`` / ``fp8 wgrad``: the fp8 GEMMs (kernels where they run, else the emulation);
- ``swiglu dx`` / ``swiglu dw13`` / ``swiglu dw2``: grouped_swiglu's backward against autograd through the
  fp64 loop.

Reported per product: the largest per-group relative error ||got − ref|| / ||ref|| (Frobenius; an empty
group's ref is 0, so its error is ||got||, which must be 0). bf16 products should sit near 2^-8 (≈ 4e-3),
fp8 ones near 2^-4 / sqrt-ish (a few %); anything at 0.1 or more is a wrong result. Exit status 1 if any
product exceeds ``--max-error`` (0.1).

Usage: python3 -m bench.grouped_mm_probe [--device cuda] [--out $OUT/grouped_mm_probe.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from executor.kernels.fp8 import gemm as fp8_gemm
from executor.microbench.grouped_mm_check import COUNTS, probe

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-error", type=float, default=0.1, help="per-group relative error that fails")
    parser.add_argument("--out", default=None, help="write the errors as JSON here")
    args = parser.parse_args(argv)
    errors = probe(args.device)
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(f"grouped GEMMs against an fp64 per-group loop on {name}, torch {torch.__version__}, "
          f"fp8 kernels: {fp8_gemm.emulation_reason(args.device) or 'yes'}; group sizes {COUNTS}")
    for product, err in errors.items():
        print(f"  {product:12s} largest per-group relative error {err:.2e}"
              f"{'  WRONG' if err > args.max_error else ''}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "counts": COUNTS, "errors": errors}, f, indent=1)
    return 1 if any(err > args.max_error for err in errors.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
