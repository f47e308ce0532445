"""Cost-model accuracy: predicted vs measured step time (and peak memory on GPUs) over a layout space.

Measures every executable layout of a proxy MoE model in a benchmark search space on the local
devices (or reads a stored table with ``--table``), predicts each with the cost model on a hardware
profile (a catalog entry, or a calibrated one from ``foldtune calibrate`` with ``--profile``), and
reports MAPE, max error and Spearman rank correlation of step time; on GPUs also the peak-memory error
(predicted total vs ``torch.cuda.max_memory_allocated``); and, per term where the executor times a
matching phase, the term's error, read on the rank that sets the pace (:func:`pace_phases`). Writes
``bench/results/costmodel_accuracy-<date>-<device>.json``, the measured table (``layout_table-...json``,
replayable by ``bench/search_regret.py --table``) and a section of docs/benchmarks.md.

    python -m bench.costmodel_accuracy --gpu cpu --gpus 4 --profile ~/.foldtune/hardware/cpu-calibrated.json
    python -m bench.costmodel_accuracy --model small-moe --gpus 2 --gpu h100 --seq 2048 --gbs 16 \\
        --precision bf16 --profile h100-calibrated.json            # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from bench.layout_table import diverse_subset, executable_space, machine, measure_table, replace_section, save_json, utc_now
from costmodel.estimate import estimate
from planner.calibration import Observation, fit_calibration
from planner.enumerate import SearchSpace
from spec.catalog import get_hardware, has_hardware
from spec.dispatchers import DISPATCHERS
from spec.hardware import ClusterSpec
from spec.inputs import build_specs
from spec.parallel_config import ParallelConfig

# cost-model term(s) -> executor phase(s) timing the same work (executor/timing.py marks). The overlapped
# parameter all-gather is waited for at the next forward's first use of each bucket, not in the grad_reduce
# phase, so "grad sync" compares the gradient reductions alone.
TERM_PHASES = {
    "ep_a2a": (("ep_a2a",), ("ep_alltoall",)),
    "tp_comm": (("tp_comm",), ("tp_allgather", "tp_reduce_scatter")),
    "grad sync": (("dp_grad", "edp_grad"), ("grad_reduce",)),
    "optimizer": (("optimizer",), ("optimizer",)),
}


def pace_phases(row: dict) -> dict[str, float]:
    """The phases of the rank that sets the step's pace: the one with the longest experts phase.

    Under uneven routing the other EP ranks wait for that rank inside their all-to-all (their phase holds
    the wait, not the transfer), while the model prices the busiest rank's experts and the transfer alone.
    Rows without per-rank phases (older tables) give rank 0's."""
    by_rank = row.get("phases_by_rank") or []
    if not by_rank:
        return row["phases"]
    return max(by_rank, key=lambda phases: phases.get("experts", 0.0))


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2.0
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    sy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (sx * sy) if sx and sy else float("nan")


def bench_space(args: argparse.Namespace):
    recompute = tuple(("none", ()) if r == "none" else ("full", ()) if r == "full" else ("selective", tuple(r.split("+")))
                      for r in args.recompute.split(","))
    return SearchSpace(mbs_max=args.mbs_max, recompute=recompute, dispatchers=tuple(args.dispatchers.split(",")),
                       cp_min_chunk_tokens=args.cp_min_chunk, ep_overlap=False)
    # EP overlap variants (executor: pp = 1) stay out of these tables: each would repeat a layout of the table;
    # bench/ep_overlap_gpu.py measures the overlap against the same step without it


def specs(args: argparse.Namespace):
    """(model, training, cluster) of the common options (:func:`add_common_arguments`)."""
    return build_specs(args.model, args.gpus, gpu=args.gpu, profile=args.profile, layers=args.layers,
                       seq_length=args.seq, global_batch_size=args.gbs, precision=args.precision,
                       distributed_optimizer=True,
                       moe_expert_load=expert_load(getattr(args, "expert_load_from", None)))


def expert_load(source: str | None) -> tuple[float, ...] | None:
    """Per-expert shares of routed tokens from a stored layout table: ``TABLE`` (its first measured row) or
    ``TABLE@LAYOUT``. Routing depends on the model, the data and the initialisation, not on the layout, so one
    run of the same workload gives it for every layout (only its router counts are read, never a time)."""
    if not source:
        return None
    path, _, layout = source.partition("@")
    rows = [r for r in json.loads(Path(path).read_text())["rows"]
            if r.get("ok") and r.get("tokens_per_expert") and (not layout or r["layout"] == layout)]
    if not rows:
        raise SystemExit(f"--expert-load-from {source}: no measured row with tokens per expert")
    counts = rows[0]["tokens_per_expert"]
    total = sum(counts)
    return tuple(c / total for c in counts)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared with bench/search_regret.py: the proxy model, its training, the space, the devices."""
    parser.add_argument("--model", default="tiny-moe", help="catalog proxy model (default: tiny-moe)")
    parser.add_argument("--layers", type=int, help="cut the catalog model to this many layers (ModelSpec.with_layers; "
                                                   "a replayed --table needs the same value)")
    parser.add_argument("--max-layouts", type=int, help="measure at most this many layouts: a deterministic subset "
                                                        "spread over tp/cp/pp/ep/etp/dp/mbs/recompute/dispatcher")
    parser.add_argument("--gpus", type=int, default=4, help="ranks / GPUs (default: 4)")
    parser.add_argument("--gpu", default="cpu", help="catalog hardware profile (default: cpu = CPU ranks)")
    parser.add_argument("--profile", help="calibrated hardware profile JSON (from foldtune calibrate); replaces --gpu")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--mbs-max", type=int, default=2)
    parser.add_argument("--recompute", default="none,full", help="comma list: none, full, or selective modules "
                                                                "joined by '+' (default: none,full)")
    parser.add_argument("--dispatchers", default=",".join(DISPATCHERS),
                        help=f"comma list of {', '.join(DISPATCHERS)} (default: all)")
    parser.add_argument("--cp-min-chunk", type=int, default=128, help="smallest CP chunk in tokens (default: 128)")
    parser.add_argument("--table", help="replay a stored layout table (JSON; several shards: comma-separated) "
                                        "instead of measuring")
    parser.add_argument("--redo", metavar="TABLE[,TABLE]", help="measure only the layouts that failed in these "
                                                              "stored tables (replay them with --table old,new)")
    parser.add_argument("--shard", metavar="I/N", help="measure only every N-th layout from the I-th (0-based), "
                                                       "e.g. two GPU pairs of one machine measure 0/2 and 1/2")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--trial-timeout", type=float, default=300.0)
    parser.add_argument("--no-reuse", action="store_true", help="start fresh rank processes for every layout "
                                                                 "(default: one set of ranks runs them all)")
    parser.add_argument("--results-dir", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    parser.add_argument("--expert-load-from", metavar="TABLE[@LAYOUT]",
                        help="price EP layouts with the per-expert routing measured in this stored table (its "
                             "first row, or LAYOUT): the busiest EP rank sets the pace")


def load_or_measure(args: argparse.Namespace, model, training, cluster) -> dict:
    """The layout table: read from ``--table`` or measured now (and saved beside the results)."""
    if args.table:
        return merge_tables([json.loads(Path(p).read_text()) for p in args.table.split(",")], model.name, args.table)
    configs = executable_space(model, training, cluster, bench_space(args))
    total = len(configs)
    if args.max_layouts and args.max_layouts < total:
        configs = diverse_subset(configs, args.max_layouts)
    chosen = len(configs)
    if args.redo:  # only the layouts that failed in stored tables (e.g. a bug since fixed); merge with --table
        failed = {row["layout"] for p in args.redo.split(",") for row in json.loads(Path(p).read_text())["rows"]
                  if not row["ok"]}
        configs = [c for c in configs if c.label() in failed]
    shard, shards = parse_shard(args.shard)
    configs = configs[shard::shards]  # machines with spare GPUs measure several shards at once
    print(f"{total} executable layouts of {model.name} on {cluster.num_gpus} ranks; measuring "
          + (f"a diverse subset of {chosen}" if chosen < total else "each")
          + (f", shard {shard}/{shards}: {len(configs)} of them" if shards > 1 else ""), flush=True)
    use_cpu = cluster.gpu.name.lower() == "cpu"
    started = utc_now()
    table = {"model": model.name, "num_layers": model.num_layers, "executable_layouts": total,
             "training": training.to_dict(), "world_size": cluster.num_gpus, "device": machine(),
             "measured_at": started, "command": " ".join(sys.argv), "rows": []}
    suffix = f"-shard{shard}of{shards}" if shards > 1 else ""
    name = f"layout_table-{model.name.replace('@', '-')}-{cluster.num_gpus}-{started[:10]}-{'cpu' if use_cpu else 'gpu'}{suffix}.json"

    def keep(row: dict) -> None:  # saved after every layout: a run stopped midway keeps what it measured
        table["rows"].append(row)
        table["measured_at"] = f"{started} to {utc_now()[11:]}"
        save_json(table, name, Path(args.results_dir))

    measure_table(model, training, configs, warmup=args.warmup, steps=args.steps,
                  device="cpu" if use_cpu else "cuda", hardware=None if use_cpu else cluster.gpu.name,
                  timeout_s=args.trial_timeout, on_row=keep, reuse=not args.no_reuse)
    print(f"table saved to {Path(args.results_dir) / name}")
    return table


def parse_shard(text: str | None) -> tuple[int, int]:
    """'I/N' -> (I, N) with 0 <= I < N; None -> (0, 1)."""
    if not text:
        return 0, 1
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise SystemExit(f"--shard {text!r}: expected I/N, e.g. 0/2") from None
    if not 0 <= i < n:
        raise SystemExit(f"--shard {text!r}: need 0 <= I < N")
    return i, n


def merge_tables(tables: list[dict], model_name: str, source: str) -> dict:
    """One table from the shards of one measurement (rows concatenated; the first shard's header)."""
    for t in tables:
        if t.get("model") not in (None, model_name):
            raise SystemExit(f"{source}: measured on {t['model']!r}, not {model_name!r} (pass the same --model/--layers)")
        if t.get("world_size") != tables[0].get("world_size"):
            raise SystemExit(f"{source}: shards of different world sizes {[x.get('world_size') for x in tables]}")
    merged = dict(tables[0])
    rows: dict[str, dict] = {}
    for row in (row for t in tables for row in t["rows"]):  # a later measurement of a layout wins, unless failed
        if row["ok"] or row["layout"] not in rows:
            rows[row["layout"]] = row
    merged["rows"] = list(rows.values())
    if len(tables) > 1:
        merged["measured_at"] = " and ".join(t.get("measured_at", "?") for t in tables)
    return merged


def compare(model, training, cluster, table_rows: list[dict]) -> tuple[list[dict], dict]:
    """Predict every measured layout of ``table_rows`` on ``cluster``; (rows, summary)."""
    rows, failed = [], []
    for r in table_rows:
        e = estimate(model, training, cluster, ParallelConfig.from_dict(r["config"]))
        if not r["ok"]:  # kept for the k-trial replay: the search may have tried it and met its failure
            failed.append({"layout": r["layout"], "predicted_s": e.time.step_time, "predicted_terms": e.time.terms,
                           "predicted_memory_bytes": e.memory.total,
                           "oom": "out of memory" in (r.get("failure_reason") or "")})
            continue
        terms = dict(e.time.terms)
        row = {"layout": r["layout"], "measured_s": r["step_time"], "predicted_s": e.time.step_time,
               "error": (e.time.step_time - r["step_time"]) / r["step_time"],
               "predicted_memory_bytes": e.memory.total, "measured_peak_bytes": r.get("peak_allocated_bytes"),
               "predicted_terms": e.time.terms, "terms": {}}
        if row["measured_peak_bytes"]:
            row["memory_error"] = (e.memory.total - row["measured_peak_bytes"]) / row["measured_peak_bytes"]
        pace = pace_phases(r)
        for name, (model_terms, phases) in TERM_PHASES.items():
            pred = sum(terms.get(t, 0.0) for t in model_terms)
            meas = sum(pace.get(p, 0.0) for p in phases)
            if pred > 0 and meas > 0:
                row["terms"][name] = {"predicted_s": pred, "measured_s": meas, "error": (pred - meas) / meas}
        rows.append(row)
    summary = summarize(rows, len(failed))
    summary["failed_rows"] = failed
    return rows, summary


def summarize(rows: list[dict], failed: int = 0) -> dict:
    """MAPE, max, signed error and Spearman of step time; memory errors; per-term errors and shares."""
    errors = [abs(r["error"]) for r in rows]
    summary = {"layouts": len(rows), "failed": failed, "mape": statistics.fmean(errors), "max_error": max(errors),
               "spearman": spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]),
               "mean_signed_error": statistics.fmean(r["error"] for r in rows)}
    mem = [r["memory_error"] for r in rows if "memory_error" in r]
    if mem:
        summary.update(memory_mape=statistics.fmean(abs(m) for m in mem), memory_max_error=max(abs(m) for m in mem),
                       memory_worst_under=min(mem))
    per_term = {}
    for name in TERM_PHASES:
        errs = [r["terms"][name]["error"] for r in rows if name in r.get("terms", {})]
        if errs:
            per_term[name] = {"layouts": len(errs), "mape": statistics.fmean(abs(x) for x in errs),
                              "mean_signed_error": statistics.fmean(errs)}
    summary["per_term"] = per_term
    # every model term's share of the predicted steps (summed over layouts), for the per-term table
    totals: dict[str, float] = {}
    for r in rows:
        for name, seconds in r.get("predicted_terms", ()):
            totals[name] = totals.get(name, 0.0) + seconds
    predicted = sum(r["predicted_s"] for r in rows) or 1.0
    summary["term_shares"] = {name: seconds / predicted for name, seconds in totals.items() if seconds > 0}
    return summary


def k_trial(rows: list[dict], failed: list[dict], capacity_bytes: float, k: int) -> dict | None:
    """Held-out error after calibrating on ``k`` trials, picked as the search would pick them.

    The search measures the cost model's top-ranked layouts first: the ``k`` lowest predicted step times
    among all layouts of the table, failed ones included (a failed trial that ran out of memory is an OOM
    observation, any other failure teaches the calibration nothing). planner.calibration fits its
    multipliers on those; MAPE, Spearman and memory errors are over the remaining measured layouts only,
    never over the ones the fit saw.
    """
    ranked = sorted([*rows, *failed], key=lambda r: r["predicted_s"])
    tried, rest = ranked[:k], [r for r in ranked[k:] if "measured_s" in r]
    if len(rest) < 2:
        return None
    observations = [Observation(r["predicted_terms"], r["predicted_memory_bytes"], None, None, True, capacity_bytes)
                    if r.get("oom") else
                    Observation(r["predicted_terms"], r["predicted_memory_bytes"], r["measured_s"],
                                r["measured_peak_bytes"], False, capacity_bytes)
                    for r in tried if "measured_s" in r or r.get("oom")]
    calibration = fit_calibration(observations)
    held = []
    for r in rest:
        predicted = calibration.step_time(r["predicted_terms"])
        row = {"layout": r["layout"], "measured_s": r["measured_s"], "predicted_s": predicted,
               "error": (predicted - r["measured_s"]) / r["measured_s"]}
        if r.get("measured_peak_bytes"):
            mem = calibration.memory(r["predicted_memory_bytes"])
            row["memory_error"] = (mem - r["measured_peak_bytes"]) / r["measured_peak_bytes"]
        held.append(row)
    out = summarize(held)
    out.pop("term_shares")
    out.pop("per_term")
    out.update(k=k, fitted_on=[r["layout"] for r in tried], calibration=calibration.to_dict())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    args = parser.parse_args()
    model, training, cluster = specs(args)
    table = load_or_measure(args, model, training, cluster)
    rows, summary = compare(model, training, cluster, table["rows"])
    if len(rows) < 2:
        print("fewer than two measured layouts: nothing to compare", file=sys.stderr)
        return 1
    mem = "memory_mape" in summary
    if args.profile and has_hardware(cluster.gpu.name):  # the datasheet entry the profile was calibrated from
        base = cluster.gpu.name
        _, datasheet = compare(model, training, ClusterSpec(get_hardware(base), cluster.num_gpus), table["rows"])
        datasheet.pop("term_shares")
        datasheet.pop("failed_rows")
        summary["datasheet"] = {"hardware_profile": base, **datasheet}
    failed = summary.pop("failed_rows")
    summary["k_trial"] = {str(k): s for k in (3, 5)
                          if (s := k_trial(rows, failed, cluster.usable_hbm_bytes, k)) is not None}
    hardware = cluster.hardware
    for r in rows:
        r["predicted_terms"] = dict(r["predicted_terms"])
    result = {"summary": summary, "rows": rows, "hardware_profile": hardware.name, "profile_source": hardware.source,
              "device": table["device"], "measured_at": table["measured_at"], "evaluated_at": utc_now(),
              "command": " ".join(sys.argv), "model": model.name, "world_size": cluster.num_gpus,
              "expert_load": list(training.moe_expert_load) if training.moe_expert_load else None}
    cpu = "CPU" in table["device"]
    stamp = table["measured_at"][:10] + ("-cpu" if cpu else "-gpu")
    path = save_json(result, f"costmodel_accuracy-{model.name.replace('@', '-')}-{cluster.num_gpus}-{hardware.name}-{stamp}.json",
                     Path(args.results_dir))
    for r in sorted(rows, key=lambda r: r["measured_s"]):
        print(f"{r['layout']:<64} measured {r['measured_s'] * 1e3:8.2f} ms  predicted {r['predicted_s'] * 1e3:8.2f} ms"
              f"  {r['error']:+7.1%}" + (f"  memory {r['memory_error']:+6.1%}" if "memory_error" in r else ""))
    print(f"{summary['layouts']} layouts, profile {hardware.name}: step-time MAPE {summary['mape']:.1%}, "
          f"max {summary['max_error']:.1%}, Spearman {summary['spearman']:.3f}"
          + (f"; memory MAPE {summary['memory_mape']:.1%}, worst under {summary['memory_worst_under']:+.1%}"
             if mem else ""))
    if "datasheet" in summary:
        d = summary["datasheet"]
        print(f"  datasheet {d['hardware_profile']}: step-time MAPE {d['mape']:.1%}, Spearman {d['spearman']:.3f}")
    for k, s in summary["k_trial"].items():
        print(f"  {k}-trial calibrated (held out {s['layouts']}): step-time MAPE {s['mape']:.1%}, "
              f"Spearman {s['spearman']:.3f}" + (f", memory MAPE {s['memory_mape']:.1%}, worst under "
                                                  f"{s['memory_worst_under']:+.1%}" if "memory_mape" in s else ""))
    print("  predicted share of the step per term: " + ", ".join(
        f"{name} {share:.0%}" for name, share in sorted(summary["term_shares"].items(), key=lambda kv: -kv[1])))
    print(f"results: {path}")
    if not args.no_write:
        replace_section(heading(cpu, model.name, cluster.num_gpus, hardware.name), doc_section(result, cpu))
    return 0


def heading(cpu: bool, model: str, ranks: int, hardware: str) -> str:
    kind = "CPU" if cpu else "GPU"
    return f"## Cost-model accuracy ({kind}, {model}, {ranks} ranks, profile {hardware})"


def doc_section(result: dict, cpu: bool) -> str:
    s = result["summary"]
    lines = [heading(cpu, result["model"], result["world_size"], result["hardware_profile"]), "",
             (f"Measured {result['measured_at']} on {result['device']}; predictions with hardware profile "
             f"`{result['hardware_profile']}` ({result['profile_source']}); evaluated {result['evaluated_at']} by "
             f"`{result['command']}`.")]
    if cpu:
        lines += ["", ("CPU ranks (gloo) on a shared development machine: these numbers show that the benchmark "
                  "runs end to end, they are **not** the issue's GPU bars. CPU runs report no peak memory.")]
    lines += ["", "| layouts | step-time MAPE | max error | mean signed error | Spearman |"
              + (" memory MAPE | worst memory under-prediction |" if "memory_mape" in s else ""),
              "| ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if "memory_mape" in s else ""),
              f"| {s['layouts']} | {s['mape']:.1%} | {s['max_error']:.1%} | {s['mean_signed_error']:+.1%} | "
              f"{s['spearman']:.3f} |" + (f" {s['memory_mape']:.1%} | {s['memory_worst_under']:+.1%} |"
                                          if "memory_mape" in s else "")]
    extra = [("datasheet profile `" + s["datasheet"]["hardware_profile"] + "`", s["datasheet"])] \
        if "datasheet" in s else []
    extra += [(f"{k}-trial calibrated, held out", t) for k, t in s.get("k_trial", {}).items()]
    if extra:
        lines += ["", "Other predictions of the same table (k-trial: planner.calibration fitted on the k layouts the "
                  "model ranks fastest, errors over the other layouts only):", "",
                  "| prediction | layouts | step-time MAPE | max error | Spearman | memory MAPE | worst memory under |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {label} | {t['layouts']} | {t['mape']:.1%} | {t['max_error']:.1%} | {t['spearman']:.3f} | "
                  + (f"{t['memory_mape']:.1%} | {t['memory_worst_under']:+.1%} |" if "memory_mape" in t else "— | — |")
                  for label, t in extra]
    if s.get("term_shares"):
        lines += ["", "Predicted share of the step per term (summed over the layouts): "
                  + ", ".join(f"{name} {share:.1%}" for name, share in
                              sorted(s["term_shares"].items(), key=lambda kv: -kv[1])) + "."]
    if s["per_term"]:
        lines += ["", ("Per term, where the executor times the same work as a phase (on the rank with the longest "
                       "experts phase: the others wait for it inside their all-to-all):"), "",
                  "| term | layouts | MAPE | mean signed error |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {name} | {t['layouts']} | {t['mape']:.1%} | {t['mean_signed_error']:+.1%} |"
                  for name, t in s["per_term"].items()]
    lines += ["", "| layout | measured | predicted | error |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {r['layout']} | {r['measured_s'] * 1e3:.2f} ms | {r['predicted_s'] * 1e3:.2f} ms | {r['error']:+.1%} |"
              for r in sorted(result["rows"], key=lambda r: r["measured_s"])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
