"""Cost-model accuracy: predicted vs measured step time (and peak memory on GPUs) over a layout space.

Measures every executable layout of a proxy MoE model in a benchmark search space on the local
devices (or reads a stored table with ``--table``), predicts each with the cost model on a hardware
profile (a catalog entry, or a calibrated one from ``foldtune calibrate`` with ``--profile``), and
reports MAPE, max error and Spearman rank correlation of step time; on GPUs also the peak-memory error
(predicted total vs ``torch.cuda.max_memory_allocated``); and, per term where the executor times a
matching phase, the term's error. Writes ``bench/results/costmodel_accuracy-<date>-<device>.json``,
the measured table (``layout_table-...json``, replayable by ``bench/search_regret.py --table``) and a
section of docs/benchmarks.md.

    python bench/costmodel_accuracy.py --gpu cpu --gpus 4 --profile ~/.foldtune/hardware/cpu-calibrated.json
    python bench/costmodel_accuracy.py --model small-moe --gpus 2 --gpu h100 --seq 2048 --gbs 16 \\
        --precision bf16 --profile h100-calibrated.json            # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.layout_table import diverse_subset, executable_space, machine, measure_table, replace_section, save_json, utc_now

# cost-model term(s) -> executor phase(s) timing the same work (executor/timing.py marks)
TERM_PHASES = {
    "ep_a2a": (("ep_a2a",), ("ep_alltoall",)),
    "tp_comm": (("tp_comm",), ("tp_allgather", "tp_reduce_scatter")),
    "grad sync": (("dp_grad", "edp_grad", "param_gather"), ("grad_reduce",)),
    "optimizer": (("optimizer",), ("optimizer",)),
}


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
    from planner.enumerate import SearchSpace

    recompute = tuple(("none", ()) if r == "none" else ("full", ()) if r == "full" else ("selective", tuple(r.split("+")))
                      for r in args.recompute.split(","))
    return SearchSpace(mbs_max=args.mbs_max, recompute=recompute, dispatchers=tuple(args.dispatchers.split(",")),
                       cp_min_chunk_tokens=args.cp_min_chunk)


def specs(args: argparse.Namespace):
    from costmodel.catalog import get_hardware, get_model
    from costmodel.hardware import ClusterSpec
    from costmodel.profile_io import load_profile
    from costmodel.training_spec import TrainingSpec

    model = get_model(args.model)
    if args.layers:
        model = model.with_layers(args.layers)
    training = TrainingSpec(seq_length=args.seq, global_batch_size=args.gbs, precision=args.precision,
                            distributed_optimizer=True)
    hardware = load_profile(args.profile) if args.profile else get_hardware(args.gpu)
    return model, training, ClusterSpec(hardware, args.gpus)


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
    parser.add_argument("--dispatchers", default="alltoall,allgather")
    parser.add_argument("--cp-min-chunk", type=int, default=128, help="smallest CP chunk in tokens (default: 128)")
    parser.add_argument("--table", help="replay a stored layout table (JSON; several shards: comma-separated) "
                                        "instead of measuring")
    parser.add_argument("--shard", metavar="I/N", help="measure only every N-th layout from the I-th (0-based), "
                                                       "e.g. two GPU pairs of one machine measure 0/2 and 1/2")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--trial-timeout", type=float, default=300.0)
    parser.add_argument("--results-dir", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")


def load_or_measure(args: argparse.Namespace, model, training, cluster) -> dict:
    """The layout table: read from ``--table`` or measured now (and saved beside the results)."""
    if args.table:
        return merge_tables([json.loads(Path(p).read_text()) for p in args.table.split(",")], model.name, args.table)
    configs = executable_space(model, training, cluster, bench_space(args))
    total = len(configs)
    if args.max_layouts and args.max_layouts < total:
        configs = diverse_subset(configs, args.max_layouts)
    chosen = len(configs)
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
    name = f"layout_table-{model.name}-{cluster.num_gpus}-{started[:10]}-{'cpu' if use_cpu else 'gpu'}{suffix}.json"

    def keep(row: dict) -> None:  # saved after every layout: a run stopped midway keeps what it measured
        table["rows"].append(row)
        table["measured_at"] = f"{started} to {utc_now()[11:]}"
        save_json(table, name, Path(args.results_dir))

    measure_table(model, training, configs, warmup=args.warmup, steps=args.steps,
                  device="cpu" if use_cpu else "cuda", hardware=None if use_cpu else args.gpu,
                  timeout_s=args.trial_timeout, on_row=keep)
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
    merged["rows"] = [row for t in tables for row in t["rows"]]
    if len(tables) > 1:
        merged["measured_at"] = " and ".join(t.get("measured_at", "?") for t in tables)
    return merged


def main() -> int:
    from costmodel.estimate import estimate
    from costmodel.parallel_config import ParallelConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    args = parser.parse_args()
    model, training, cluster = specs(args)
    table = load_or_measure(args, model, training, cluster)
    rows = []
    for r in table["rows"]:
        if not r["ok"]:
            continue
        e = estimate(model, training, cluster, ParallelConfig.from_dict(r["config"]))
        terms = dict(e.time.terms)
        row = {"layout": r["layout"], "measured_s": r["step_time"], "predicted_s": e.time.step_time,
               "error": (e.time.step_time - r["step_time"]) / r["step_time"],
               "predicted_memory_bytes": e.memory.total, "measured_peak_bytes": r.get("peak_allocated_bytes"),
               "terms": {}}
        if row["measured_peak_bytes"]:
            row["memory_error"] = (e.memory.total - row["measured_peak_bytes"]) / row["measured_peak_bytes"]
        for name, (model_terms, phases) in TERM_PHASES.items():
            pred = sum(terms.get(t, 0.0) for t in model_terms)
            meas = sum(r["phases"].get(p, 0.0) for p in phases)
            if pred > 0 and meas > 0:
                row["terms"][name] = {"predicted_s": pred, "measured_s": meas, "error": (pred - meas) / meas}
        rows.append(row)
    if len(rows) < 2:
        print("fewer than two measured layouts: nothing to compare", file=sys.stderr)
        return 1
    errors = [abs(r["error"]) for r in rows]
    summary = {"layouts": len(rows), "failed": sum(not r["ok"] for r in table["rows"]),
               "mape": statistics.fmean(errors), "max_error": max(errors),
               "spearman": spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]),
               "mean_signed_error": statistics.fmean(r["error"] for r in rows)}
    mem = [r["memory_error"] for r in rows if "memory_error" in r]
    if mem:
        summary.update(memory_mape=statistics.fmean(abs(m) for m in mem), memory_max_error=max(abs(m) for m in mem),
                       memory_worst_under=min(mem))
    per_term = {}
    for name in TERM_PHASES:
        errs = [r["terms"][name]["error"] for r in rows if name in r["terms"]]
        if errs:
            per_term[name] = {"layouts": len(errs), "mape": statistics.fmean(abs(x) for x in errs),
                              "mean_signed_error": statistics.fmean(errs)}
    summary["per_term"] = per_term
    hardware = cluster.hardware
    result = {"summary": summary, "rows": rows, "hardware_profile": hardware.name, "profile_source": hardware.source,
              "device": table["device"], "measured_at": table["measured_at"], "evaluated_at": utc_now(),
              "command": " ".join(sys.argv), "model": model.name, "world_size": cluster.num_gpus}
    cpu = "CPU" in table["device"]
    stamp = table["measured_at"][:10] + ("-cpu" if cpu else "-gpu")
    path = save_json(result, f"costmodel_accuracy-{model.name}-{cluster.num_gpus}-{hardware.name}-{stamp}.json",
                     Path(args.results_dir))
    for r in sorted(rows, key=lambda r: r["measured_s"]):
        print(f"{r['layout']:<64} measured {r['measured_s'] * 1e3:8.2f} ms  predicted {r['predicted_s'] * 1e3:8.2f} ms"
              f"  {r['error']:+7.1%}")
    print(f"{summary['layouts']} layouts: step-time MAPE {summary['mape']:.1%}, max {summary['max_error']:.1%}, "
          f"Spearman {summary['spearman']:.3f}" + (f"; memory MAPE {summary['memory_mape']:.1%}" if mem else ""))
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
    if s["per_term"]:
        lines += ["", "Per term, where the executor times the same work as a phase:", "",
                  "| term | layouts | MAPE | mean signed error |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {name} | {t['layouts']} | {t['mape']:.1%} | {t['mean_signed_error']:+.1%} |"
                  for name, t in s["per_term"].items()]
    lines += ["", "| layout | measured | predicted | error |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {r['layout']} | {r['measured_s'] * 1e3:.2f} ms | {r['predicted_s'] * 1e3:.2f} ms | {r['error']:+.1%} |"
              for r in sorted(result["rows"], key=lambda r: r["measured_s"])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
