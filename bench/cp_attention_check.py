"""Context-parallel attention on one GPU: the executor's flash path and its alternatives, checked and timed.

No process group: the all-gathered K/V of a CP rank is simulated by indexing a whole-sequence K/V with
``all_positions``. For cp = 2 and 4 it

- checks that ``aten._scaled_dot_product_flash_attention(q, k, v, 0, True)`` with seq_q < seq_k aligns its
  causal mask bottom-right (what the executor's formulation relies on) against explicit masks;
- checks every CP variant against the masked path and against full causal SDPA over the whole sequence
  (output and q/k/v gradients, all ranks assembled), and runs the executor's first-use self-check;
- times forward+backward of one CP rank's attention per variant in steady state (warm-up, then ``--iters``
  fwd+bwd back to back between one pair of CUDA events, no sync inside; median of ``--reps`` such runs)
  with the host's issue time per iteration beside it: where that is as large, the steady figure is host
  time, not GPU time; so also the GPU time proper, the sum of the kernels' durations from the profiler over
  ``--iters`` iterations, split into attention kernels (flash/fmha/cuDNN) and the rest (K/V reorder, GQA
  repeat, merge, concatenation, gradient accumulation); for the variants composed of separate pieces, K/V
  preparation (reorder into global order, plus the GQA repeat where needed) and attention on prepared K/V
  timed alone in steady state; the whole path also in isolation (one sync per iteration, median), which
  adds host launch cost that a training step hides;
- times the non-CP references, causal attention over the whole sequence divided by cp (the same causal
  work as one CP rank's s/cp queries): flash with GQA taken natively (the ideal), SDPA with K/V repeated as
  the torch backend runs it, and cuDNN where it runs;
- prints a table and writes JSON to ``--out``.

``--before FILE`` adds a variant loaded from a Python file defining ``prepare_kv(k, v, cp, heads)``,
``attend(q, k, v, cp, rank)`` and ``kernels_only(q, k, v, cp, rank)`` (e.g. an older formulation, to time
it in the same run).

Inputs are laid out as the executor has them ([s, b, heads, d] storage seen as [b, heads, s, d]).

Needs only torch and the executor:  python3 -m bench.cp_attention_check --out cp.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from executor.parallel import context_parallel as cpm

ATTENTION_KERNELS = ("flash", "fmha", "attention", "attn", "sdpa", "cudnn")


class Variant:
    """One CP formulation: ``prepare(k, v, cp)`` turns the gathered K/V into what ``attend(q, k, v, cp, rank)``
    takes (``prepare`` None: ``attend`` takes the gathered K/V, one piece); ``kernels`` (optional) runs only
    its attention kernels, without the merge."""

    def __init__(self, prepare, attend, kernels=None):
        self.prepare, self.attend, self.kernels = prepare or (lambda k, v, cp: (k, v)), attend, kernels
        self.pieces = prepare is not None

    def __call__(self, q, k, v, cp, rank):
        return self.attend(q, *self.prepare(k, v, cp), cp, rank)


def _repeat(k, v, groups):
    return k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)


def lower_right_chunk(q, k, v):
    """One chunk on the flash kernel, bottom-right causal, GQA native, through the op's autograd formula."""
    if q.is_cuda:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                                          enable_gqa=q.shape[1] != k.shape[1])


def _composed(q, k, v, cp, rank):
    """The executor's formulation composed of separate autograd ops (slices, one op per chunk, a cat)."""
    c = q.shape[2] // 2
    outs = [lower_right_chunk(q[:, :, t * c:(t + 1) * c], k[:, :, :(j + 1) * c], v[:, :, :(j + 1) * c])
            for t, j in enumerate(cpm.local_chunks(cp, rank))]
    return torch.cat([o.transpose(1, 2) for o in outs], dim=1).transpose(1, 2)


_MASKS: dict = {}


def _mask(s, cp, rank, device):
    """The masked path's mask, built once per shape (as the executor builds it once per step)."""
    key = (s, cp, rank, str(device))
    if key not in _MASKS:
        _MASKS[key] = cpm.causal_mask(s, cp, rank, device)
    return _MASKS[key]


def _sdpa_lower_right(q, k, v, cp, rank):
    """One public-API SDPA call per local chunk with a ``causal_lower_right`` bias and ``enable_gqa``."""
    c = q.shape[2] // 2
    outs = [F.scaled_dot_product_attention(q[:, :, t * c:(t + 1) * c], k[:, :, :(j + 1) * c], v[:, :, :(j + 1) * c],
                                           attn_mask=causal_lower_right(c, (j + 1) * c),
                                           enable_gqa=q.shape[1] != k.shape[1])
            for t, j in enumerate(cpm.local_chunks(cp, rank))]
    return torch.cat(outs, dim=2)


def variants(heads: int, kv_heads: int, before) -> dict[str, Variant]:
    groups = heads // kv_heads
    ordered = lambda k, v, cp: (cpm.global_order(k, cp), cpm.global_order(v, cp))  # noqa: E731
    out = {
        "lower-right flash, one node (executor)": Variant(None, cpm.flash_attention),
        "lower-right flash, composed ops": Variant(ordered, _composed),
        "lower-right flash, composed, K/V repeated": Variant(lambda k, v, cp: _repeat(*ordered(k, v, cp), groups),
                                                             _composed),
        "causal_lower_right SDPA, enable_gqa": Variant(ordered, _sdpa_lower_right),
        "masked SDPA (fallback)": Variant(
            lambda k, v, cp: _repeat(k, v, groups),
            lambda q, k, v, cp, rank: cpm.masked_attention(q, k, v, _mask(k.shape[2], cp, rank, q.device))),
    }
    if before is not None:
        out["before: " + before.NAME] = Variant(lambda k, v, cp: before.prepare_kv(k, v, cp, heads), before.attend,
                                                before.kernels_only)
    return out


def full_causal_repeated(q, k, v) -> torch.Tensor:
    """Non-CP causal attention as the executor's torch backend runs it (K/V repeated, SDPA is_causal)."""
    return F.scaled_dot_product_attention(q, *_repeat(k, v, q.shape[1] // k.shape[1]), is_causal=True)


def full_causal_flash(q, k, v) -> torch.Tensor:
    """Non-CP causal attention on the flash kernel with GQA taken natively (no repeat): the ideal."""
    if q.is_cuda:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def full_causal_cudnn(q, k, v) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, *_repeat(k, v, q.shape[1] // k.shape[1]), is_causal=True)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()


def alignment_check(args, dtype) -> dict:
    """Errors of the chunk kernel (c queries against 3c keys, is_causal) against explicit bottom-right and
    top-left masks; bottom-right small and top-left large means the kernel aligns bottom-right."""
    gen = torch.Generator(device=args.device).manual_seed(11)
    c, h, kvh, d = 256, args.heads, args.kv_heads, args.head_dim
    q = torch.randn(1, h, c, d, device=args.device, generator=gen).to(dtype)
    k, v = (torch.randn(1, kvh, 3 * c, d, device=args.device, generator=gen).to(dtype) for _ in range(2))
    got = lower_right_chunk(q, k, v)
    rows, cols = torch.arange(c, device=args.device).unsqueeze(1), torch.arange(3 * c, device=args.device)
    kr, vr = _repeat(k, v, h // kvh)
    with sdpa_kernel(SDPBackend.MATH):
        bottom_right = F.scaled_dot_product_attention(q.float(), kr.float(), vr.float(), attn_mask=cols <= rows + 2 * c)
        top_left = F.scaled_dot_product_attention(q.float(), kr.float(), vr.float(), attn_mask=cols <= rows)
    return {"vs_bottom_right_mask": rel_err(got, bottom_right), "vs_top_left_mask": rel_err(got, top_left)}


def dispatch_check(args, dtype) -> str:
    """What the executor's ``cp_attention`` takes here after its first-use check (threaded, as in training)."""
    gen = torch.Generator(device=args.device).manual_seed(5)
    cp, s = 2, 512
    q = torch.randn(1, args.heads, s // cp, args.head_dim, device=args.device, generator=gen).to(dtype)
    k, v = (torch.randn(1, args.kv_heads, s, args.head_dim, device=args.device, generator=gen).to(dtype) for _ in range(2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = cpm.cp_attention(q, k, v, cpm.causal_mask(s, cp, 0, args.device), cp, 0)
    flash = cpm._flash_supported(q, v) and bool(cpm._CHECKED) and all(cpm._CHECKED.values())
    agrees = rel_err(out, cpm.flash_attention(q, k, v, cp, 0))
    return (("flash path" if flash else "masked path") + f" (vs flash_attention {agrees:.1e})"
            + "".join(f"; warning: {w.message}" for w in caught))


def check(cp: int, args, dtype, paths: dict) -> dict:
    """Max relative errors (max |diff| / max |ref|) of out, dq, dk, dv over all ranks, per variant."""
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

    names = ("out", "dq", "dk", "dv")
    masked = assembled(paths["masked SDPA (fallback)"])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = full_causal_repeated(*leaves)
    ref_out.backward(g)
    ref = [ref_out.detach()] + [t.grad for t in leaves]
    masked_err = {n: rel_err(a, w) for n, a, w in zip(names, masked, ref)}
    # a variant must be as close to full causal attention as the masked path is, up to bf16 rounding
    bound = max(2e-2, 2 * max(masked_err.values()))
    errors = {"masked vs full causal": masked_err}
    for name, fn in [(n, f) for n, f in paths.items() if not n.startswith("masked")]:
        try:
            got = assembled(fn)
        except Exception as exc:  # noqa: BLE001 — a variant that does not run is reported, not fatal
            errors[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        e = {"vs masked": {n: rel_err(a, w) for n, a, w in zip(names, got, masked)},
             "vs full causal": {n: rel_err(a, w) for n, a, w in zip(names, got, ref)}}
        e["ok"] = max(max(e["vs masked"].values()), max(e["vs full causal"].values())) <= bound
        errors[name] = e
    return errors


def _grads(fn, inputs, grads):
    outs = fn(*inputs)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    torch.autograd.grad(outs, inputs, grads[:len(outs)])


def steady_ms(fn, tensors, grads, args) -> tuple[float, float]:
    """Median over ``reps`` of (GPU ms per fwd+bwd over ``iters`` back to back between two events, no sync
    inside) and the host's issue time per iteration in ms (the GPU time is host-bound if this is larger)."""
    inputs = [t.detach().clone().requires_grad_() for t in tensors]
    for _ in range(args.warmup):
        _grads(fn, inputs, grads)
    if not grads[0].is_cuda:
        t0 = time.perf_counter()
        for _ in range(args.iters):
            _grads(fn, inputs, grads)
        ms = 1e3 * (time.perf_counter() - t0) / args.iters
        return ms, ms
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(args.reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            _grads(fn, inputs, grads)
        host.append(1e3 * (time.perf_counter() - t0) / args.iters)
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) / args.iters)
    return statistics.median(gpu), statistics.median(host)


def isolated_ms(fn, tensors, grads, args) -> float:
    """Median of fwd+bwd timed one at a time (events around each, a sync after each): includes host launch
    cost that a training step hides."""
    inputs = [t.detach().clone().requires_grad_() for t in tensors]
    times = []
    for i in range(args.warmup + args.iters):
        if grads[0].is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        _grads(fn, inputs, grads)
        if grads[0].is_cuda:
            end.record()
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(start.elapsed_time(end) if grads[0].is_cuda else 1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def kernel_ms(fn, tensors, grads, args) -> tuple[float, float, list[str]]:
    """GPU time per fwd+bwd as the kernels' summed durations (profiler, ``iters`` iterations back to back;
    launch gaps excluded), the attention kernels' share of it, and the kernel names."""
    inputs = [t.detach().clone().requires_grad_() for t in tensors]
    for _ in range(2):
        _grads(fn, inputs, grads)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            _grads(fn, inputs, grads)
        torch.cuda.synchronize()
    total = attention = 0.0
    names = set()
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0.0)
        if us <= 0:
            continue
        names.add(e.key[:90])
        total += us
        if any(w in e.key.lower() for w in ATTENTION_KERNELS):
            attention += us
    return total / 1e3 / args.iters, attention / 1e3 / args.iters, sorted(names)


def timings(cp: int, args, dtype, paths: dict) -> dict:
    b, h, kvh, d, s = args.batch, args.heads, args.kv_heads, args.head_dim, args.seq
    gen = torch.Generator(device=args.device).manual_seed(100 + cp)
    rank = 0  # every rank holds the same causal work (chunks i and 2cp−1−i)
    q = torch.randn(s // cp, b, h, d, device=args.device, generator=gen).to(dtype).permute(1, 2, 0, 3)
    k, v = (torch.randn(s, b, kvh, d, device=args.device, generator=gen).to(dtype).permute(1, 2, 0, 3)
            for _ in range(2))
    g = torch.randn_like(q)
    rows, kernels = {}, {}

    def gpu(row, name, fn, tensors, grads, scale=1.0):
        if args.device != "cuda":
            return
        try:
            row["gpu"], row["attn kern"], names = kernel_ms(fn, tensors, grads, args)
            row["gpu"], row["attn kern"] = row["gpu"] / scale, row["attn kern"] / scale
            row["other kern"] = row["gpu"] - row["attn kern"]
            kernels[name] = names
        except Exception as exc:  # noqa: BLE001 — the profiler (CUPTI) is a nicety here
            kernels[name] = [f"profiler: {type(exc).__name__}: {exc}"]

    for name, var in paths.items():
        row = {}
        try:
            whole = lambda q_, k_, v_: var(q_, k_, v_, cp, rank)  # noqa: E731
            row["steady"], row["host"] = steady_ms(whole, (q, k, v), (g,), args)
            row["isolated"] = isolated_ms(whole, (q, k, v), (g,), args)
            gpu(row, name, whole, (q, k, v), (g,))
            if var.pieces:
                kp, vp = (t.detach() for t in var.prepare(k, v, cp))
                row["prep"] = steady_ms(lambda k_, v_: var.prepare(k_, v_, cp), (k, v),
                                        (torch.randn_like(kp), torch.randn_like(vp)), args)[0]
                row["attend"] = steady_ms(lambda q_, k_, v_: var.attend(q_, k_, v_, cp, rank), (q, kp, vp),
                                          (g,), args)[0]
            if var.kernels is not None:
                outs = var.kernels(q, kp, vp, cp, rank)
                row["no-merge"] = steady_ms(lambda q_, k_, v_: var.kernels(q_, k_, v_, cp, rank), (q, kp, vp),
                                            tuple(torch.randn_like(o) for o in outs), args)[0]
        except Exception as exc:  # noqa: BLE001 — a variant that does not run is reported, not fatal
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows[name] = row
    fq = torch.randn(s, b, h, d, device=args.device, generator=gen).to(dtype).permute(1, 2, 0, 3)
    fg = torch.randn_like(fq)
    refs = {"ideal: non-CP causal flash, GQA native": full_causal_flash,
            "non-CP SDPA is_causal, K/V repeated": full_causal_repeated}
    if args.device == "cuda":
        refs["non-CP cuDNN is_causal, K/V repeated"] = full_causal_cudnn
    for name, fn in refs.items():
        try:
            gpu_ms, host = steady_ms(fn, (fq, k, v), (fg,), args)
            row = {"steady": gpu_ms / cp, "host": host, "isolated": isolated_ms(fn, (fq, k, v), (fg,), args) / cp}
            gpu(row, name, fn, (fq, k, v), (fg,), cp)
            rows[name + " / cp"] = row
        except Exception as exc:  # noqa: BLE001
            rows[name + " / cp"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"ms": rows, "kernels": kernels}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=20, help="fwd+bwd per timed run")
    p.add_argument("--reps", type=int, default=3, help="timed runs (median)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--cps", type=int, nargs="+", default=[2, 4])
    p.add_argument("--before", help="Python file with an older formulation to time beside (see docstring)")
    p.add_argument("--device", default="cuda", help="cpu only to smoke-test this script (small shapes)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --device cpu for a smoke test)")
    dtype = getattr(torch, args.dtype)
    before = None
    if args.before:
        spec = importlib.util.spec_from_file_location("cp_before", args.before)
        before = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(before)
    paths = variants(args.heads, args.kv_heads, before)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
              "device": device, "command": " ".join(sys.argv), "shape": vars(args), "cp": {}}
    try:
        cpm.check_flash(dtype, args.head_dim, args.device)
        result["self_check"] = "passed"
    except Exception as exc:  # noqa: BLE001 — reported, not hidden
        result["self_check"] = f"FAILED: {type(exc).__name__}: {exc}"
    result["alignment"] = alignment_check(args, dtype)
    result["dispatch"] = dispatch_check(args, dtype)
    for cp in args.cps:
        result["cp"][cp] = {"errors": check(cp, args, dtype, paths)} | timings(cp, args, dtype, paths)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))

    for cp, r in result["cp"].items():
        for name, ks in r["kernels"].items():
            if "executor" in name or "ideal" in name:
                print(f"cp{cp} {name} kernels: {'; '.join(ks)}")
    print(f"\n{result['device']}, torch {result['torch']}, {result['date_utc']}; b={args.batch} s={args.seq} "
          f"heads {args.heads}/{args.kv_heads} d={args.head_dim} {args.dtype}; self-check {result['self_check']}")
    print(f"executor dispatch (cp_attention after its first-use check): {result['dispatch']}")
    a = result["alignment"]
    print(f"chunk kernel (c=256 queries vs 3c keys, is_causal) vs bottom-right mask {a['vs_bottom_right_mask']:.2e}, "
          f"vs top-left mask {a['vs_top_left_mask']:.2e}")
    print("max |err| / max |ref| (out dq dk dv):")
    for cp, r in result["cp"].items():
        for name, e in r["errors"].items():
            if "error" in e:
                print(f"  cp{cp} {name}: {e['error']}")
            elif "vs masked" in e:
                print(f"  cp{cp} {name:<42} {'ok' if e['ok'] else 'FAILED'}  vs masked "
                      + " ".join(f"{e['vs masked'][n]:.1e}" for n in ("out", "dq", "dk", "dv"))
                      + "  vs full causal " + " ".join(f"{e['vs full causal'][n]:.1e}" for n in ("out", "dq", "dk", "dv")))
            else:
                print(f"  cp{cp} {name:<42}     vs full causal " + " ".join(f"{e[n]:.1e}" for n in ("out", "dq", "dk", "dv")))
    cols = ("steady", "host", "gpu", "attn kern", "other kern", "prep", "attend", "no-merge", "isolated")
    print(f"\nfwd+bwd of one CP rank's attention, ms: steady = median of {args.reps} x {args.iters} back to back "
          "(host-bound where host, the issue time per iteration, is as large); gpu = kernels' summed durations "
          "(profiler), split into attention kernels and other kernels (reorder, repeat, merge, cat, grad "
          "accumulation); prep = K/V reorder (+repeat) alone, attend = attention on prepared K/V, no-merge = "
          "its attention kernels without the merge (steady); isolated = sync per iteration; /ideal: gpu over "
          "the ideal's gpu (steady over steady without a profiler)")
    print(f"{'cp':>3} {'variant':<46}" + "".join(f"{c:>11}" for c in cols) + f"{'/ideal':>8}")
    for cp, r in result["cp"].items():
        ideal = r["ms"]["ideal: non-CP causal flash, GQA native / cp"]
        key = "gpu" if "gpu" in ideal else "steady"
        for name, row in r["ms"].items():
            if "error" in row:
                print(f"{cp:>3} {name:<46} {row['error']}")
                continue
            ratio = f"{row[key] / ideal[key]:>8.2f}" if key in row and ideal.get(key) else ""
            print(f"{cp:>3} {name:<46}" + "".join(f"{row[c]:>11.3f}" if c in row else f"{'':>11}" for c in cols)
                  + ratio)


if __name__ == "__main__":
    main()
