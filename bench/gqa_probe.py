"""Does SDPA run grouped-query attention natively on this GPU? Per SDPA backend (flash, cuDNN, efficient):
whether ``enable_gqa=True`` with fewer K/V heads than query heads runs on that backend alone, its fwd+bwd time,
and its agreement with the same backend on K/V repeated per query head (what executor/kernels/torch_backend.py
does now). Mixtral's attention shape by default: 32 query heads, 8 K/V heads, head dim 128, seq 4096, bf16.

    python -m bench.gqa_probe --out $OUT/gqa_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from executor.microbench.timing import time_device

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def fwd_bwd(q, k, v, gqa: bool, out_grad):
    """Output and (dq, dk, dv) of causal attention; K/V repeated per query head unless ``gqa``."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    kk, vv = (k, v) if gqa else (k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1))
    o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
    o.backward(out_grad)
    return o.detach(), q.grad, k.grad, v.grad


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gqa_probe.json"))
    args = p.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    shape = (1, args.heads, args.seq, args.head_dim)
    q = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, args.kv_heads, args.seq, args.head_dim, device=dev, dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    dout = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=g)
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "shape": vars(args),
              "backends": {}}
    for name, backend in BACKENDS.items():
        row = {}
        for gqa in (False, True):
            key = "gqa" if gqa else "repeat"
            try:
                with sdpa_kernel([backend]):
                    got = fwd_bwd(q, k, v, gqa, dout)
                    row[key + "_ms"] = 1e3 * time_device(lambda: fwd_bwd(q, k, v, gqa, dout), dev, 3, 10)
                row[key] = got
            except RuntimeError as exc:  # the backend refuses the inputs
                row[key + "_error"] = str(exc).splitlines()[0][:200]
        if "repeat" in row and "gqa" in row:
            row["max_rel_diff"] = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))
                                      for a, b in zip(row["gqa"], row["repeat"]))
        row.pop("gqa", None)
        row.pop("repeat", None)
        report["backends"][name] = row
        print(name, row, flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
