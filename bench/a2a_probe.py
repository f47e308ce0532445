"""Why the executor's EP all-to-all is slower than the collective microbenchmark: one case per hypothesis.

The executor's ``ep_alltoall`` phase (executor/dispatcher.py, ``AllToAllDispatcher``) is a tiny counts
all-to-all, a ``.tolist()`` host sync, an uneven ``all_to_all_single`` (executor/parallel/collectives.py)
and, in backward, the transposed uneven all-to-all; the calibration microbenchmark
(executor/microbench/collectives.py) times one equal-split ``all_to_all_single``. Hypotheses:
(a) uneven splits are slow on NCCL, (b) the phase is really the wait for the slowest rank (routing gives
ranks unequal expert work), (c) the host sync and launch pattern, (d) contention with NCCL work on other
communicators (the overlapped gradient reduce-scatter). Cases, each timed per rank after warm-up with CUDA
events (host clocks on CPU); "barrier" = ``dist.barrier()`` + device sync before each timed call, so no
straggler wait is included:

  A   equal-split ``dist.all_to_all_single(y, x)`` (the microbenchmark's call), barrier       -> baseline
  A2  the same equal splits passed as split lists through collectives.all_to_all, barrier     -> split-list path
  B   uneven splits (rank 0 receives ``1+skew`` of the mean, the others less) via
      collectives.all_to_all, barrier                                                          -> (a)
  C   B preceded by the dispatcher's counts all-to-all and ``.tolist()``, barrier              -> (c)
  D   the dispatcher's dispatch + combine, fwd+bwd, real Router (random init, random tokens),
      experts replaced by a copy (isolates communication), barrier; ms is the ``ep_alltoall``
      phase of the executor's PhaseTimer per big call (4 per fwd+bwd)                       -> (c) in place
  E   D without the barrier (natural timing, straggler included)                               -> (b), no experts
  F   B while a reduce-scatter of ``--concurrent-mib`` runs on the dp_cp communicator (the
      gradient reduction's), barrier                                                           -> (d)
  G   the MoE layer with real grouped experts under EP (each rank its E/ep experts), fwd+bwd,
      no barrier, as in a training step; ``ep_alltoall`` phase per call                        -> (b)
  G_balanced  G with forced round-robin routing (equal expert work on every rank)             -> (b)

Received rows per call are recorded on every rank (max/min across ranks shows the imbalance); B's
received chunks are checked by content (each row carries its source rank), so a run that did not honour
the uneven split says so (``verified``).

    python -m bench.a2a_probe --world 2 --out $OUT/a2a_probe_ep2.json          # NCCL, one process per GPU
    python -m bench.a2a_probe --device cpu --world 2 --tiny                     # gloo smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from executor.dispatcher import AllToAllDispatcher
from executor.kernels import get_backend
from executor.launch_local import launch
from executor.microbench.timing import synchronize, time_device
from executor.moe import MoELayer
from executor.options import ExecutorOptions
from executor.parallel.collectives import all_to_all
from executor.parallel.groups import build_parallel_state
from executor.router import Router
from executor.timing import PhaseTimer
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig

CASES = ("A", "A2", "B", "C", "D", "E", "F", "G", "G_balanced")
DESCRIPTIONS = {
    "A": "equal-split all_to_all_single, no split lists (the microbenchmark's call); barrier",
    "A2": "equal splits as split lists through collectives.all_to_all; barrier",
    "B": "uneven splits through collectives.all_to_all; barrier",
    "C": "counts all_to_all + .tolist() + B; barrier",
    "D": "dispatcher dispatch+combine fwd+bwd, real router, copy as experts; barrier; ep_alltoall phase per call",
    "E": "D without the barrier (straggler wait included)",
    "F": "B with a concurrent reduce-scatter on the dp_cp communicator; barrier",
    "G": "MoE layer with real experts under EP, fwd+bwd, no barrier; ep_alltoall phase per call",
    "G_balanced": "G with forced round-robin routing; ep_alltoall phase per call",
}
BIG_CALLS_PER_STEP = 4  # dispatch and combine, forward and backward


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    """Shapes and repetitions; rows per rank = tokens · topk, each ``hidden`` elements of ``dtype``."""

    device: str = "cuda"
    tokens: int = 4096
    topk: int = 2
    hidden: int = 4096
    experts: int = 8
    ffn: int = 14336  # G's expert FFN width
    dtype: str = "bfloat16"
    skew: float = 0.10
    concurrent_mib: float = 256.0  # F's reduce-scatter input per rank
    warmup: int = 3
    iters: int = 10
    seed: int = 0
    layer: bool = True  # run G and G_balanced (real experts: E/ep · 3 · hidden · ffn weights per rank)

    @classmethod
    def tiny(cls, **over) -> ProbeConfig:
        """CPU smoke shapes (fp32, gloo)."""
        base = dict(device="cpu", tokens=64, topk=2, hidden=32, experts=8, ffn=32, dtype="float32",
                    concurrent_mib=0.25, warmup=1, iters=3)
        base.update(over)
        return cls(**base)


def split_matrix(world: int, rows: int, skew: float) -> list[list[int]]:
    """S[r][p]: rows rank r sends to rank p. Every rank sends ``(1+skew)`` of the mean share to rank 0 and
    the rest evenly to the others, so each rank sends ``rows`` in all and rank 0 receives more (the
    pattern of a hot expert on one rank)."""
    base = rows / world
    to_zero = round(base * (1 + skew))
    rest = rows - to_zero
    others = [rest // (world - 1) + (1 if i < rest % (world - 1) else 0) for i in range(world - 1)]
    return [[to_zero, *others] for _ in range(world)]


def _timed(op, dev, cfg: ProbeConfig, barrier: bool, after=None) -> list[float]:
    """Seconds of each of ``cfg.iters`` calls of ``op`` after ``cfg.warmup`` calls; with ``barrier`` every
    rank passes a barrier and a device sync before each call. ``after(i)`` runs after each timed call,
    outside the timing (it may sync)."""
    for _ in range(cfg.warmup):
        op()
        if after:
            after(-1)
    synchronize(dev)
    dist.barrier()
    times = []
    for i in range(cfg.iters):
        if barrier:
            dist.barrier()
            synchronize(dev)
        times.append(time_device(op, dev, warmup=0, repeats=1))  # one call: CUDA events, host clock on CPU
        if after:
            after(i)
    synchronize(dev)
    return times


def _summary(times: list[float], cross_bytes: int, recv_rows: int, **extra) -> dict:
    return {"seconds": statistics.median(times), "all_seconds": times, "cross_bytes": cross_bytes,
            "recv_rows": recv_rows, **extra}


def _collective_cases(rank: int, world: int, cfg: ProbeConfig, state, dev, dtype) -> dict:
    """A, A2, B, C, F: the collectives alone on [rows, hidden] buffers."""
    ep = state.ep
    rows = cfg.tokens * cfg.topk
    elem = torch.tensor([], dtype=dtype).element_size()
    row_bytes = cfg.hidden * elem
    out: dict = {}

    # A / A2: equal splits (rows divisible by the group)
    n_eq = rows // world * world
    x = torch.randn(n_eq, cfg.hidden, device=dev, dtype=dtype)
    y = torch.empty_like(x)
    eq = [n_eq // world] * world
    cross_eq = (n_eq - n_eq // world) * row_bytes
    out["A"] = _summary(_timed(lambda: dist.all_to_all_single(y, x, group=ep.pg), dev, cfg, True), cross_eq, n_eq)
    out["A2"] = _summary(_timed(lambda: all_to_all(x, eq, eq, ep), dev, cfg, True), cross_eq, n_eq)

    # B: uneven splits; every row carries (source rank · world + destination rank) so the receiver can
    # check which rows came from whom (small integers: exact in bf16)
    matrix = split_matrix(world, rows, cfg.skew)
    send = matrix[rank]
    recv = [matrix[p][rank] for p in range(world)]
    xb = torch.cat([torch.full((send[p], cfg.hidden), float(rank * world + p), device=dev, dtype=dtype)
                    for p in range(world)])
    cross_b = (sum(send) - send[rank]) * row_bytes
    got = {}

    def check(_):
        if "rows_from" not in got:  # once, after the first call: a content check syncs
            chunks = torch.split(out_b[0], recv)
            got["rows_from"] = [int((c[:, 0] == float(p * world + rank)).sum()) for p, c in enumerate(chunks)]
            got["rows_from_anywhere"] = [int((out_b[0][:, 0] == float(p * world + rank)).sum()) for p in range(world)]

    out_b = [None]

    def op_b():
        out_b[0] = all_to_all(xb, recv, send, ep)

    times = _timed(op_b, dev, cfg, True, check)
    out["B"] = _summary(times, cross_b, int(sum(recv)), send_splits=send, recv_splits=recv, matrix=matrix, **got,
                        verified=got["rows_from"] == recv and got["rows_from_anywhere"] == recv)

    # C: the dispatcher's split-size exchange first (counts per local expert, one device-to-host copy)
    e_local = cfg.experts // world
    counts_PE = torch.tensor([[s // e_local + (1 if j < s % e_local else 0) for j in range(e_local)] for s in send],
                             device=dev, dtype=torch.long)
    sizes_seen = {}

    def op_c():
        recv_PE = all_to_all(counts_PE, [1] * world, [1] * world, ep)
        sizes = torch.cat([counts_PE.sum(1), recv_PE.sum(1)]).tolist()
        sizes_seen["send"], sizes_seen["recv"] = sizes[:world], sizes[world:]
        all_to_all(xb, sizes[world:], sizes[:world], ep)

    times = _timed(op_c, dev, cfg, True)
    out["C"] = _summary(times, cross_b, int(sum(recv)), sizes_match=sizes_seen == {"send": send, "recv": recv})

    # F: B while the dense-gradient communicator (dp_cp) reduce-scatters a fp32 buffer
    rs_group = state["dp_cp"]
    rs_elems = max(world, int(cfg.concurrent_mib * 2**20 / 4) // world * world)
    rs_in = torch.ones(rs_elems, device=dev, dtype=torch.float32)
    rs_out = torch.empty(rs_elems // world, device=dev, dtype=torch.float32)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    pending = []

    def op_f():
        if rs_group.pg is not None:
            pending.append(reduce_scatter(rs_out, rs_in, group=rs_group.pg, async_op=True))
        op_b()

    def finish(_):
        while pending:
            pending.pop().wait()
        synchronize(dev)

    out["F"] = _summary(_timed(op_f, dev, cfg, True, finish), cross_b, int(sum(recv)),
                        concurrent_group=rs_group.name, concurrent_group_size=rs_group.size,
                        concurrent_bytes=rs_elems * 4)
    return out


def _dispatch_cases(rank: int, world: int, cfg: ProbeConfig, state, spec, dev, dtype) -> dict:
    """D, E: the dispatcher around a copy standing in for the experts, real router."""
    timer = PhaseTimer(enabled=True, device=dev)
    router = Router(spec, ExecutorOptions(seed=cfg.seed), state, 0, dev, dtype)
    dispatcher = AllToAllDispatcher(state, spec.num_experts, spec.moe_router_topk, timer)
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank + 1)  # each rank its own tokens
    x = torch.randn(cfg.tokens, cfg.hidden, generator=gen).to(dev, dtype).requires_grad_()
    gy = torch.randn(cfg.tokens, cfg.hidden, generator=gen).to(dev, dtype)
    seen: dict = {}

    def op():
        timer.start_step()
        x.grad = None
        routing = router(x)
        d = dispatcher.dispatch(x, routing)
        y = d.x_MH * 1.0  # the experts' stand-in: a copy, so the gradient flows back through combine
        dispatcher.combine(y, d).backward(gy)
        seen["send"], seen["recv"] = d.ctx["send"], d.ctx["recv"]

    return {name: _phase_case(op, timer, seen, dev, cfg, barrier, rank, dtype)
            for name, barrier in (("D", True), ("E", False))}


def _phase_case(op, timer, seen: dict, dev, cfg: ProbeConfig, barrier: bool, rank: int, dtype) -> dict:
    """Time ``op`` (one fwd+bwd with an enabled PhaseTimer) and its ``ep_alltoall`` phase per big call."""
    phases: list[dict] = []

    def collect(i):
        got = timer.end_step()  # syncs the device
        if i >= 0:
            phases.append(got)

    times = _timed(op, dev, cfg, barrier, collect)
    row_bytes = cfg.hidden * torch.tensor([], dtype=dtype).element_size()
    send, recv = seen["send"], seen["recv"]
    # bytes leaving this rank per big call, averaged over the four (two each way)
    cross = (sum(send) - send[rank] + sum(recv) - recv[rank]) * row_bytes // 2
    per_call = [p.get("ep_alltoall", 0.0) / BIG_CALLS_PER_STEP for p in phases]
    return _summary(per_call, cross, int(sum(recv)), step_seconds=statistics.median(times),
                    all_step_seconds=times, ep_alltoall_step_seconds=statistics.median(per_call) * BIG_CALLS_PER_STEP,
                    phases_median={k: statistics.median(p.get(k, 0.0) for p in phases) for k in phases[0]},
                    send_splits=send, recv_splits=recv)


def _layer_cases(rank: int, world: int, cfg: ProbeConfig, state, spec, dev, dtype) -> dict:
    """G, G_balanced: the MoE layer with its real grouped experts under EP, as in a training step."""
    out = {}
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank + 1)
    x = torch.randn(cfg.tokens, 1, cfg.hidden, generator=gen).to(dev, dtype).requires_grad_()
    gy = torch.randn(cfg.tokens, 1, cfg.hidden, generator=gen).to(dev, dtype)
    for name, balanced in (("G", False), ("G_balanced", True)):
        timer = PhaseTimer(enabled=True, device=dev)
        options = ExecutorOptions(seed=cfg.seed, moe_router_force_load_balancing=balanced)
        layer = MoELayer(spec, options, state, 0, get_backend(options.kernel_backend), dev, dtype, timer)
        seen: dict = {}
        orig_combine = layer.dispatcher.combine

        def combine(y, d, orig=orig_combine, seen=seen):
            seen["send"], seen["recv"] = d.ctx["send"], d.ctx["recv"]
            return orig(y, d)

        layer.dispatcher.combine = combine

        def op(layer=layer, timer=timer):
            timer.start_step()
            layer.zero_grad(set_to_none=True)
            x.grad = None
            y, _ = layer(x)
            y.backward(gy)

        out[name] = _phase_case(op, timer, seen, dev, cfg, False, rank, dtype)
        del layer
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def worker(rank: int, world: int, cfg: ProbeConfig) -> dict:
    """Every case on this rank (launched by executor.launch_local.launch, one process per rank)."""
    dev = torch.device("cuda", rank) if cfg.device == "cuda" else torch.device("cpu")
    dtype = getattr(torch, cfg.dtype)
    state = build_parallel_state(ParallelConfig.parse(f"ep{world}", world_size=world), rank)
    spec = ModelSpec(name="a2a-probe", num_layers=1, hidden_size=cfg.hidden, num_attention_heads=16,
                     ffn_hidden_size=cfg.ffn, vocab_size=32000, num_experts=cfg.experts, moe_router_topk=cfg.topk,
                     moe_ffn_hidden_size=cfg.ffn)
    torch.manual_seed(cfg.seed + rank)
    cases = _collective_cases(rank, world, cfg, state, dev, dtype)
    cases.update(_dispatch_cases(rank, world, cfg, state, spec, dev, dtype))
    if cfg.layer:
        cases.update(_layer_cases(rank, world, cfg, state, spec, dev, dtype))
    return {"rank": rank, "cases": cases}


def combine_ranks(per_rank: list[dict]) -> dict:
    """Per case: every rank's figures, the slowest rank's seconds, GB/s per rank, received rows max/min."""
    out = {}
    for name in (n for n in CASES if n in per_rank[0]["cases"]):
        ranks = [r["cases"][name] for r in per_rank]
        recv = [c["recv_rows"] for c in ranks]
        gbps = [c["cross_bytes"] / c["seconds"] / 1e9 if c["seconds"] > 0 else None for c in ranks]
        out[name] = {"description": DESCRIPTIONS[name], "seconds_max": max(c["seconds"] for c in ranks),
                     "cross_mib_mean": statistics.mean(c["cross_bytes"] for c in ranks) / 2**20,
                     "gb_per_s_per_rank_min": min(g for g in gbps if g is not None) if any(gbps) else None,
                     "recv_rows_max": max(recv), "recv_rows_min": min(recv), "per_rank": ranks}
    return out


def format_table(cases: dict) -> str:
    lines = [f"{'case':<11}{'MiB sent cross-rank':>20}{'ms':>9}{'GB/s/rank':>11}{'recv rows max/min':>19}  note"]
    for name, c in cases.items():
        note = ""
        if "step_seconds" in c["per_rank"][0]:
            note = f"fwd+bwd {max(r['step_seconds'] for r in c['per_rank']) * 1e3:.2f} ms; ms per big call"
        if name == "B":
            note = "splits verified" if all(r["verified"] for r in c["per_rank"]) else "SPLITS NOT HONOURED"
        gbps = c["gb_per_s_per_rank_min"]
        lines.append(f"{name:<11}{c['cross_mib_mean']:>20.3f}{c['seconds_max'] * 1e3:>9.3f}"
                     f"{'-' if gbps is None else f'{gbps:.2f}':>11}"
                     f"{c['recv_rows_max']:>10}/{c['recv_rows_min']:<8}  {note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--world", type=int, help="ranks (default: every GPU; 2 on CPU)")
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 shapes (CPU smoke runs)")
    parser.add_argument("--tokens", type=int, help="tokens per rank (default 4096)")
    parser.add_argument("--topk", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--experts", type=int)
    parser.add_argument("--ffn", type=int)
    parser.add_argument("--skew", type=float)
    parser.add_argument("--concurrent-mib", type=float)
    parser.add_argument("--iters", type=int)
    parser.add_argument("--no-layer", action="store_true", help="skip G and G_balanced (real experts)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole launched world")
    parser.add_argument("--out", help="JSON file (default: $OUT/a2a_probe.json or ./a2a_probe.json)")
    args = parser.parse_args(argv)

    over = {k: v for k, v in (("tokens", args.tokens), ("topk", args.topk), ("hidden", args.hidden),
                              ("experts", args.experts), ("ffn", args.ffn), ("skew", args.skew),
                              ("concurrent_mib", args.concurrent_mib), ("iters", args.iters)) if v is not None}
    if args.no_layer:
        over["layer"] = False
    cfg = ProbeConfig.tiny(device=args.device, **over) if args.tiny else ProbeConfig(device=args.device, **over)
    if args.device == "cpu" and cfg.dtype == "bfloat16":
        cfg = dataclasses.replace(cfg, dtype="float32")  # gloo: fp32
    world = args.world or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if world < 2 or cfg.experts % world:
        raise SystemExit(f"--world {world}: needs >= 2 ranks dividing the {cfg.experts} experts")
    device_name = (f"{world}x {torch.cuda.get_device_name(0)}" if args.device == "cuda"
                   else f"{world} CPU ranks (gloo)")
    launched = launch(worker, world, (cfg,), backend="nccl" if args.device == "cuda" else "gloo",
                      timeout_s=args.timeout, threads_per_rank=1)
    report = {"device": device_name, "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
              "command": " ".join(sys.argv), "world": world, "config": dataclasses.asdict(cfg),
              "ok": launched.ok}
    path = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "a2a_probe.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not launched.ok:
        report["reason"] = launched.failure_reason
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"a2a probe failed: {launched.failure_reason}; wrote {path}")
        return 1
    report["cases"] = combine_ranks(sorted(launched.results, key=lambda r: r["rank"]))
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{device_name}, {cfg.tokens} tokens x top-{cfg.topk} rows of {cfg.hidden} {cfg.dtype} per rank, "
          f"skew {cfg.skew}, median of {cfg.iters}; ms = slowest rank")
    print(format_table(report["cases"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    # run the package module's main, so the worker and config it launches pickle as bench.a2a_probe.*,
    # which the spawned ranks can import (this file's own names would pickle as __main__.*)
    from bench.a2a_probe import main as package_main

    raise SystemExit(package_main())
