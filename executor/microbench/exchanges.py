"""The executor's own CP and dispatcher exchanges, timed on two or more ranks (fwd+bwd, per rank).

* :func:`cp_cases`: per sequence length, the CP attention of a layer as ``executor.parallel.context_parallel``
  runs it: ``core`` (``cp_attention`` of this rank's s/cp queries against the gathered K/V, the flash path
  where supported: one causal flash call per local chunk), ``kv`` (``gather_kv`` of K and of V: forward
  all-gather, backward reduce-scatter), and with ``full`` also CP1 alone on this device, the projections and
  the layer's total (``bench/cp_dispatch_gpu.py``). Before timing, the CP output is checked against CP1.
* :func:`dispatcher_cases`: per token count, ``dispatch`` + ``combine`` fwd+bwd of every registered
  dispatcher of ``executor/dispatcher.py`` (uniform random routing, the experts replaced by a copy:
  communication and permutation only).
* :func:`measure_exchanges`: what ``foldtune calibrate`` runs on two or more ranks: one small shape of each
  (CP2 groups and EP2 groups of consecutive ranks, all at once), in seconds, for the per-call costs the
  cost model adds (``costmodel/calibrate/exchange_prices.py``).

Timing: every op is warmed up, then ``iters`` calls back to back between two CUDA events after a barrier
(wall clock on the CPU), the median of ``reps`` such runs. On the CPU (gloo, fp32, tiny shapes) the numbers
price CPU ranks only.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.distributed as dist

from executor.dispatcher import DISPATCHER_CLASSES
from executor.kernels import get_backend
from executor.parallel import context_parallel as cpm
from executor.parallel.groups import build_parallel_state
from executor.router import Routing, count_per_expert
from spec.parallel_config import ParallelConfig

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


def cp_cases(rank: int, cfg: BenchConfig, dev: torch.device, dtype: torch.dtype, cp_state, full: bool = True) -> dict:
    """Per seq: CP core and kv (ms) over ``cp_state``'s CP group and the check against CP1; with ``full`` also
    CP1 (this device alone) core, proj and total, and CP proj and total."""
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
        ql, kl, vl = _leaf(ql), _leaf(kl), _leaf(vl)
        kg, vg = (_leaf(t) for t in exchange(kl, vl))
        row[f"cp{cp}_core_ms"] = timed_ms(_fwd_bwd(core_cp, [ql, kg, vg], gl), dev, cfg, True)
        kv_grads = (torch.randn_like(kg), torch.randn_like(vg))
        row[f"cp{cp}_kv_ms"] = timed_ms(_fwd_bwd(exchange, [kl, vl], kv_grads), dev, cfg, True)
        row["kv_bytes_sent_per_rank"] = 2 * (cp - 1) * kl.numel() * kl.element_size()  # K and V, fwd (bwd same)
        out[s] = row
        if full:
            _cp_full(row, cfg, dev, dtype, gen, (q, k, v, g), (ql, kl, vl, gl), core_cp, exchange, cp, kernels)
        del stored, q, k, v, g
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _cp_full(row: dict, cfg: BenchConfig, dev: torch.device, dtype: torch.dtype, gen, whole, mine, core_cp,
             exchange, cp: int, kernels) -> None:
    """The bench's extra columns of one seq: CP1 core, proj, total; CP proj and total (ms)."""
    h, heads, kvh, d, s = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, row["seq"]
    q, k, v, g = whole
    ql, kl, vl, gl = mine
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

    (xc, ac), pgc = proj_inputs(s // cp)
    row[f"cp{cp}_proj_ms"] = timed_ms(_fwd_bwd(proj, [xc, ac], pgc), dev, cfg, True)

    def layer_cp(x_, a_, q_, k_, v_):
        return (*proj(x_, a_), core_cp(q_, *exchange(k_, v_)))

    row[f"cp{cp}_total_ms"] = timed_ms(_fwd_bwd(layer_cp, [xc, ac, ql, kl, vl], (*pgc, gl)), dev, cfg, True)


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
        for cls in DISPATCHER_CLASSES.values():
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




# ---- what calibration runs ---------------------------------------------------------------------------------
CALIBRATION_SEQ = 2048  # the smallest CP case of bench/cp_dispatch_gpu.py: per-call costs dominate there
CALIBRATION_TOKENS = 1024  # the smallest dispatcher case, likewise


def calibration_config(device: torch.device) -> BenchConfig:
    """One small shape of each exchange: Mixtral-like (hidden 4096, 32/8 heads of 128, 8 experts top-2, bf16)
    at seq 2048 and 1024 tokens per rank on GPUs; the tiny fp32 shapes on the CPU."""
    if device.type == "cuda":
        return BenchConfig(seqs=(CALIBRATION_SEQ,), tokens=(CALIBRATION_TOKENS,))
    tiny = BenchConfig.tiny()
    return dataclasses.replace(tiny, seqs=tiny.seqs[:1], tokens=tiny.tokens[:1])


def measure_exchanges(rank: int, world_size: int, device: torch.device) -> dict | None:
    """This rank's per-call seconds (fwd+bwd) of the executor's CP exchange, CP chunked attention and each
    dispatcher at :func:`calibration_config`'s shape, over CP2 and EP2 groups of consecutive ranks (every
    group at once); None on an odd or single-rank world. Every rank must call it; take the max over ranks.

    ``{'cp': {seq, cp, heads, kv_heads, head_dim, act_bytes, core_s, kv_s, matches},
    'dispatch': {tokens, ep, experts, topk, hidden, act_bytes, seconds: {dispatcher: s}}}``
    """
    if world_size < 2 or world_size % 2:
        return None
    cfg = calibration_config(device)
    dtype = getattr(torch, cfg.dtype)
    act_bytes = torch.tensor([], dtype=dtype).element_size()
    cp_state = build_parallel_state(ParallelConfig.parse("cp2", world_size=world_size), rank)
    ep_state = build_parallel_state(ParallelConfig.parse("ep2", world_size=world_size), rank)
    row = cp_cases(rank, cfg, device, dtype, cp_state, full=False)[cfg.seqs[0]]
    disp = dispatcher_cases(rank, cfg, device, dtype, ep_state)[cfg.tokens[0]]
    dist.barrier()
    return {"cp": {"seq": cfg.seqs[0], "cp": 2, "heads": cfg.heads, "kv_heads": cfg.kv_heads,
                   "head_dim": cfg.head_dim, "act_bytes": act_bytes, "core_s": row["cp2_core_ms"] / 1e3,
                   "kv_s": row["cp2_kv_ms"] / 1e3, "matches": row["cp2_matches_cp1"]},
            "dispatch": {"tokens": cfg.tokens[0], "ep": 2, "experts": cfg.experts, "topk": cfg.topk,
                         "hidden": cfg.hidden, "act_bytes": act_bytes,
                         "seconds": {name: disp[f"{name}_ms"] / 1e3 for name in DISPATCHER_CLASSES}}}


def merge_exchanges(records: list[dict | None]) -> dict | None:
    """One record from every rank's: each time the slowest rank's (a collective ends with its last member)."""
    records = [r for r in records if r]
    if not records:
        return None
    out = {"cp": dict(records[0]["cp"]), "dispatch": dict(records[0]["dispatch"])}
    for key in ("core_s", "kv_s"):
        out["cp"][key] = max(r["cp"][key] for r in records)
    out["cp"]["matches"] = all(r["cp"]["matches"] for r in records)
    out["dispatch"]["seconds"] = {name: max(r["dispatch"]["seconds"][name] for r in records)
                                  for name in records[0]["dispatch"]["seconds"]}
    return out
