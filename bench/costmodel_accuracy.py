"""Cost-model accuracy: predicted vs measured step time (and peak memory on GPUs) over a layout space.

Measures every executable layout of a proxy MoE model in a benchmark search space on the local
devices (or reads a stored table with ``--table``), predicts each with the cost model on a hardware
profile (a catalog entry, or a calibrated one from ``foldtune calibrate`` with ``--profile``), and
reports MAPE, max error and Spearman rank correlation of step time; on GPUs also the peak-memory error
(predicted total vs ``torch.cuda.max_memory_allocated``); and, per term where the executor times a
matching phase, the term's error, read on the rank that sets the pace (:func:`planner.accuracy.pace_phases`). Writes
``bench/results/costmodel_accuracy-<date>-<device>.json``, the measured table (``layout_table-...json``,
replayable by ``bench/search_regret.py --table``) and a section of docs/benchmarks.md.

    python -m bench.costmodel_accuracy --gpu cpu --gpus 4 --profile ~/.foldtune/hardware/cpu-calibrated.json
    python -m bench.costmodel_accuracy --model small-moe --gpus 2 --gpu h100 --seq 2048 --gbs 16 \\
        --precision bf16 --profile h100-calibrated.json            # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.report import machine, replace_section, save_json, utc_now
from planner.accuracy import compare, k_trial, merge_tables
from planner.enumerate import SearchSpace
from planner.runnable import executable_space
from planner.subset import diverse_subset
from spec.catalog import get_hardware, has_hardware
from spec.dispatchers import EXECUTOR_DISPATCHERS
from spec.hardware import ClusterSpec
from spec.inputs import build_specs

def bench_space(args: argparse.Namespace):
    recompute = tuple(("none", ()) if r == "none" else ("full", ()) if r == "full" else ("selective", tuple(r.split("+")))
                      for r in args.recompute.split(","))
    return SearchSpace(mbs_max=args.mbs_max, recompute=recompute, dispatchers=tuple(args.dispatchers.split(",")),
                       cp_min_chunk_tokens=args.cp_min_chunk, ep_overlap=False)
    # EP overlap variants stay out of these tables: each would repeat a layout of the table;
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
    parser.add_argument("--dispatchers", default=",".join(EXECUTOR_DISPATCHERS),
                        help=f"comma list of {', '.join(EXECUTOR_DISPATCHERS)} (the executor's; default: all)")
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
        try:
            return merge_tables([json.loads(Path(p).read_text()) for p in args.table.split(",")], model.name,
                                args.table)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
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

    from executor.profile_table import measure_table  # torch: a replayed --table never measures

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
