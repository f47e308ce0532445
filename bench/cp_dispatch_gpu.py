"""Short-sequence CP and the token dispatchers on two GPUs, measured (issue 16), and the cost model's prices.

Two questions, each answered by timing the executor's own code paths on 2 ranks (one per GPU, NCCL):

(a) CP: does CP2 halve the attention of a Mixtral-shaped layer (hidden 4096, 32 heads, 8 KV heads, head dim
    128, bf16, micro-batch 1) at seq 2048 / 4096 / 8192? Per rank, fwd+bwd of
    ``core``      the attention core: CP1 ``kernels.attention`` over the whole sequence on each GPU alone;
                  CP2 ``context_parallel.cp_attention`` of this rank's s/2 queries against the gathered K/V
                  (the flash path: one bottom-right causal flash call per local chunk);
    ``kv``        CP2 only: the K/V exchange, ``gather_kv`` of K and of V over the CP group (forward
                  all-gather, backward reduce-scatter of their gradients);
    ``proj``      the layer's Q/K/V and output projections (plain matmuls of this rank's tokens: they
                  scale with s/cp exactly, timed so that the layer's speedup is visible);
    ``total``     proj + kv + core run back to back as one fwd+bwd (the layer as the executor runs it,
                  without norms and RoPE);
    speedup = CP1 total / CP2 total (ideal 2), and core speedup = CP1 core / CP2 core.
    Before timing, the CP2 output of every rank is checked against CP1 at its positions.
(b) Dispatchers at EP2 (8 experts, top-2, hidden 4096): ``dispatch`` + ``combine`` fwd+bwd of the
    executor's AllToAllDispatcher and AllGatherDispatcher over n tokens per rank (default 1k, 4k, 16k),
    uniform random routing fixed per case, the experts replaced by a copy (communication and permutation
    only, no router). Beside each time, the bytes each rank sends to the other (alltoall: the routed
    copies bound for the peer's experts; allgather: all its tokens plus their top-k probabilities and ids,
    and the reduce-scatter of the same token rows back).

The measuring code (the cases, timing, the CP check) is ``executor/microbench/exchanges.py``, which
``foldtune calibrate`` runs at the smallest case on two or more ranks to measure the per-call costs.

Timing: every op is warmed up, then per rank ``--iters`` calls back to back between two CUDA events after a
barrier (median of ``--reps`` such runs); the figure reported is the slowest rank's. CPU (``--cpu``: gloo,
tiny shapes, fp32) only smoke-tests the script; its times mean nothing.

``--price PROFILE`` (no GPU, no ranks) prints the cost model's prediction for exactly these cases from a
hardware profile JSON (``foldtune calibrate``'s output) or a catalog GPU name, from the named quantities of
``costmodel.context_parallel`` and ``costmodel.dispatch`` with the profile's per-call costs
(``costmodel.calibrate.exchange_prices``; the dispatcher column includes the permutation, as measured); ``--measured FILE`` puts a GPU run's JSON beside it.

    python -m bench.cp_dispatch_gpu --out $OUT/cp_dispatch.json            # 2 GPUs, about 1-2 minutes
    python -m bench.cp_dispatch_gpu --cpu --out /tmp/cp_dispatch_cpu.json  # smoke run, seconds
    python -m bench.cp_dispatch_gpu --price h100-sxm --measured $OUT/cp_dispatch.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

from costmodel.calibrate.exchange_prices import predict_bench
from executor.launch_local import launch
from executor.microbench.exchanges import BenchConfig, cp_cases, dispatcher_cases
from executor.parallel import context_parallel as cpm
from executor.parallel.groups import build_parallel_state
from spec.catalog import get_hardware
from spec.parallel_config import ParallelConfig
from spec.profile_io import load_profile


def worker(rank: int, world: int, cfg: BenchConfig) -> dict:
    """Both parts on this rank (launched by executor.launch_local.launch, one process per rank)."""
    dev = torch.device("cuda", rank) if cfg.device == "cuda" else torch.device("cpu")
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(cfg.seed + rank)
    cp_state = build_parallel_state(ParallelConfig.parse(f"cp{world}", world_size=world), rank)
    ep_state = build_parallel_state(ParallelConfig.parse(f"ep{world}", world_size=world), rank)
    flash = cpm._flash_supported(torch.empty(1, 1, 1, cfg.head_dim, device=dev, dtype=dtype),
                                 torch.empty(1, 1, 1, cfg.head_dim, device=dev, dtype=dtype))
    cp = cp_cases(rank, cfg, dev, dtype, cp_state)
    # the flash path runs only where supported AND its first-use check (cp_attention's) passed
    flash = flash and bool(cpm._CHECKED) and all(cpm._CHECKED.values())
    return {"rank": rank, "cp_flash_path": flash, "cp": cp,
            "dispatch": dispatcher_cases(rank, cfg, dev, dtype, ep_state)}


def combine_ranks(per_rank: list[dict]) -> dict:
    """Every *_ms figure as its slowest rank's, the rest from rank 0; speedups of the CP rows."""
    def merge(section):
        rows = {}
        for key, row0 in per_rank[0][section].items():
            row = dict(row0)
            for name in row0:
                if name.endswith("_ms"):
                    row[name] = max(r[section][key][name] for r in per_rank)
                    row[name + "_per_rank"] = [r[section][key][name] for r in per_rank]
            if "cp2_matches_cp1" in row:
                row["cp2_matches_cp1"] = all(r[section][key]["cp2_matches_cp1"] for r in per_rank)
                row["cp2_vs_cp1_rel_err"] = max(r[section][key]["cp2_vs_cp1_rel_err"] for r in per_rank)
                row["speedup_total"] = row["cp1_total_ms"] / row["cp2_total_ms"]
                row["speedup_core"] = row["cp1_core_ms"] / row["cp2_core_ms"]
            rows[str(key)] = row
        return rows
    return {"cp": merge("cp"), "dispatch": merge("dispatch"),
            "cp_flash_path": all(r["cp_flash_path"] for r in per_rank)}


def format_measured(report: dict) -> str:
    lines = [f"(a) CP1 (one GPU) vs CP2 (two GPUs), one attention layer fwd+bwd, ms per rank (slowest rank); "
             f"CP flash path: {report['cp_flash_path']}",
             f"{'seq':>6}{'cp1 core':>10}{'cp1 proj':>10}{'cp1 total':>11}{'cp2 core':>10}{'cp2 kv':>9}"
             f"{'cp2 proj':>10}{'cp2 total':>11}{'speedup':>9}{'core x':>8}  check vs CP1"]
    for s, r in report["cp"].items():
        lines.append(f"{s:>6}{r['cp1_core_ms']:>10.3f}{r['cp1_proj_ms']:>10.3f}{r['cp1_total_ms']:>11.3f}"
                     f"{r['cp2_core_ms']:>10.3f}{r['cp2_kv_ms']:>9.3f}{r['cp2_proj_ms']:>10.3f}"
                     f"{r['cp2_total_ms']:>11.3f}{r['speedup_total']:>8.2f}x{r['speedup_core']:>7.2f}x  "
                     f"{'ok' if r['cp2_matches_cp1'] else 'MISMATCH'} ({r['cp2_vs_cp1_rel_err']:.1e})")
    lines.append("    speedup = cp1 total / cp2 total (ideal 2x); core x = cp1 core / cp2 core; total = proj + kv + "
                 "core in one fwd+bwd")
    lines.append("(b) EP2 dispatch + combine fwd+bwd (experts = a copy), ms (slowest rank), MiB sent per rank")
    lines.append(f"{'tokens':>7}{'alltoall':>10}{'MiB':>8}{'allgather':>11}{'MiB':>8}{'ag/a2a':>8}")
    for n, r in report["dispatch"].items():
        lines.append(f"{n:>7}{r['alltoall_ms']:>10.3f}{r['alltoall_bytes_sent_per_rank'] / 2**20:>8.1f}"
                     f"{r['allgather_ms']:>11.3f}{r['allgather_bytes_sent_per_rank'] / 2**20:>8.1f}"
                     f"{r['allgather_ms'] / r['alltoall_ms']:>8.2f}")
    return "\n".join(lines)


# ---- the cost model's prediction -------------------------------------------------------------------------
def _hardware(profile: str):
    """A hardware profile JSON file (``foldtune calibrate``) or a catalog GPU name."""
    return load_profile(profile) if Path(profile).is_file() else get_hardware(profile)


def format_prediction(pred: dict, measured: dict | None) -> str:
    m = measured or {"cp": {}, "dispatch": {}}

    def pair(key, section, name):
        got = m[section].get(key, {}).get(name)
        want = pred[section][key][name]
        return f"{want:>9.3f}" + (f"{got:>9.3f}" if got is not None else f"{'-':>9}")

    lines = ["(a) CP, ms per rank fwd+bwd: model | measured" if measured else "(a) CP, ms per rank fwd+bwd (model)",
             f"{'seq':>6}" + "".join(f"{c:>18}" for c in ("cp1 core", "cp1 total", "cp2 core", "cp2 kv", "cp2 total"))
             + f"{'speedup':>18}"]
    for s in pred["cp"]:
        line = f"{s:>6}" + "".join(pair(s, "cp", n) for n in ("cp1_core_ms", "cp1_total_ms", "cp2_core_ms",
                                                              "cp2_kv_ms", "cp2_total_ms"))
        lines.append(line + pair(s, "cp", "speedup_total"))
    lines.append("(b) EP2 dispatch + combine with permutation, ms fwd+bwd: model | measured")
    lines.append(f"{'tokens':>7}{'alltoall':>18}{'allgather':>18}")
    for n in pred["dispatch"]:
        lines.append(f"{n:>7}" + pair(n, "dispatch", "alltoall_ms") + pair(n, "dispatch", "allgather_ms"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="smoke run on 2 gloo CPU ranks, tiny fp32 shapes")
    p.add_argument("--out", help="JSON file (default: $OUT/cp_dispatch.json or ./cp_dispatch.json)")
    p.add_argument("--seqs", type=int, nargs="+", help="CP sequence lengths (default 2048 4096 8192)")
    p.add_argument("--tokens", type=int, nargs="+", help="dispatcher tokens per rank (default 1024 4096 16384)")
    p.add_argument("--iters", type=int)
    p.add_argument("--timeout", type=float, default=540.0, help="seconds for the whole launched world")
    p.add_argument("--price", metavar="PROFILE", help="print the cost model's prediction instead: a hardware "
                   "profile JSON or a catalog GPU name (e.g. h100-sxm)")
    p.add_argument("--measured", help="with --price: a GPU run's JSON to print beside the prediction")
    args = p.parse_args(argv)
    cfg = BenchConfig.tiny() if args.cpu else BenchConfig()
    over = {k: tuple(v) if isinstance(v, list) else v
            for k, v in (("seqs", args.seqs), ("tokens", args.tokens), ("iters", args.iters)) if v is not None}
    cfg = dataclasses.replace(cfg, **over)

    if args.price:
        measured = json.loads(Path(args.measured).read_text()) if args.measured else None
        pred = predict_bench(_hardware(args.price), hidden=cfg.hidden, heads=cfg.heads, kv_heads=cfg.kv_heads,
                             head_dim=cfg.head_dim, seqs=cfg.seqs, experts=cfg.experts, topk=cfg.topk,
                             tokens=cfg.tokens, bytes_per_element=2 if cfg.dtype in ("bfloat16", "float16") else 4)
        print(f"cost model on {args.price}; shapes: hidden {cfg.hidden}, heads {cfg.heads}/{cfg.kv_heads}, "
              f"d {cfg.head_dim}, {cfg.dtype}; EP2 {cfg.experts} experts top-{cfg.topk}")
        if measured:
            print(f"measured: {args.measured} ({measured.get('device')}, {measured.get('date')}); each column: "
                  "model, then measured")
        print(format_prediction(pred, measured))
        return 0

    world = 2
    if not args.cpu and torch.cuda.device_count() < world:
        raise SystemExit("needs 2 CUDA GPUs (or --cpu for a smoke run)")
    device = f"{world}x {torch.cuda.get_device_name(0)}" if not args.cpu else f"{world} CPU ranks (gloo)"
    t0 = time.monotonic()
    launched = launch(worker, world, (cfg,), backend="gloo" if args.cpu else "nccl", timeout_s=args.timeout,
                      threads_per_rank=1)
    report = {"device": device, "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
              "command": " ".join(sys.argv), "config": dataclasses.asdict(cfg), "ok": launched.ok,
              "wall_seconds": round(time.monotonic() - t0, 1)}
    path = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "cp_dispatch.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not launched.ok:
        report["reason"] = launched.failure_reason
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"cp_dispatch failed: {launched.failure_reason}; wrote {path}")
        return 1
    report.update(combine_ranks(sorted(launched.results, key=lambda r: r["rank"])))
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{device}, torch {report['torch']}, {report['date']}, {report['wall_seconds']} s; "
          f"{cfg.dtype}, median of {cfg.reps} x {cfg.iters} back to back"
          + ("  [CPU SMOKE RUN: times mean nothing]" if args.cpu else ""))
    print(format_measured(report))
    print(f"wrote {path}")
    ok = all(r["cp2_matches_cp1"] for r in report["cp"].values())
    return 0 if ok else 2


if __name__ == "__main__":
    # run the package module's main, so the worker and config it launches pickle as bench.cp_dispatch_gpu.*
    from bench.cp_dispatch_gpu import main as package_main

    raise SystemExit(package_main())
