"""The cost model's price of the executor's CP and dispatcher exchanges at one benchmarked shape, and the
per-call seconds a measurement shows beyond it (the ``*_fixed_s`` fields of ``HardwareProfile``).

``executor/microbench/exchanges.py`` times, per rank, fwd+bwd of: the CP K/V exchange (``gather_kv`` of K
and of V), the CP chunked attention core (``cp_attention``), and each dispatcher's dispatch + combine (the
experts a copy: communication and permutation). Here the same cases are priced from a profile's curves and
rates, term by term as ``costmodel.step_time`` prices them, and

    fixed per call = max(0, measured − priced without any fixed cost)

per K/V exchange and per dispatch + combine of each dispatcher; and the chunk calls' floor F (fwd+bwd),
the one for which the priced core, every chunk direction at ``max(kernel, F/2)``, equals the measured core
(0 when the kernels alone take as long; ``costmodel.context_parallel``). These are measured quantities of
one small shape, not fits: nothing here reads a training step. ``bench/cp_dispatch_gpu.py`` prints the same prices (fixed costs included)
beside its measurements.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from costmodel.comm import GroupPlacements, link_rates
from costmodel.compute import ComputeRates, compute_rates, gemm_fwd_bwd, memory_time
from costmodel.context_parallel import cp_attention_time, kv_exchange_bytes, kv_exchange_time
from costmodel.dispatch import (allgather_gather_bytes, allgather_scatter_bytes, alltoall_dispatch_bytes,
                                dispatcher_pricing)
from costmodel.fixed_costs import cp_exchange_fixed, dispatcher_fixed
from costmodel.step_time import ELEMENTWISE_BWD_RATIO
from spec.hardware import HardwareProfile
from spec.rank_groups import GridSizes


@dataclass(frozen=True)
class CpCase:
    """One CP attention layer as benchmarked: ``seq`` tokens per sequence (micro-batch 1), ``cp`` ranks,
    ``heads``/``kv_heads`` of ``head_dim``, ``act_bytes`` per element."""

    seq: int
    cp: int
    heads: int
    kv_heads: int
    head_dim: int
    act_bytes: int = 2


@dataclass(frozen=True)
class DispatchCase:
    """One MoE layer's dispatch + combine as benchmarked: ``tokens`` per rank, ``ep`` ranks, ``experts``
    top-``topk``, ``hidden`` elements of ``act_bytes``."""

    tokens: int
    ep: int
    experts: int
    topk: int
    hidden: int
    act_bytes: int = 2


class _Block:
    """Collects what a dispatcher pricing adds (step_time's per-layer block, summed over its slots)."""

    def __init__(self) -> None:
        self.fwd = self.bwd = 0.0

    def add(self, term, fwd: float, bwd: float, module=()) -> None:
        self.fwd += fwd
        self.bwd += bwd


@dataclass
class _Model:
    hidden_size: int
    moe_router_topk: int
    num_experts: int


@dataclass
class _RoutedShape:
    """The layer shape a dispatcher pricing reads (``costmodel.dispatch.RoutedShape``) for an EP-only case."""

    model: _Model
    link: object
    rates: ComputeRates
    act_bytes: int
    places: GroupPlacements  # an EP group only (etp = 1)
    dispatch_fixed: float
    etp: int = 1
    imbalance: float = 1.0
    # the exchange is priced at the bytes' own cost: the per-call remainder it calibrates is measured beside the
    # fine-grained factors, not after them
    permute_factor: float = 1.0

    def __post_init__(self) -> None:
        self.ep_place, self.etp_place, self.tp_ep_place = map(self.places.of, ("ep", "etp", "tp_ep"))

    def elementwise(self, block, fwd_bytes, module=(), bwd_bytes=None, term=None, scale=1.0,
                    op="elementwise") -> None:
        block.add(term, scale * memory_time(self.rates, fwd_bytes, op=op), scale * memory_time(
            self.rates, ELEMENTWISE_BWD_RATIO * fwd_bytes if bwd_bytes is None else bwd_bytes, op=op))


def cp_prices(hardware: HardwareProfile, case: CpCase, fixed: bool = True) -> tuple[float, float]:
    """(core, K/V exchange) seconds fwd+bwd of the busiest CP rank, as the time model prices them; without
    ``fixed``, neither the chunk calls' floor nor the exchange's per-call cost."""
    rates = compute_rates(hardware, "bf16")
    if not fixed:
        rates = replace(rates, cp_chunk_floor=0.0)
    core = sum(cp_attention_time(rates, 1, case.seq, case.cp, case.heads, case.head_dim, case.head_dim))
    if case.cp <= 1:
        return core, 0.0
    place = GroupPlacements(GridSizes(cp=case.cp), hardware.gpus_per_node).of("cp")  # a CP-only layout
    # K and V: one call each, as the executor issues them (costmodel.collective_inventory)
    local = kv_exchange_bytes(case.seq // case.cp, case.kv_heads, case.head_dim, case.act_bytes)
    kv = 2 * sum(kv_exchange_time(link_rates(hardware), local, place))
    return core, kv + (cp_exchange_fixed(hardware) if fixed else 0.0)


def dispatch_price(hardware: HardwareProfile, case: DispatchCase, name: str, fixed: bool = True) -> float:
    """Seconds fwd+bwd of dispatcher ``name``'s dispatch + combine with permutation and unpermutation (the
    benchmark's case: uniform routing, no router, experts a copy), as the time model prices them; without
    ``fixed``, no per-call cost."""
    rates = compute_rates(hardware, "bf16")
    n, h, k, ab = case.tokens, case.hidden, case.topk, case.act_bytes
    places = GroupPlacements(GridSizes(ep=case.ep), hardware.gpus_per_node)  # an EP-only layout
    per_call = dispatcher_fixed(hardware, name) if fixed else 0.0
    shape = _RoutedShape(_Model(h, k, case.experts), link_rates(hardware), rates, ab, places, per_call)
    block = _Block()
    shape.elementwise(block, (1 + k) * n * h * ab)  # permute (step_time's moe_routed prices it so)
    dispatcher_pricing(name).routed_time(shape, block, n, n * k, max(1, case.experts // case.ep))
    shape.elementwise(block, (1 + k) * n * h * ab)  # unpermute and weight by the probabilities
    return block.fwd + block.bwd


def chunk_floor(hardware: HardwareProfile, case: CpCase, measured_core: float) -> float:
    """The chunk calls' floor (seconds, fwd+bwd) at which the priced core of ``case`` equals
    ``measured_core``: 0 when the kernels alone are priced at least that long. The priced core is continuous
    and non-decreasing in the floor, and at a floor of ``measured_core`` it is at least that (a rank runs at
    least one chunk), so bisection finds it."""
    rates = compute_rates(hardware, "bf16")

    def core(floor: float) -> float:
        return sum(cp_attention_time(replace(rates, cp_chunk_floor=floor), 1, case.seq, case.cp, case.heads,
                                     case.head_dim, case.head_dim))

    if case.cp <= 1 or core(0.0) >= measured_core:
        return 0.0
    low, high = 0.0, measured_core
    for _ in range(60):  # 2^-60 of the measured seconds: far below timing noise
        mid = (low + high) / 2
        low, high = (mid, high) if core(mid) < measured_core else (low, mid)
    return (low + high) / 2


def fixed_fields(hardware: HardwareProfile, measured: dict) -> dict:
    """The ``HardwareProfile`` fields of per-call seconds from one exchange measurement (``measured``:
    ``executor.microbench.exchanges.measure_exchanges``'s record, times the slowest rank's), priced on
    ``hardware`` (the curves calibrated in the same run). Parts the record lacks give no field."""
    out: dict = {}
    cp = measured.get("cp")
    if cp:
        case = CpCase(cp["seq"], cp["cp"], cp["heads"], cp["kv_heads"], cp["head_dim"], cp["act_bytes"])
        _, kv = cp_prices(hardware, case, fixed=False)
        out["cp_chunk_floor_s"] = chunk_floor(hardware, case, cp["core_s"])
        out["cp_exchange_fixed_s"] = max(0.0, cp["kv_s"] - kv)
    dispatch = measured.get("dispatch")
    if dispatch:
        case = DispatchCase(dispatch["tokens"], dispatch["ep"], dispatch["experts"], dispatch["topk"],
                            dispatch["hidden"], dispatch["act_bytes"])
        out["dispatcher_fixed_s"] = tuple(sorted(
            (name, max(0.0, seconds - dispatch_price(hardware, case, name, fixed=False)))
            for name, seconds in dispatch["seconds"].items()))
    return out


def predict_bench(hardware: HardwareProfile, *, hidden: int, heads: int, kv_heads: int, head_dim: int,
                  seqs: tuple[int, ...], experts: int, topk: int, tokens: tuple[int, ...], bytes_per_element: int,
                  world: int = 2) -> dict:
    """The cost model's milliseconds for each case ``bench/cp_dispatch_gpu.py`` times (``cp_cases`` and
    ``dispatcher_cases`` of ``executor.microbench.exchanges``: an attention layer of ``hidden``, ``heads`` /
    ``kv_heads`` heads of ``head_dim`` at each sequence of ``seqs`` on CP1 and CP``world``, and each dispatcher
    at EP``world`` over ``experts`` experts top-``topk`` for each of ``tokens`` tokens per rank, elements of
    ``bytes_per_element`` bytes), priced as the time model
    prices them: CP chunk kernels at their own key lengths plus the profile's per-chunk cost, the exposed K/V
    all-gather and reduce-scatter plus the per-exchange cost, the projections' GEMMs; each dispatcher's
    communication, its own memory passes, the permutation and unpermutation, plus its per-call cost (the
    ``*_fixed_s`` fields: measured by ``foldtune calibrate``, else ``costmodel.fixed_costs``' rules of thumb)."""
    rates, link = compute_rates(hardware, "bf16"), link_rates(hardware)
    ab, h, kvh, d = bytes_per_element, hidden, kv_heads, head_dim
    out = {"cp": {}, "dispatch": {}}
    for s in seqs:
        row = {}
        for cp in (1, world):
            t = s // cp
            core, kv = cp_prices(hardware, CpCase(s, cp, heads, kvh, d, ab))
            proj = sum(gemm_fwd_bwd(rates, t, (heads + 2 * kvh) * d, h)) + sum(gemm_fwd_bwd(rates, t, h, heads * d))
            row.update({f"cp{cp}_core_ms": 1e3 * core, f"cp{cp}_proj_ms": 1e3 * proj,
                        f"cp{cp}_total_ms": 1e3 * (core + proj + kv)})
            if cp > 1:
                row[f"cp{cp}_kv_ms"] = 1e3 * kv
                place = GroupPlacements(GridSizes(cp=cp), hardware.gpus_per_node).of("cp")  # a CP-only layout
                row[f"cp{cp}_kv_bytes_ms"] = 1e3 * sum(kv_exchange_time(link, kv_exchange_bytes(t, kvh, 2 * d, ab),
                                                                        place))
        row["speedup_total"] = row["cp1_total_ms"] / row[f"cp{world}_total_ms"]
        row["speedup_core"] = row["cp1_core_ms"] / row[f"cp{world}_core_ms"]
        out["cp"][str(s)] = row
    for n in tokens:
        row = {"alltoall_bytes": alltoall_dispatch_bytes(n, topk, h, ab),
               "allgather_gather_bytes": allgather_gather_bytes(n, topk, h, ab, world),
               "allgather_scatter_bytes": allgather_scatter_bytes(n, h, ab, world)}
        case = DispatchCase(n, world, experts, topk, h, ab)
        for name in ("alltoall", "allgather"):
            row[f"{name}_ms"] = 1e3 * dispatch_price(hardware, case, name)
        out["dispatch"][str(n)] = row
    return out
