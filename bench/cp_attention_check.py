"""Context-parallel attention on one GPU: the flash path against the masked SDPA path, checked and timed.

No process group: the all-gathered K/V of a CP rank is simulated by indexing a whole-sequence K/V with
``all_positions``. For cp = 2 and 4 it

- checks the flash path (executor/kernels/cp_flash.py) against the masked path and against full causal
  SDPA over the whole sequence (output and q/k/v gradients, all ranks assembled), and runs the executor's
  first-use self-check (with ``check_flash``);
- times forward+backward (median of CUDA-event timings) of one CP rank's attention on the flash path, the
  masked path, and the one-SDPA-call-per-chunk alternative with ``causal_lower_right``; and, as the non-CP
  reference, causal flash SDPA over the whole sequence divided by cp (the same causal work as one CP
  rank's s/cp queries);
- prints a table and writes JSON to ``--out``.

Needs only torch and the executor:  python3 bench/cp_attention_check.py --out cp.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from executor.parallel import context_parallel as cpm


def lower_right_attention(q, k_all, v_all, cp: int, rank: int) -> torch.Tensor:
    """The alternative: one SDPA call per local chunk over keys 0..(j+1)·c with a lower-right causal bias."""
    groups = q.shape[1] // k_all.shape[1]
    k, v = cpm.global_order(k_all, cp, groups), cpm.global_order(v_all, cp, groups)
    c = q.shape[2] // 2
    outs = []
    for t, j in enumerate(cpm.local_chunks(cp, rank)):
        kv = (j + 1) * c
        outs.append(F.scaled_dot_product_attention(q[:, :, t * c:(t + 1) * c], k[:, :, :kv], v[:, :, :kv],
                                                   attn_mask=causal_lower_right(c, kv)))
    return torch.cat(outs, dim=2)


def full_causal(q, k, v) -> torch.Tensor:
    """Non-CP causal attention as the executor's torch backend runs it (K/V repeated, flash)."""
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                          is_causal=True)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()


def check(cp: int, args, dtype) -> dict:
    """Max relative errors (max |diff| / max |ref|) of out, dq, dk, dv over all ranks."""
    gen = torch.Generator(device=args.device).manual_seed(cp)
    b, h, kvh, d, s = args.batch, args.heads, args.kv_heads, args.head_dim, args.seq
    q, k, v, g = (torch.randn(b, n, s, d, device=args.device, generator=gen).to(dtype)
                  for n in (h, kvh, kvh, h))
    keys = cpm.all_positions(s, cp, args.device)

    def assembled(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = torch.empty_like(q)
        for rank in range(cp):
            pos = cpm.cp_positions(s, cp, rank, args.device)
            o = fn(leaves[0][:, :, pos], leaves[1][:, :, keys], leaves[2][:, :, keys], cp, rank)
            o.backward(g[:, :, pos])
            out[:, :, pos] = o.detach()
        return [out] + [t.grad for t in leaves]

    flash = assembled(cpm.flash_attention)
    masked = assembled(lambda q_, k_, v_, c, r: cpm.masked_attention(q_, k_, v_, cpm.causal_mask(s, c, r, args.device)))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = full_causal(*leaves)
    ref_out.backward(g)
    ref = [ref_out.detach()] + [t.grad for t in leaves]
    names = ("out", "dq", "dk", "dv")
    errors = {"flash_vs_masked": {n: rel_err(a, w) for n, a, w in zip(names, flash, masked)},
              "flash_vs_full_causal": {n: rel_err(a, w) for n, a, w in zip(names, flash, ref)},
              "masked_vs_full_causal": {n: rel_err(a, w) for n, a, w in zip(names, masked, ref)}}
    # the flash path must be as close to full causal attention as the masked path is, up to bf16 rounding
    worst = max(max(e.values()) for what, e in errors.items() if what.startswith("flash"))
    errors["ok"] = worst <= max(2e-2, 2 * max(errors["masked_vs_full_causal"].values()))
    return errors


def time_fwd_bwd(fn, tensors, grad, iters: int, warmup: int) -> float:
    """Median forward+backward time in ms."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    cuda = grad.is_cuda
    times = []
    for i in range(warmup + iters):
        for t in leaves:
            t.grad = None
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn(*leaves).backward(grad)
        if cuda:
            end.record()
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) if cuda else 1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def kernels_of(fn, tensors, grad) -> list[str]:
    """Names of the attention CUDA kernels one forward+backward launches (to see flash vs efficient vs math)."""
    if not grad.is_cuda:
        return []
    leaves = [t.clone().requires_grad_() for t in tensors]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(*leaves).backward(grad)
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    keep = ("flash", "fmha", "attention", "softmax", "gemm", "sm90", "cutlass")
    return sorted(n[:80] for n in names if any(w in n.lower() for w in keep))


def timings(cp: int, args, dtype) -> dict:
    b, h, kvh, d, s = args.batch, args.heads, args.kv_heads, args.head_dim, args.seq
    gen = torch.Generator(device=args.device).manual_seed(100 + cp)
    rank = 0  # every rank holds the same causal work (chunks i and 2cp−1−i)
    q = torch.randn(b, h, s // cp, d, device=args.device, generator=gen).to(dtype)
    k, v = (torch.randn(b, kvh, s, d, device=args.device, generator=gen).to(dtype) for _ in range(2))
    g = torch.randn_like(q)
    mask = cpm.causal_mask(s, cp, rank, args.device)
    paths = {
        "flash (cp_flash)": lambda *t: cpm.flash_attention(*t, cp, rank),
        "lower-right SDPA": lambda *t: lower_right_attention(*t, cp, rank),
        "masked SDPA": lambda *t: cpm.masked_attention(*t, mask),
    }
    row = {name: time_fwd_bwd(fn, (q, k, v), g, args.iters, args.warmup) for name, fn in paths.items()}
    fq = torch.randn(b, h, s, d, device=args.device, generator=gen).to(dtype)
    row["non-CP causal flash / cp"] = time_fwd_bwd(full_causal, (fq, k, v), torch.randn_like(fq),
                                                   args.iters, args.warmup) / cp
    try:
        kernels = {name: kernels_of(fn, (q, k, v), g) for name, fn in paths.items()}
    except Exception as exc:  # noqa: BLE001 — the profiler (CUPTI) is a nicety here
        kernels = {"profiler": [f"{type(exc).__name__}: {exc}"]}
    return {"ms": row, "kernels": kernels}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--cps", type=int, nargs="+", default=[2, 4])
    p.add_argument("--device", default="cuda", help="cpu only to smoke-test this script (small shapes)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --device cpu for a smoke test)")
    dtype = getattr(torch, args.dtype)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
              "device": device, "shape": vars(args), "cp": {}}
    try:
        cpm.check_flash(dtype, args.head_dim, args.device)
        result["self_check"] = "passed"
    except Exception as exc:  # noqa: BLE001 — reported, not hidden
        result["self_check"] = f"FAILED: {type(exc).__name__}: {exc}"
    for cp in args.cps:
        result["cp"][cp] = {"errors": check(cp, args, dtype)} | timings(cp, args, dtype)

    print(f"{result['device']}, torch {result['torch']}, {result['date_utc']}; b={args.batch} s={args.seq} "
          f"heads {args.heads}/{args.kv_heads} d={args.head_dim} {args.dtype}; self-check {result['self_check']}")
    print("fwd+bwd of one CP rank's attention, ms (median of %d):" % args.iters)
    names = list(next(iter(result["cp"].values()))["ms"])
    print(f"{'cp':>3} " + " ".join(f"{n:>26}" for n in names))
    for cp, r in result["cp"].items():
        print(f"{cp:>3} " + " ".join(f"{r['ms'][n]:>26.3f}" for n in names))
    print("max |err| / max |ref| (out dq dk dv):")
    for cp, r in result["cp"].items():
        print(f"  cp{cp} {'ok' if r['errors']['ok'] else 'FAILED'}")
        for what, errs in r["errors"].items():
            if what == "ok":
                continue
            print(f"  cp{cp} {what:<22} " + " ".join(f"{errs[n]:.2e}" for n in ("out", "dq", "dk", "dv")))
    for cp, r in result["cp"].items():
        for name, ks in r["kernels"].items():
            if ks:
                    print(f"  cp{cp} {name} kernels: {'; '.join(ks)}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
