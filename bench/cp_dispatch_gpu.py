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

Timing: every op is warmed up, then per rank ``--iters`` calls back to back between two CUDA events after a
barrier (median of ``--reps`` such runs); the figure reported is the slowest rank's. CPU (``--cpu``: gloo,
tiny shapes, fp32) only smoke-tests the script; its times mean nothing.

``--price PROFILE`` (no GPU, no ranks) prints the cost model's prediction for exactly these cases from a
hardware profile JSON (``foldtune calibrate``'s output) or a catalog GPU name, from the named quantities of
``costmodel.context_parallel`` and ``costmodel.dispatch``; ``--measured FILE`` puts a GPU run's JSON beside it.

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
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from costmodel.comm import group_placement, link_rates
from costmodel.compute import compute_rates, gemm_fwd_bwd, memory_time
from costmodel.context_parallel import cp_attention_time, kv_exchange_bytes, kv_exchange_time
from costmodel.dispatch import (
    allgather_gather_bytes,
    allgather_scatter_bytes,
    alltoall_dispatch_bytes,
    dispatcher_pricing,
)
from executor.dispatcher import AllGatherDispatcher, AllToAllDispatcher
from executor.kernels import get_backend
from executor.launch_local import launch
from executor.parallel import context_parallel as cpm
from executor.parallel.groups import build_parallel_state
from executor.router import Routing, count_per_expert
from spec.catalog import get_hardware
from spec.parallel_config import ParallelConfig
from spec.profile_io import load_profile

# CP2 output against CP1 at the same positions: max |diff| / max |CP1|, bf16 rounding (fp32 on the CPU)
CP_CHECK_TOLERANCE = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-4}


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """Shapes and repetitions of one run (``tiny`` for the CPU smoke run)."""

    device: str = "cuda"
    dtype: str = "bfloat16"
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    seqs: tuple[int, ...] = (2048, 4096, 8192)
    experts: int = 8
    topk: int = 2
    tokens: tuple[int, ...] = (1024, 4096, 16384)
    warmup: int = 3
    iters: int = 10
    reps: int = 3
    seed: int = 0

    @classmethod
    def tiny(cls) -> BenchConfig:
        return cls(device="cpu", dtype="float32", hidden=64, heads=4, kv_heads=2, head_dim=16, seqs=(64, 128),
                   experts=8, topk=2, tokens=(32, 128), warmup=1, iters=2, reps=2)


# ---- timing ------------------------------------------------------------------------------------------------
def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed_ms(op, dev: torch.device, cfg: BenchConfig, collective: bool) -> float:
    """Median over ``cfg.reps`` of ms per ``op()`` in a loop of ``cfg.iters`` calls; a barrier before each
    run when ``collective`` (every rank must call it the same number of times)."""
    for _ in range(cfg.warmup):
        op()
    runs = []
    for _ in range(cfg.reps):
        _sync(dev)
        if collective:
            dist.barrier()
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(cfg.iters):
                op()
            end.record()
            torch.cuda.synchronize(dev)
            runs.append(start.elapsed_time(end) / cfg.iters)
        else:
            t0 = time.perf_counter()
            for _ in range(cfg.iters):
                op()
            runs.append(1e3 * (time.perf_counter() - t0) / cfg.iters)
    return statistics.median(runs)


def _fwd_bwd(fn, inputs: list[torch.Tensor], grad: torch.Tensor):
    """An op running ``fn(*inputs)`` forward and backward with ``grad`` (inputs' grads not accumulated)."""
    def op():
        out = fn(*inputs)
        torch.autograd.backward(out, grad)
        for t in inputs:
            t.grad = None
    return op


# ---- (a) CP ----------------------------------------------------------------------------------------------
def _bhsd(x_SBND: torch.Tensor) -> torch.Tensor:
    """[s, b, n, d] storage seen as [b, n, s, d] (a view)."""
    return x_SBND.permute(1, 2, 0, 3)


def _leaf(x: torch.Tensor) -> torch.Tensor:
    """A fresh autograd leaf with ``x``'s values and strides (clone keeps a dense tensor's layout)."""
    return x.detach().clone().requires_grad_()


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()


def cp_cases(rank: int, cfg: BenchConfig, dev: torch.device, dtype: torch.dtype, cp_state) -> dict:
    """CP1 (this GPU alone) and CP2 (both ranks) per seq: core, kv, proj, total (ms) and the check."""
    kernels = get_backend("torch")
    h, heads, kvh, d = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim
    group = cp_state["cp"]
    cp = group.size
    out = {}
    for s in cfg.seqs:
        gen = torch.Generator().manual_seed(cfg.seed + s)  # the same whole-sequence tensors on every rank
        # stored [s, b, heads, d] and seen as [b, heads, s, d], as the executor's attention has them
        stored = [torch.randn(s, 1, n, d, generator=gen).to(dev, dtype) for n in (heads, kvh, kvh, heads)]
        q, k, v, g = (_bhsd(t) for t in stored)
        pos = cpm.cp_positions(s, cp, group.rank, dev)
        mask = cpm.causal_mask(s, cp, group.rank, dev)

        def core_cp(q_, k_, v_):
            return cpm.cp_attention(q_, k_, v_, mask, cp, group.rank)

        def exchange(k_, v_):
            return cpm.gather_kv(k_, group), cpm.gather_kv(v_, group)

        # check: CP2's output at this rank's positions against CP1 over the whole sequence
        want = kernels.attention(q, k, v)[:, :, pos]
        ql, kl, vl, gl = (_bhsd(t[pos]) for t in stored)  # this rank's tokens, in the same storage order
        got = core_cp(ql, *exchange(kl, vl))
        err = _rel_err(got, want)

        row: dict = {"seq": s, "cp2_vs_cp1_rel_err": err, "cp2_matches_cp1": err <= CP_CHECK_TOLERANCE[cfg.dtype]}
        # projections: [t, h] @ [h, (heads + 2 kv) d] and [t, heads d] @ [heads d, h], fwd+bwd
        w_qkv = torch.randn(h, (heads + 2 * kvh) * d, generator=gen).to(dev, dtype).requires_grad_()
        w_o = torch.randn(heads * d, h, generator=gen).to(dev, dtype).requires_grad_()

        def proj(x, attn):
            return x @ w_qkv, attn @ w_o

        def proj_inputs(tokens):
            """Inputs [x, attn] and output gradients of the projections over ``tokens`` rows."""
            x, a = (torch.randn(tokens, n, generator=gen).to(dev, dtype).requires_grad_() for n in (h, heads * d))
            grads = tuple(torch.randn(tokens, n, generator=gen).to(dev, dtype) for n in ((heads + 2 * kvh) * d, h))
            return [x, a], grads

        (x1, a1), pg1 = proj_inputs(s)
        row["cp1_proj_ms"] = timed_ms(_fwd_bwd(proj, [x1, a1], pg1), dev, cfg, False)
        leaves = [_leaf(t) for t in (q, k, v)]
        row["cp1_core_ms"] = timed_ms(_fwd_bwd(kernels.attention, leaves, g), dev, cfg, False)

        def layer1(x_, a_, q_, k_, v_):
            return (*proj(x_, a_), kernels.attention(q_, k_, v_))

        row["cp1_total_ms"] = timed_ms(_fwd_bwd(layer1, [x1, a1, *leaves], (*pg1, g)), dev, cfg, False)

        ql, kl, vl = _leaf(ql), _leaf(kl), _leaf(vl)
        kg, vg = (_leaf(t) for t in exchange(kl, vl))
        row[f"cp{cp}_core_ms"] = timed_ms(_fwd_bwd(core_cp, [ql, kg, vg], gl), dev, cfg, True)
        kv_grads = (torch.randn_like(kg), torch.randn_like(vg))
        row[f"cp{cp}_kv_ms"] = timed_ms(_fwd_bwd(exchange, [kl, vl], kv_grads), dev, cfg, True)
        (xc, ac), pgc = proj_inputs(s // cp)
        row[f"cp{cp}_proj_ms"] = timed_ms(_fwd_bwd(proj, [xc, ac], pgc), dev, cfg, True)

        def layer_cp(x_, a_, q_, k_, v_):
            return (*proj(x_, a_), core_cp(q_, *exchange(k_, v_)))

        row[f"cp{cp}_total_ms"] = timed_ms(_fwd_bwd(layer_cp, [xc, ac, ql, kl, vl], (*pgc, gl)), dev, cfg, True)
        row["kv_bytes_sent_per_rank"] = 2 * (cp - 1) * kl.numel() * kl.element_size()  # K and V, fwd (bwd same)
        out[s] = row
        del stored, q, k, v, g, w_qkv, w_o
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


# ---- (b) dispatchers -------------------------------------------------------------------------------------
def dispatcher_cases(rank: int, cfg: BenchConfig, dev: torch.device, dtype: torch.dtype, ep_state) -> dict:
    """Per token count: dispatch + combine fwd+bwd (ms) of each dispatcher, and the rows it moved."""
    e, k, h = cfg.experts, cfg.topk, cfg.hidden
    ep = ep_state.ep.size
    out = {}
    for n in cfg.tokens:
        gen = torch.Generator().manual_seed(cfg.seed * 1000 + 7 * n + rank)  # each rank its own tokens
        x = torch.randn(n, h, generator=gen).to(dev, dtype).requires_grad_()
        gy = torch.randn(n, h, generator=gen).to(dev, dtype)
        experts = torch.rand(n, e, generator=gen).argsort(dim=1)[:, :k].to(dev)  # k distinct, uniform
        probs = torch.rand(n, k, generator=gen).softmax(-1).to(dev, torch.float32).requires_grad_()
        routing = Routing(experts, probs, torch.zeros((), device=dev), count_per_expert(experts, e))
        local = experts // (e // ep)
        row = {"tokens": n, "copies_to_peer": int((local != ep_state.ep.rank).sum())}
        for cls in (AllToAllDispatcher, AllGatherDispatcher):
            dispatcher = cls(ep_state, e, k)

            def op(dispatcher=dispatcher):
                d = dispatcher.dispatch(x, routing)
                y = d.x_MH * 1.0  # the experts' stand-in: a copy, so the gradient flows back through combine
                dispatcher.combine(y, d).backward(gy)
                x.grad = probs.grad = None

            row[f"{cls.name}_ms"] = timed_ms(op, dev, cfg, True)
        ab = x.element_size()
        row["alltoall_bytes_sent_per_rank"] = 4 * row["copies_to_peer"] * h * ab  # dispatch, combine; fwd, bwd
        # allgather fwd: tokens, fp32 probs and int64 ids all-gathered, token rows reduce-scattered back;
        # bwd: the gradients of tokens and probs reduce-scattered, of the combined rows all-gathered
        row["allgather_bytes_sent_per_rank"] = (ep - 1) * n * (4 * h * ab + k * (4 + 8) + k * 4)
        out[n] = row
        del x, gy
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


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


class _Block:
    """Collects what a dispatcher pricing adds (step_time's per-layer block, summed over slots)."""

    def __init__(self):
        self.fwd = self.bwd = 0.0

    def add(self, term, fwd, bwd, module=()):
        self.fwd += fwd
        self.bwd += bwd


@dataclasses.dataclass
class _RoutedShape:
    """The layer shape a dispatcher pricing reads (costmodel.dispatch.RoutedShape) for the bench's EP2 case."""

    model: object
    link: object
    rates: object
    act_bytes: int
    place: object
    etp: int = 1
    imbalance: float = 1.0

    def __post_init__(self):
        self.ep_place = self.tp_ep_place = self.place
        self.etp_place = group_placement(1, 1, 8)

    def elementwise(self, block, fwd_bytes, module=(), bwd_bytes=None, term=None):
        block.add(term, memory_time(self.rates, fwd_bytes), memory_time(self.rates, fwd_bytes
                                                                         if bwd_bytes is None else bwd_bytes))


def predict(hardware, cfg: BenchConfig, world: int = 2) -> dict:
    """The cost model's milliseconds for each case of :func:`cp_cases` and :func:`dispatcher_cases`: CP from
    ``costmodel.context_parallel`` (chunk kernels at their own key lengths, the exposed K/V all-gather and
    reduce-scatter) and the projections' GEMMs; dispatchers from their registered pricing's
    ``routed_time`` (communication and the dispatcher's own memory passes; the permutation, priced
    elsewhere and the same for both, is not in it)."""
    rates, link = compute_rates(hardware, "bf16"), link_rates(hardware)
    ab = 2 if cfg.dtype in ("bfloat16", "float16") else 4
    h, heads, kvh, d = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim
    place = group_placement(1, world, hardware.gpus_per_node)
    out = {"cp": {}, "dispatch": {}}
    for s in cfg.seqs:
        row = {}
        for cp in (1, world):
            t = s // cp
            core = sum(cp_attention_time(rates, 1, s, cp, heads, d, d))
            proj = sum(gemm_fwd_bwd(rates, t, (heads + 2 * kvh) * d, h)) + sum(gemm_fwd_bwd(rates, t, h, heads * d))
            cp_place = group_placement(1, cp, hardware.gpus_per_node)
            kv = sum(kv_exchange_time(link, kv_exchange_bytes(t, kvh, 2 * d, ab), cp_place))
            row.update({f"cp{cp}_core_ms": 1e3 * core, f"cp{cp}_proj_ms": 1e3 * proj,
                        f"cp{cp}_total_ms": 1e3 * (core + proj + kv)})
            if cp > 1:
                row[f"cp{cp}_kv_ms"] = 1e3 * kv
        row["speedup_total"] = row["cp1_total_ms"] / row[f"cp{world}_total_ms"]
        row["speedup_core"] = row["cp1_core_ms"] / row[f"cp{world}_core_ms"]
        out["cp"][str(s)] = row
    model = argparse.Namespace(hidden_size=h, moe_router_topk=cfg.topk, num_experts=cfg.experts)
    shape = _RoutedShape(model, link, rates, ab, place)
    for n in cfg.tokens:
        row = {"alltoall_bytes": alltoall_dispatch_bytes(n, cfg.topk, h, ab),
               "allgather_gather_bytes": allgather_gather_bytes(n, cfg.topk, h, ab, world),
               "allgather_scatter_bytes": allgather_scatter_bytes(n, h, ab, world)}
        for name in ("alltoall", "allgather"):
            block = _Block()
            dispatcher_pricing(name).routed_time(shape, block, n, n * cfg.topk, cfg.experts // world)
            row[f"{name}_ms"] = 1e3 * (block.fwd + block.bwd)
        out["dispatch"][str(n)] = row
    return out


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
    lines.append("(b) EP2 dispatcher communication, ms fwd+bwd: model | measured (measured includes permutation)")
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
        pred = predict(_hardware(args.price), cfg)
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
