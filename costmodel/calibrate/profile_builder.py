"""Turn raw microbenchmark timings into a calibrated HardwareProfile (units: docs/time-model.md).

* ``gemm_efficiency``: FLOPs of one GEMM -> (FLOPs / measured seconds) / datasheet peak of the
  benchmarked precision; the time model then prices a GEMM as FLOPs / (peak · curve(FLOPs)).
* ``gemm_bwd_efficiency``: forward FLOPs of a GEMM shape -> (2 x those FLOPs / measured seconds of the linear
  layer's input- and weight-gradient GEMMs) / the same peak; raw files without backward timings leave it unset
  (the time model then prices each backward GEMM on the forward curve by its own shape).
* ``grouped_gemm_efficiency``: tokens per expert -> (FLOPs / seconds) / peak at the reference expert shape
  (the first measured); ``grouped_gemm_shape_efficiency``: the same curve for every measured expert shape,
  keyed '<hidden>x<ffn>'. An fp8 calibration times its GEMMs with ``torch._scaled_mm`` against the fp8 peak,
  its grouped GEMMs in bf16 (read against the bf16 peak: the curves stay bf16's) and in fp8 at the same shapes
  and tokens: ``grouped_gemm_fp8_over_bf16`` keeps, per shape, the fp8 speed over the bf16 speed by tokens
  per expert, which the time model applies to the bf16 curves under fp8; ``dense_fp8_over_bf16`` keeps the
  executor's fp8 dense linear against bf16's (forward + backward, quantisation included) by forward FLOPs.
* ``attention_fwd_efficiency`` / ``attention_bwd_efficiency``: key length -> (the time model's causal
  attention FLOPs / measured seconds) / 16-bit datasheet peak, forward and backward (SDPA, the executor's
  kernel; ``executor/microbench/attention.py``), for query/key/value heads of one width;
  ``attention_mla_fwd_efficiency`` / ``attention_mla_bwd_efficiency`` the same for MLA's wider query/key
  heads (192/128), which SDPA runs on another kernel. An fp8 calibration times attention in bf16 against the bf16
  peak as well (attention stays in 16 bits under fp8 training).
* ``hbm_efficiency``: copy traffic (read + write) / seconds of the largest copy / datasheet bandwidth.
* ``memory_bound_efficiency``: per memory-bound op class, bytes per kernel -> achieved / datasheet bandwidth,
  bytes as the time model counts them, forward + backward of the executor's op at each measured size
  (``costmodel/calibrate/memory_bound.py``); raw files without the benchmark keep the base's.
* ``collective_efficiency['<name>:intra']``: full-size buffer bytes -> (the model's wire bytes for that
  buffer / measured seconds) / ``intra_node_bandwidth``; latency is inside the curve. Every rank of a
  local run shares one node, so only 'intra' curves come from here. Each measured group size n gets its
  own curve ``'<name>:intra:<n>'``, which the time model uses for groups of that size; the curve without a
  size takes the median efficiency over all measured sizes at each message size, for groups of a size
  calibration did not measure.
* ``op_launch_s`` / ``collective_launch_s`` / ``moe_layer_host_s``: seconds per tiny eager op, per
  one-element all-reduce and per executor MoE layer on tiny shapes (``executor/microbench/launch.py``),
  copied as measured; raw files written before that benchmark existed keep the base profile's values.
  ``recompute_region_s`` likewise: the seconds one activation-checkpoint region adds beyond its re-run forward.
* ``sustained_clock_factor``: sustained / burst throughput of an 8192³ GEMM in the benchmarked precision run
  back to back for seconds (``executor/microbench/sustained.py``), the lowest over ranks; GPUs only.
* ``optimizer_seconds_per_param``: the executor's optimizer step over 128 M parameters (GPUs; 64 K on CPU),
  the slowest rank's; raw files without it keep the base's.
* ``host_link_bandwidth`` / ``cpu_adam_bandwidth``: the slower direction of a pinned host<->GPU copy (GPUs
  only) and the bytes of fp32 optimizer state the executor's CPU Adam steps per second, the slowest rank's,
  all ranks at once (``executor/microbench/offload.py``); raw files without them keep the base's.
* ``cp_exchange_fixed_s`` / ``dispatcher_fixed_s``: seconds per call of the executor's CP K/V exchange and
  each dispatcher's dispatch + combine beyond what the profile just built prices for the same benchmarked
  shape, floored at 0; ``cp_chunk_floor_s``: the least seconds of a CP chunk call that make the priced core
  of that shape its measured one (``costmodel/calibrate/exchange_prices.py``); measured on two or more ranks
  only, else the base's.
* ``overlap_slowdown``: the fraction of a hidden reduce-scatter's seconds that a GEMM loop running beside it
  still pays (``executor/microbench/overlap.py``); measured on two or more ranks only.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import replace

from costmodel.calibrate.exchange_prices import fixed_fields
from costmodel.calibrate.memory_bound import memory_bound_curves
from costmodel.comm import ring_wire_bytes
from spec.hardware import HardwareProfile, MeasuredCurve


def wire_bytes(collective: str, buffer_bytes: float, group_size: int) -> float:
    """Bytes one rank moves over its links in the cost model's formula for ``collective``."""
    if collective == "all_to_all":
        return buffer_bytes * (group_size - 1) / group_size
    if collective == "p2p":
        return buffer_bytes
    return ring_wire_bytes(collective, buffer_bytes, group_size)


def _curve(points: dict[float, list[float]]) -> MeasuredCurve | None:
    pts = tuple((x, statistics.median(ys)) for x, ys in sorted(points.items()) if ys)
    return MeasuredCurve(pts) if pts else None


def _efficiency_curve(rows: list[dict], x_key: str, efficiency) -> MeasuredCurve | None:
    """Curve of ``row[x_key]`` -> ``efficiency(row)``, the median where a value of x was measured more than once."""
    points: dict[float, list[float]] = defaultdict(list)
    for row in rows:
        points[float(row[x_key])].append(efficiency(row))
    return _curve(points)


def gemm_curve(rows: list[dict], peak: float) -> MeasuredCurve | None:
    """FLOPs of one GEMM -> achieved / ``peak`` of the forward GEMM."""
    return _efficiency_curve(rows, "flops", lambda row: row["flops"] / row["seconds"] / peak)


def gemm_bwd_curve(rows: list[dict], peak: float) -> MeasuredCurve | None:
    """Forward FLOPs -> achieved / ``peak`` of the two backward GEMMs (twice the forward's FLOPs)."""
    return _efficiency_curve([row for row in rows if row.get("bwd_seconds")], "flops",
                             lambda row: 2.0 * row["flops"] / row["bwd_seconds"] / peak)


def grouped_curve(rows: list[dict], peak: float) -> MeasuredCurve | None:
    """Tokens per expert -> achieved / ``peak`` at the first measured expert shape (the reference one); raw
    rows that do not record their shape count as one shape."""
    first = _shape_key(rows[0]) if rows else None
    return _tokens_curve([row for row in rows if _shape_key(row) == first], peak)


def fp8_over_bf16_curves(bf16_rows: list[dict], fp8_rows: list[dict]) -> dict[str, MeasuredCurve]:
    """'<hidden>x<ffn>' -> curve of tokens per expert -> bf16 seconds / fp8 seconds, from grouped-GEMM rows of
    the same shapes and tokens in both precisions (rows without a partner are skipped)."""
    bf16 = {(_shape_key(r), float(r["tokens_per_expert"])): r["seconds"] for r in bf16_rows if _shape_key(r)}
    points: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in fp8_rows:
        key, tokens = _shape_key(r), float(r["tokens_per_expert"])
        if key and (key, tokens) in bf16 and r["seconds"] > 0:
            points[key][tokens].append(bf16[(key, tokens)] / r["seconds"])
    return {key: curve for key, pts in points.items() if (curve := _curve(pts)) is not None}


def grouped_shape_curves(rows: list[dict], peak: float) -> dict[str, MeasuredCurve]:
    """``'<hidden>x<ffn>'`` -> tokens per expert -> achieved / ``peak``, one curve per measured expert shape."""
    by_shape: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if (key := _shape_key(row)) is not None:
            by_shape[key].append(row)
    return {key: curve for key, shape_rows in by_shape.items() if (curve := _tokens_curve(shape_rows, peak))}


def _tokens_curve(rows: list[dict], peak: float) -> MeasuredCurve | None:
    return _efficiency_curve(rows, "tokens_per_expert", lambda row: row["flops"] / row["seconds"] / peak)


def _shape_key(row: dict) -> str | None:
    """'<hidden>x<ffn>' of a grouped-GEMM row; None for a row that does not record its shape."""
    return f"{row['hidden']}x{row['ffn']}" if "hidden" in row and "ffn" in row else None


def attention_curves(rows: list[dict], peak: float, kind: str = "mha"
                     ) -> tuple[MeasuredCurve | None, MeasuredCurve | None]:
    """(forward, backward) curves of key length -> achieved / ``peak`` (the 16-bit datasheet peak), from the
    rows of head shape ``kind`` (rows of profiles measured before the MLA shape existed are 'mha')."""
    fwd: dict[float, list[float]] = defaultdict(list)
    bwd: dict[float, list[float]] = defaultdict(list)
    for row in rows:
        if row.get("kind", "mha") != kind:
            continue
        fwd[float(row["seq"])].append(row["fwd_flops"] / row["fwd_seconds"] / peak)
        bwd[float(row["seq"])].append(row["bwd_flops"] / row["bwd_seconds"] / peak)
    return _curve(fwd), _curve(bwd)


def collective_curves(rows: list[dict], link_bandwidth: float, scope: str = "intra") -> dict[str, MeasuredCurve]:
    """``'<collective>:<scope>'`` (all group sizes, median) and ``'<collective>:<scope>:<n>'`` (n ranks) ->
    curve of buffer bytes -> achieved / ``link_bandwidth``."""
    grouped: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        achieved = wire_bytes(row["collective"], row["bytes"], row["group_size"]) / row["seconds"]
        for key in (f"{row['collective']}:{scope}", f"{row['collective']}:{scope}:{row['group_size']}"):
            grouped[key][float(row["bytes"])].append(achieved / link_bandwidth)
    return {key: curve for key, pts in grouped.items() if (curve := _curve(pts)) is not None}


def build_profile(base: HardwareProfile, raw: dict, name: str | None = None) -> HardwareProfile:
    """``base`` (datasheet figures) with the curves measured in ``raw`` (from ``runner.run_benchmarks``)."""
    peak = base.gpu.peak(raw["precision"])
    copy = max(raw["copy"], key=lambda r: r["bytes"]) if raw["copy"] else None
    # rows inside one node price NVLink, rows of one rank per node the NIC stage (``scope`` 'inter', when the
    # calibration's ranks spanned nodes); contiguous groups spanning nodes ('mixed') are hierarchical
    # composites the time model builds from the other two, so no curve is read from them
    rows = raw["collectives"]
    intra_rows = [r for r in rows if r.get("scope", "intra") == "intra"]
    inter_rows = [r for r in rows if r.get("scope") == "inter"]
    measured = collective_curves(intra_rows, base.intra_node_bandwidth)
    measured_inter = collective_curves(inter_rows, base.nic_bandwidth_per_gpu, "inter")
    # a collective measured here replaces all of the base's curves for it on that link, per-size ones included:
    # a group size this run did not form must fall back to this run's median, not to another machine's curve
    remeasured = {(key.split(":")[0], key.split(":")[1]) for key in {**measured, **measured_inter}}
    curves = {key: curve for key, curve in base.collective_efficiency
              if (key.split(":")[0], key.split(":")[1]) not in remeasured}
    curves.update(measured)
    curves.update(measured_inter)
    nodes = max((r["group_size"] for r in inter_rows), default=0)
    network_source = (f"measured {raw['measured_at']} across {nodes} nodes ({raw['backend']}), one rank per node"
                      if measured_inter else base.network_source)
    launch = raw.get("launch") or {}
    offloading = raw.get("offload") or {}
    link, cpu_adam = offloading.get("link") or {}, offloading.get("cpu_adam") or {}
    attn_fwd, attn_bwd = attention_curves(raw.get("attention") or [], base.gpu.peak("bf16"))
    mla_fwd, mla_bwd = attention_curves(raw.get("attention") or [], base.gpu.peak("bf16"), "mla")
    # fp8 runs time their grouped GEMMs in bf16 too: read against the bf16 peak; their fp8 timings at the same
    # shapes become fp8/bf16 ratios (a run from before fp8 grouped timing keeps the base's bf16 curves)
    fp8_rows = raw.get("grouped_gemm_fp8") or []
    grouped_rows = raw["grouped_gemm"] if raw["precision"] != "fp8" or fp8_rows else []
    grouped_peak = base.gpu.peak("bf16") if raw["precision"] == "fp8" else peak
    grouped_shapes = tuple(sorted(grouped_shape_curves(grouped_rows, grouped_peak).items()))
    built = replace(
        base, name=name or f"{base.name}-calibrated",
        gemm_efficiency=gemm_curve(raw["gemm"], peak) or base.gemm_efficiency,
        gemm_bwd_efficiency=gemm_bwd_curve(raw["gemm"], peak) or base.gemm_bwd_efficiency,
        grouped_gemm_efficiency=grouped_curve(grouped_rows, grouped_peak) or base.grouped_gemm_efficiency,
        grouped_gemm_shape_efficiency=grouped_shapes if grouped_rows else base.grouped_gemm_shape_efficiency,
        grouped_gemm_fp8_over_bf16=(tuple(sorted(fp8_over_bf16_curves(grouped_rows, fp8_rows).items()))
                                    or base.grouped_gemm_fp8_over_bf16),
        dense_fp8_over_bf16=(_efficiency_curve(raw.get("linear_fp8") or [], "flops",
                                               lambda row: row["bf16_seconds"] / row["seconds"])
                             or base.dense_fp8_over_bf16),
        collective_efficiency=tuple(sorted(curves.items())),
        attention_fwd_efficiency=attn_fwd or base.attention_fwd_efficiency,
        attention_bwd_efficiency=attn_bwd or base.attention_bwd_efficiency,
        attention_mla_fwd_efficiency=mla_fwd or base.attention_mla_fwd_efficiency,
        attention_mla_bwd_efficiency=mla_bwd or base.attention_mla_bwd_efficiency,
        hbm_efficiency=(copy["traffic_bytes"] / copy["seconds"] / base.gpu.hbm_bandwidth) if copy
        else base.hbm_efficiency,
        op_launch_s=launch.get("op_launch_s") or base.op_launch_s,
        collective_launch_s=launch.get("collective_launch_s") or base.collective_launch_s,
        moe_layer_host_s=launch.get("moe_layer_host_s") or base.moe_layer_host_s,
        recompute_region_s=(launch["recompute_region_s"] if launch.get("recompute_region_s") is not None
                            else base.recompute_region_s),
        overlap_slowdown=(raw.get("overlap") or {}).get("slowdown", base.overlap_slowdown),
        sustained_clock_factor=(raw.get("sustained") or {}).get("factor", base.sustained_clock_factor),
        allocator_fragmentation=(raw.get("fragmentation") or {}).get("fragmentation", base.allocator_fragmentation),
        host_link_bandwidth=link.get("host_link_bytes_per_s", base.host_link_bandwidth),
        cpu_adam_bandwidth=cpu_adam.get("cpu_adam_bytes_per_s", base.cpu_adam_bandwidth),
        optimizer_seconds_per_param=(raw.get("optimizer") or {}).get("seconds_per_param",
                                                                     base.optimizer_seconds_per_param),
        network_source=network_source,
        cpu_cores=raw.get("cpu_cores", base.cpu_cores),
        source=f"calibrated {raw['measured_at']} on {raw['ranks']}x {raw['device_name']} "
               f"({raw['backend']}, {raw['precision']}{', quick' if raw.get('quick') else ''})")
    memory = memory_bound_curves(raw.get("memory_bound") or [], base.gpu.hbm_bandwidth)
    if memory:
        built = replace(built, memory_bound_efficiency=memory)
    # the per-call costs are what the executor's exchanges take beyond the curves just built: priced on them
    return replace(built, **fixed_fields(built, raw["exchanges"])) if raw.get("exchanges") else built
