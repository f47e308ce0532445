"""Run every microbenchmark on ``world_size`` ranks at once (local processes, or a cluster launcher's ranks)
and collect the raw timings.

Compute benchmarks run on all ranks concurrently because training loads every device at once (on CPU
the ranks share cores, which is exactly what a CPU layout measured by the executor sees); collectives
need every rank anyway. Rank 0 prints progress.
"""

from __future__ import annotations

import datetime
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor.launch_local import LaunchResult
from executor.launch_local import launch as launch_ranks
from executor.microbench import (attention, collectives, exchanges, fp8_linear, fragmentation, gemm, grouped_gemm,
                                 hbm, launch, memory_bound, offload, overlap, sustained)
from executor.microbench.components import OPTIMIZER_PARAMS_CPU, OPTIMIZER_PARAMS_GPU, measure_optimizer
from executor.microbench.sustained import SUSTAINED_SECONDS
from executor.microbench.timing import in_turns
from executor.node import cpu_cores, node_name
from spec.errors import FoldtuneError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class BenchPlan:
    """What to measure: ``quick`` shrinks every sweep (CI), ``precision`` the GEMM dtype, ``sustained_s`` the
    seconds of back-to-back GEMMs that measure the clock under sustained load (GPUs only; 0 skips it)."""

    precision: str = "bf16"
    quick: bool = False
    collectives: bool = True
    sustained_s: float = SUSTAINED_SECONDS
    # the two smallest sizes of each sweep, one expert shape, no overlap run: seconds, for end-to-end tests of
    # the code paths that calibrate (a job's first calibration); its curves are too coarse to price with
    minimal: bool = False

    def sizes(self, values):
        """``values`` (a sweep, small to large) as this plan measures them."""
        return tuple(values)[:2] if self.minimal else tuple(values)


def _say(rank: int):
    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)
    return say


def _grouped_line(row: dict) -> str:
    """One grouped-GEMM row as the calibration prints it: shape, tokens per expert, microseconds, TFLOP/s."""
    return (f"  {row['experts']}x{row['hidden']}x{row['ffn']} t={row['tokens_per_expert']:<6} "
            f"{row['seconds'] * 1e6:10.1f} us  {row['flops'] / row['seconds'] / 1e12:8.3f} TFLOP/s")


def calibrate_worker(rank: int, world_size: int, plan: BenchPlan) -> dict:
    """One rank: GEMM, grouped GEMM, attention and copy benchmarks, the sustained-load run (GPUs), launch
    overheads, then the collectives and the executor's own CP and dispatcher exchanges; returns its raw
    timings. CPU ranks share the cores: they time their own work in turns (executor.microbench.timing.in_turns:
    each alone, the cost model prices each layout's contention from ``cpu_cores``) and their collectives in
    lockstep."""
    with in_turns(torch.distributed.get_backend() != "nccl"):
        report = _calibrate(rank, world_size, plan)
    if torch.distributed.get_backend() != "nccl":
        report["cpu_cores"] = cpu_cores()
    return report


def _calibrate(rank: int, world_size: int, plan: BenchPlan) -> dict:
    use_cuda = torch.distributed.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    gemm_dtype = DTYPES[plan.precision]
    # fp8 training runs only its linears' GEMMs in fp8: everything else is timed in bf16
    dtype = torch.bfloat16 if plan.precision == "fp8" else gemm_dtype
    say = _say(rank)
    say(f"[rank 0 of {world_size}] {device.type} {plan.precision}: GEMMs")
    report = {"device_name": torch.cuda.get_device_name(device) if use_cuda else "cpu", "node": node_name(),
              "gemm": gemm.measure_gemm(plan.sizes(gemm.default_shapes(device, plan.quick)), device, gemm_dtype)}
    for row in report["gemm"]:
        say(f"  gemm {row['m']}x{row['n']}x{row['k']}  fwd {row['seconds'] * 1e6:10.1f} us "
            f"{row['flops'] / row['seconds'] / 1e12:8.3f} TFLOP/s   bwd {row['bwd_seconds'] * 1e6:10.1f} us "
            f"{2 * row['flops'] / row['bwd_seconds'] / 1e12:8.3f} TFLOP/s")
    say("grouped GEMMs (expert shape, tokens per expert)")
    shapes = grouped_gemm.default_shapes(device)
    report["grouped_gemm"] = [row for shape in (shapes[:1] if plan.minimal else shapes) for row in
                              grouped_gemm.measure_grouped_gemm(
                                  plan.sizes(grouped_gemm.default_tokens(device, plan.quick)),
                                                                device, dtype, shape)]
    for row in report["grouped_gemm"]:
        say(_grouped_line(row))
    if plan.precision == "fp8":  # the experts' fp8 GEMMs at the same shapes: the profile keeps fp8 over bf16
        say("grouped GEMMs in fp8 (torch's scaled grouped GEMM, operands quantised beforehand)")
        report["grouped_gemm_fp8"] = [row for shape in (shapes[:1] if plan.minimal else shapes) for row in
                                      grouped_gemm.measure_grouped_gemm_fp8(
                                          plan.sizes(grouped_gemm.default_tokens(device, plan.quick)),
                                          device, shape)]
        for row in report["grouped_gemm_fp8"]:
            say(_grouped_line(row))
        say("dense linears, fp8 against bf16 (the executor's, forward + backward, quantisation included)")
        shapes = fp8_linear.GPU_SHAPES[:2] if plan.minimal else fp8_linear.GPU_SHAPES
        report["linear_fp8"] = fp8_linear.measure_linear_fp8(shapes, device)
        for row in report["linear_fp8"]:
            say(f"  {row['m']}x{row['n']}x{row['k']}  fp8 {row['seconds'] * 1e6:10.1f} us   bf16 "
                f"{row['bf16_seconds'] * 1e6:10.1f} us   bf16/fp8 {row['bf16_seconds'] / row['seconds']:6.3f}")
    say("causal attention (head shape, key length)")
    seqs = plan.sizes(attention.default_seqs(device, plan.quick))
    report["attention"] = [row for kind in (attention.KINDS[:1] if plan.minimal else attention.KINDS)
                           for row in attention.measure_attention(seqs, device, dtype, kind=kind)]
    for row in report["attention"]:
        say(f"  {row['kind']} {row['head_dim']}/{row['v_head_dim']} s={row['seq']:<6} fwd {row['fwd_seconds'] * 1e6:10.1f} us {row['fwd_flops'] / row['fwd_seconds'] / 1e12:8.3f}"
            f" TFLOP/s   bwd {row['bwd_seconds'] * 1e6:10.1f} us {row['bwd_flops'] / row['bwd_seconds'] / 1e12:8.3f} TFLOP/s")
    say("memory copy")
    report["copy"] = hbm.measure_copy(plan.sizes(hbm.default_sizes(device, plan.quick))[:1 if plan.minimal else None],
                                      device)
    for row in report["copy"]:
        say(f"  {row['bytes'] / 2**20:8.0f} MiB  {row['traffic_bytes'] / row['seconds'] / 1e9:8.2f} GB/s")
    say("memory-bound ops (forward + backward under autograd: product, RMSNorm, SwiGLU, token gather)")
    report["memory_bound"] = memory_bound.measure_memory_bound(
        plan.sizes(memory_bound.default_sizes(device, plan.quick)), device, dtype)
    for row in report["memory_bound"]:
        say(f"  {row['op']:<11} {row['rows']:>6}x{row['width']:<5} {row['seconds'] * 1e6:10.1f} us")
    # after every compute curve: those are priced as bursts from a cool card, and seconds at the power cap
    # would leave the grouped GEMM and attention curves timed on a hot one (scaled by the factor twice)
    if use_cuda and plan.sustained_s > 0:
        say(f"sustained load: {plan.precision} GEMM 8192³ back to back for {plan.sustained_s:.0f} s")
        report["sustained"] = sustained.measure_sustained(device, gemm_dtype, plan.sustained_s)
        row = report["sustained"]
        say(f"  burst {row['burst_flops_per_s'] / 1e12:8.1f} TFLOP/s   sustained {row['sustained_flops_per_s'] / 1e12:8.1f}"
            f" TFLOP/s   factor {row['factor']:.3f}")
    if use_cuda:
        say(f"allocator fragmentation ({fragmentation.PROXY_MODEL}@1L steps, reserved vs allocated peaks)")
        report["fragmentation"] = fragmentation.measure_fragmentation(device, plan.precision)
        f = report["fragmentation"]
        say(f"  allocated {f['allocated_peak_bytes'] / 2**20:10.1f} MiB   reserved {f['reserved_peak_bytes'] / 2**20:10.1f}"
            f" MiB   fragmentation {f['fragmentation']:.3f}")
    say("offload (pinned host<->GPU copies, CPU Adam step)")
    elements = offload.QUICK_CPU_ADAM_ELEMENTS if plan.quick or plan.minimal else offload.CPU_ADAM_ELEMENTS
    report["offload"] = {"link": offload.measure_host_link(device), "cpu_adam": offload.measure_cpu_adam(elements, device=device)}
    link, adam = report["offload"]["link"], report["offload"]["cpu_adam"]
    say((f"  D2H {link['d2h_bytes_per_s'] / 1e9:8.2f} GB/s   H2D {link['h2d_bytes_per_s'] / 1e9:8.2f} GB/s   "
         if link else "  ") + f"CPU Adam {adam['cpu_adam_bytes_per_s'] / 1e9:8.2f} GB/s of optimizer state")
    say("optimizer step (the executor's fused mixed-precision AdamW, fp32 main gradients)")
    n = OPTIMIZER_PARAMS_GPU if use_cuda else OPTIMIZER_PARAMS_CPU
    report["optimizer"] = {"params": n, "seconds_per_param": measure_optimizer(device, dtype, n)}
    say(f"  {report['optimizer']['seconds_per_param'] * 1e9:8.4f} ms per 1M parameters "
        f"(over {n / 2**20:.0f}M parameters)")
    say("launch overhead (tiny eager ops, one-element all-reduce)")
    report["launch"] = launch.measure_launch(device, dtype)
    coll, layer = report["launch"]["collective_launch_s"], report["launch"]["moe_layer_host_s"]
    say(f"  op launch {report['launch']['op_launch_s'] * 1e6:8.2f} us"
        + (f"   small collective {coll * 1e6:8.2f} us" if coll is not None else "")
        + (f"   executor MoE layer (tiny, fwd+bwd) {layer * 1e3:8.3f} ms" if layer is not None else "")
        + f"   checkpoint region {report['launch']['recompute_region_s'] * 1e3:8.3f} ms")
    report["collectives"] = []
    if plan.collectives and world_size > 1:
        say("collectives")
        report["collectives"] = collectives.measure_collectives(
            rank, world_size, device, dtype, plan.sizes(collectives.default_bytes(device, plan.quick)), say=say)
    if plan.collectives and world_size > 1:
        say("executor exchanges: CP2 K/V exchange and chunked attention, EP2 dispatchers (dispatch + combine)")
        report["exchanges"] = exchanges.measure_exchanges(rank, world_size, device)
        x = report["exchanges"]
        if x:
            say(f"  seq {x['cp']['seq']}: K/V exchange {x['cp']['kv_s'] * 1e3:8.3f} ms   chunked attention "
                f"{x['cp']['core_s'] * 1e3:8.3f} ms   {x['dispatch']['tokens']} tokens: "
                + "   ".join(f"{name} {sec * 1e3:8.3f} ms" for name, sec in x["dispatch"]["seconds"].items()))
    if plan.collectives and world_size > 1 and not plan.minimal:
        say("overlap interference (reduce-scatter beside GEMMs)")
        report["overlap"] = overlap.measure_overlap(world_size, device, dtype)
        o = report["overlap"]
        say(f"  gemms {o['gemm_s'] * 1e3:8.3f} ms   reduce-scatter {o['comm_bytes'] / 2**20:.0f} MiB "
            f"{o['comm_s'] * 1e3:8.3f} ms   both {o['both_s'] * 1e3:8.3f} ms   slowdown {o['slowdown']:.2f}")
    return report


def merge_ranks(reports: list[dict]) -> dict:
    """One raw record from every rank's: compute times (attention's too) are the median over ranks, collective times the
    max (a collective ends when its slowest member does); so are launch overheads (op: median, collective: max)."""
    def merged(key: str, reducer) -> list[dict]:
        rows = []
        for i, row in enumerate(reports[0][key]):
            rows.append({**row, **{field: reducer([r[key][i][field] for r in reports])
                                   for field in ("seconds", "bwd_seconds", "bf16_seconds") if field in row}})
        return rows
    return {"device_name": reports[0]["device_name"], "ranks": len(reports),
            "gemm": merged("gemm", statistics.median), "grouped_gemm": merged("grouped_gemm", statistics.median),
            **({"grouped_gemm_fp8": merged("grouped_gemm_fp8", statistics.median)}
               if reports[0].get("grouped_gemm_fp8") else {}),
            **({"linear_fp8": merged("linear_fp8", statistics.median)} if reports[0].get("linear_fp8") else {}),
            "copy": merged("copy", statistics.median), "collectives": merged("collectives", max),
            **({"memory_bound": merged("memory_bound", statistics.median)} if reports[0].get("memory_bound") else {}),
            "attention": [{**row, "fwd_seconds": statistics.median(r["attention"][i]["fwd_seconds"] for r in reports),
                           "bwd_seconds": statistics.median(r["attention"][i]["bwd_seconds"] for r in reports)}
                          for i, row in enumerate(reports[0].get("attention") or [])],
            "launch": _merged_launch([r["launch"] for r in reports]),
            # the pair ends when its slowest rank does: the largest slowdown
            # training waits for its slowest GPU: the lowest sustained clock
            "sustained": min((r["sustained"] for r in reports if r.get("sustained")), key=lambda s: s["factor"],
                             default=None),
            "overlap": max((r["overlap"] for r in reports if r.get("overlap")), key=lambda o: o["slowdown"],
                           default=None),
            # the GPU that loses the most to its allocator sets the margin every GPU must keep
            "fragmentation": max((r["fragmentation"] for r in reports if r.get("fragmentation")),
                                 key=lambda f: f["fragmentation"], default=None),
            # every rank offloads at once: the slowest link and CPU step are what a step waits for
            "offload": _merged_offload([r.get("offload") for r in reports]),
            # every rank steps at once: the slowest one's step is the step's
            "optimizer": max((r["optimizer"] for r in reports if r.get("optimizer")),
                             key=lambda o: o["seconds_per_param"], default=None),
            "exchanges": exchanges.merge_exchanges([r.get("exchanges") for r in reports]),
            # CPU ranks: the fewest cores any rank's node gives its ranks (what the busiest node's ranks share)
            **({"cpu_cores": min(r["cpu_cores"] for r in reports)} if all("cpu_cores" in r for r in reports) else {})}


def _merged_offload(rows: list[dict | None]) -> dict | None:
    rows = [r for r in rows if r]
    if not rows:
        return None
    links = [r["link"] for r in rows if r.get("link")]
    return {"link": min(links, key=lambda r: r["host_link_bytes_per_s"]) if links else None,
            "cpu_adam": min((r["cpu_adam"] for r in rows), key=lambda r: r["cpu_adam_bytes_per_s"])}


def _merged_launch(rows: list[dict]) -> dict:
    colls = [r["collective_launch_s"] for r in rows if r["collective_launch_s"] is not None]
    layers = [r["moe_layer_host_s"] for r in rows if r.get("moe_layer_host_s") is not None]
    regions = [r["recompute_region_s"] for r in rows if r.get("recompute_region_s") is not None]
    return {"op_launch_s": statistics.median(r["op_launch_s"] for r in rows),
            "collective_launch_s": max(colls) if colls else None,
            "moe_layer_host_s": statistics.median(layers) if layers else None,
            "recompute_region_s": statistics.median(regions) if regions else None}


def run_benchmarks(world_size: int, plan: BenchPlan, device: str = "auto", timeout_s: float = 1200.0,
                   launcher: Callable[..., LaunchResult] | None = None) -> dict:
    """Launch ``world_size`` ranks (NCCL on as many GPUs, else gloo on CPU), run every benchmark, and return the
    merged raw timings plus ``precision``, ``backend``, ``measured_at`` (UTC ISO) and ``nodes`` (the nodes the
    ranks ran on, executor/node.py).

    ``launcher`` (``executor.launch_local.launch``'s contract, e.g. ``executor.launch_ray.launch`` bound to a
    cluster and its GPUs per node) runs the ranks elsewhere; default: local processes. With a launcher the
    devices are the cluster's, so ``device`` must say which ('cuda' or 'cpu'): nothing local is checked.
    Ranks spread over several nodes also time the collectives of one rank per node (the NIC stage)."""
    if launcher is not None and device not in ("cuda", "cpu"):
        raise FoldtuneError(f"calibration through a cluster launcher needs device 'cuda' or 'cpu', got {device!r}")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if launcher is None and use_cuda and torch.cuda.device_count() < world_size:
        raise FoldtuneError(f"calibration on {world_size} GPUs needs as many, this machine has "
                            f"{torch.cuda.device_count()}")
    if plan.precision not in DTYPES:
        raise FoldtuneError(f"precision {plan.precision!r} cannot be benchmarked (supported: {', '.join(DTYPES)})")
    if plan.precision == "fp8" and not use_cuda:
        raise FoldtuneError("precision fp8 needs CUDA GPUs with fp8 tensor cores (torch._scaled_mm)")
    backend = "nccl" if use_cuda else "gloo"
    result = (launcher or launch_ranks)(calibrate_worker, world_size, (plan,), backend=backend, timeout_s=timeout_s)
    if not result.ok:
        raise FoldtuneError(f"calibration run failed: {result.failure_reason}")
    raw = merge_ranks(result.results)
    raw.update(precision=plan.precision, backend=backend, quick=plan.quick,
               nodes=sorted({r["node"] for r in result.results}),
               measured_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    return raw
