"""The CP communication types on GPUs: each type's attention core and exchange, measured, beside the cost model.

On ``--world`` ranks (one per GPU, NCCL; 2 by default, 4 or 8 when lent) every CP type the world allows runs the
executor's own code (``executor.parallel.cp_exchange``: allgather, p2p, a2a, and a2a+p2p with a2a over pairs when
the world is 4 or more) on one attention layer's core of a Mixtral-shaped model (32 query heads, 8 KV heads,
head dim 128, bf16, micro-batch 1), queries, keys and values already projected (RoPE and projections left out:
they do not depend on the type). Per type and sequence length, fwd+bwd ms of the slowest rank:

- ``exchange+core``: the whole CP attention (before, core, after) as one fwd+bwd, back to back;
- ``model``: the cost model's price of the same (``costmodel.context_parallel``: the type's core plus its exposed
  exchange, on ``--price`` PROFILE, default the catalog's entry for the GPU if it has one, else h200).

Before timing, each type's output at every rank's positions is checked against causal attention over the whole
sequence on that GPU (seqs up to ``--check-max``). ``--cp1`` adds the single-GPU core at each sequence for scale.
``--cpu`` smoke-tests on gloo with tiny fp32 shapes (its times mean nothing).

    python -m bench.cp_comm_gpu --world 2 --seqs 8192 32768 131072          # 2 GPUs, a few minutes
    python -m bench.cp_comm_gpu --world 4 --seqs 32768 131072 --price h200
    python -m bench.cp_comm_gpu --cpu --world 4                              # smoke run, seconds
    python -m bench.cp_comm_gpu --world 1 --cp1 --seqs 32768 131072 --kv-heads 4   # one GPU: the core alone
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.report import machine, replace_section, save_json, utc_now
from costmodel.comm import GroupPlacements, all_to_all_time, group_placement, link_rates
from costmodel.compute import compute_rates
from costmodel.context_parallel import cp_attention_time, kv_exchange_time, ring_price
from costmodel.fixed_costs import cp_exchange_fixed
from executor.launch_local import launch
from executor.microbench.timing import lockstep, time_op
from executor.parallel.context_parallel import cp_positions
from executor.parallel.cp_exchange import cp_exchange
from executor.parallel.groups import build_parallel_state
from executor.timing import NULL_TIMER
from spec.catalog import get_hardware
from spec.parallel_config import ParallelConfig
from spec.rank_groups import GridSizes


@dataclasses.dataclass(frozen=True)
class Case:
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    seqs: tuple[int, ...] = (8192, 32768, 131072)
    iters: int = 5
    reps: int = 3
    check_max: int = 16384
    device: str = "cuda"

    @classmethod
    def tiny(cls) -> Case:
        return cls(heads=4, kv_heads=4, head_dim=16, dtype="float32", seqs=(64, 128), iters=2, reps=1, device="cpu")


def layouts(world: int) -> dict[str, ParallelConfig]:
    """The CP layouts a world of ``world`` ranks runs, by label (none on one rank: there only ``--cp1``)."""
    if world == 1:
        return {}
    labels = [f"cp{world} dp1", f"cp{world} dp1 cp_comm=p2p", f"cp{world} dp1 cp_comm=a2a"]
    if world >= 4 and world % 2 == 0:
        labels.append(f"cp{world} dp1 cp_comm=a2a+p2p:2x{world // 2}")
    return {label: ParallelConfig.parse(label, world_size=world) for label in labels}


def _layer(config: ParallelConfig, rank: int, seq: int, device: torch.device):
    """What ``cp_exchange`` reads of an attention module: its groups, plain causal attention, its own core."""
    state = build_parallel_state(config, rank)
    cp = state["cp"]
    exchange = cp_exchange(config.cp_comm_type)
    positions = exchange.mask_positions(seq, cp, device)
    mask = None if positions is None else positions[1].unsqueeze(0) <= positions[0].unsqueeze(1)
    return SimpleNamespace(state=state, cp=cp, plain=True, mask=mask, sinks=None, timer=NULL_TIMER,
                           cp_exchange=exchange,
                           local_core=lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                     enable_gqa=True))


def _attend(layer, q, k, v):
    ex = layer.cp_exchange
    q, k, v = ex.before(layer, q, k, v)
    return ex.after(layer, ex.core(layer, q, k, v, None))


def _time(fn, case: Case, device: torch.device) -> float:
    """Median over ``reps`` of ms per call of ``fn`` run ``iters`` times back to back, after a warm-up call, every
    rank's repeats started together (the package's clock, executor.microbench.timing)."""
    with lockstep():
        return 1e3 * time_op(fn, device, iters=case.iters, repeats=case.reps, warmup=1)


def worker(rank: int, world: int, case: Case, cp1: bool) -> dict:
    device = torch.device("cuda", rank) if case.device == "cuda" else torch.device("cpu")
    dtype = getattr(torch, case.dtype)
    out: dict = {}
    for seq in case.seqs:
        gen = torch.Generator(device=device).manual_seed(seq)
        full = [torch.randn(1, n, seq, case.head_dim, device=device, generator=gen, dtype=dtype)
                for n in (case.heads, case.kv_heads, case.kv_heads)]
        grad = torch.randn(1, case.heads, seq // world, case.head_dim, device=device, generator=gen, dtype=dtype)
        pos = cp_positions(seq, world, rank, device)
        local = [t[:, :, pos].contiguous() for t in full]
        ref = None
        if seq <= case.check_max:
            ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)[:, :, pos].float()
        row = {}
        if cp1:
            leaves = [t.clone().requires_grad_() for t in full]
            g1 = torch.randn_like(leaves[0])
            row["cp1_core_ms"] = _time(lambda: F.scaled_dot_product_attention(
                *leaves, is_causal=True, enable_gqa=True).backward(g1), case, device)
        for label, config in layouts(world).items():
            layer = _layer(config, rank, seq, device)
            leaves = [t.clone().requires_grad_() for t in local]
            if ref is not None:
                got = _attend(layer, *leaves).float()
                err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item()
                row[f"{label}:rel_err"] = err
            row[f"{label}:ms"] = _time(lambda: _attend(layer, *leaves).backward(grad), case, device)
        out[str(seq)] = row
    return out


def predict(hardware, world: int, case: Case) -> dict:
    """The cost model's fwd+bwd ms of each layout's core plus exposed exchange, per sequence length."""
    rates, link = compute_rates(hardware, "bf16"), link_rates(hardware)
    ab = 2 if case.dtype in ("bfloat16", "float16") else 4
    gpn = hardware.gpus_per_node
    cp_place = GroupPlacements(GridSizes(cp=world), gpn).of("cp")
    h, kvh, d = case.heads, case.kv_heads, case.head_dim
    out = {}
    for seq in case.seqs:
        t = seq // world
        row = {"cp1_core_ms": 1e3 * sum(cp_attention_time(rates, 1, seq, 1, h, d, d))}
        for label, config in layouts(world).items():
            a2a, ring = config.cp_split
            if config.cp_comm_type == "allgather":
                core = sum(cp_attention_time(rates, 1, seq, world, h, d, d))
                comm = 2 * sum(kv_exchange_time(link, t * kvh * d * ab, cp_place)) + cp_exchange_fixed(hardware)
            else:
                comm = core = 0.0
                if a2a > 1:
                    place = group_placement(1, a2a, gpn)
                    comm += 2 * sum(all_to_all_time(link, t * n * d * ab, place) for n in (h, kvh, kvh, h))
                if ring > 1:
                    price = ring_price(rates, link, group_placement(a2a, ring, gpn), 1, seq, h // a2a, d, d,
                                       t * kvh * 2 * d * ab)
                    core, comm = core + sum(price.core), comm + sum(price.exposed)
                else:
                    core = sum(cp_attention_time(rates, 1, seq, 1, h // a2a, d, d))
            row[f"{label}:model_ms"] = 1e3 * (core + comm)
        out[str(seq)] = row
    return out


def table(measured: dict, predicted: dict, world: int, cp1: bool) -> str:
    labels = list(layouts(world))
    columns = labels + (["cp1 core (1 GPU)"] if cp1 else [])
    lines = ["| seq | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for seq, row in measured.items():
        cells = []
        for label in labels:
            err = row.get(f"{label}:rel_err")
            check = "" if err is None else (" ✓" if err < 2e-2 else f" ✗ {err:.1e}")
            cells.append(f"{row[f'{label}:ms']:.2f} / {predicted[seq][f'{label}:model_ms']:.2f}{check}")
        if cp1:
            cells.append(f"{row['cp1_core_ms']:.2f} / {predicted[seq]['cp1_core_ms']:.2f}")
        lines.append(f"| {seq} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seqs", type=int, nargs="+")
    p.add_argument("--cpu", action="store_true", help="smoke run on gloo CPU ranks, tiny fp32 shapes")
    p.add_argument("--cp1", action="store_true", help="also time the single-GPU core at each sequence")
    p.add_argument("--price", default="h200", help="catalog GPU name the model prices with (default h200)")
    p.add_argument("--timeout", type=float, default=570.0)
    p.add_argument("--heads", type=int, help="query heads (default 32, Mixtral's)")
    p.add_argument("--kv-heads", type=int, help="KV heads (default 8, Mixtral's; Qwen3-30B-A3B has 4)")
    args = p.parse_args(argv)
    case = Case.tiny() if args.cpu else Case()
    if args.world == 1 and not args.cp1:
        p.error("--world 1 times the single-GPU core only: add --cp1")
    if args.heads or args.kv_heads:
        case = dataclasses.replace(case, heads=args.heads or case.heads, kv_heads=args.kv_heads or case.kv_heads)
    if args.seqs:
        case = dataclasses.replace(case, seqs=tuple(args.seqs))
    if not args.cpu and torch.cuda.device_count() < args.world:
        raise SystemExit(f"needs {args.world} CUDA GPUs (or --cpu for a smoke run)")
    launched = launch(worker, args.world, (case, args.cp1), backend="gloo" if args.cpu else "nccl",
                      timeout_s=args.timeout, start_method="fork" if args.cpu else "spawn")
    if not launched.ok:
        print(f"cp_comm_gpu failed: {launched.failure_reason}")
        return 1
    ranks = launched.results
    measured = {seq: {k: (max(r[seq][k] for r in ranks)) for k in ranks[0][seq]} for seq in ranks[0]}
    predicted = predict(get_hardware(args.price), args.world, case)
    text = table(measured, predicted, args.world, args.cp1)
    head = (f"## CP communication types ({args.world} ranks, {case.heads}/{case.kv_heads} heads)\n\n{machine()}, {utc_now()}; "
            f"`{' '.join(['python -m bench.cp_comm_gpu'] + (argv if argv is not None else sys.argv[1:]))}`. "
            f"One attention core (q, k, v in; {case.heads}/{case.kv_heads} heads, d {case.head_dim}, "
            f"{case.dtype}, micro-batch 1) fwd+bwd, ms of the slowest rank: measured / the cost model on "
            f"{args.price}; ✓: the output equals causal attention over the whole sequence."
            + (" CPU SMOKE RUN: the times mean nothing." if args.cpu else "") + "\n\n")
    print(head + text)
    if not args.cpu:  # a smoke run's times mean nothing: printed, not kept
        shape = "" if (case.heads, case.kv_heads) == (Case.heads, Case.kv_heads) else f"_h{case.heads}kv{case.kv_heads}"
        save_json({"world": args.world, "case": dataclasses.asdict(case), "measured": measured, "model": predicted,
                   "machine": machine(), "date": utc_now()}, f"cp_comm_gpu_w{args.world}{shape}.json")
        replace_section(head.split("\n")[0], head + text)
    bad = [k for row in measured.values() for k, v in row.items() if k.endswith("rel_err") and v >= 2e-2]
    return 2 if bad else 0


if __name__ == "__main__":
    # run the package module's main, so the worker and the case it launches pickle as bench.cp_comm_gpu.*
    from bench.cp_comm_gpu import main as package_main

    raise SystemExit(package_main())
