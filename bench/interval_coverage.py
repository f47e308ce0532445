"""Interval coverage over the stored trial tables: does each layout's measured step (and peak memory) fall
inside the interval the cost model now gives it? Stored data only: no device, no measurement.

Every layout table under ``bench/results`` (``layout_table-*.json``, written by ``bench/costmodel_accuracy.py``)
is listed in :data:`CALLS` with the device call that measured it and the calibrated hardware profile that
call measured (``foldtune calibrate``'s own output, without per-model component factors: those are ratios to
the cost model of their day). Each table is **re-priced** with the code checked out now, on its own GPU count,
and judged by :func:`planner.accuracy.interval_coverage`. A table under ``bench/results`` that
:data:`CALLS` does not list is named as not judged.

    python3 -m bench.interval_coverage              # table on stdout, JSON under bench/results, docs/benchmarks.md
    python3 -m bench.interval_coverage --no-write   # stdout only
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.report import RESULTS, ROOT, replace_section, save_json, utc_now
from costmodel.uncertainty import PROVENANCES, RATE
from planner.accuracy import compare, interval_coverage, merge_tables
from spec.inputs import build_specs

HEADING = "## Interval coverage over the stored trial tables (re-priced)"
# what bench/costmodel_accuracy.py and bench/accuracy_gpu.sh ran when a table does not say (seq, gbs, precision)
DEFAULT_TRAINING = {"seq_length": 4096, "global_batch_size": 8, "precision": "bf16"}


@dataclass(frozen=True)
class Call:
    """One device call's stored tables: ``tables`` holds one tuple of shard paths per GPU count (relative to
    bench/results), ``profile`` the calibrated profile measured in the same call, ``layers`` the proxy's depth."""

    label: str
    measured: str  # UTC, as the tables say
    code: str  # the commit the call ran, where docs/benchmarks.md names it
    profile: str
    tables: tuple[tuple[str, ...], ...]
    layers: int | None = 2
    gpu: bool = True
    note: str = ""  # what the call's executor or machine did differently, where its rows miss


def _proxy(call_dir: str, models: tuple[str, ...] = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v2-lite")):
    """The 1-GPU shards and the 2-GPU table of each proxy under one issue-16 call's tables/res/."""
    return tuple(tuple(f"{call_dir}/tables/res/{m}/layout_table-{m}-2L-{g}" for g in parts)
                 for m in models for parts in (("1-2026-11-27-gpu-shard0of2.json", "1-2026-11-27-gpu-shard1of2.json"),
                                               ("2-2026-11-27-gpu.json",)))


S1 = "gpu-2026-11-26-4xH200"
S3 = "gpu-2026-11-26-4xH200-s3"
S4 = "gpu-2026-11-26-4xH200-s4"
H100 = "issue16/acc-h100"
H100_1 = "issue16/acc-h100-1gpu"
CALLS: tuple[Call, ...] = (
    Call("tiny-moe, 4 CPU ranks", "2026-11-26 02:45", "—", "cpu-calibrated-2026-11-26.json",
         (("layout_table-tiny-moe-4-2026-11-26-cpu.json",),), layers=None, gpu=False,
         note="4 gloo ranks on 2 logical CPUs shared with other work, measured 0.7-12x the prediction; the same "
              "`foldtune tune` from two fresh clones predicted its steps 40-60 % and 4-33 % short (README)"),
    Call("small-moe, 2 × H200", "2026-11-26 03:17", "—", "h200-calibrated-2026-11-26-2xH200.json",
         (("layout_table-small-moe-2-2026-11-26-2xH200.json",),), layers=None),
    Call("Mixtral@2L, 4 × H200 (session 1)", "2026-11-26 05:19", "—", "h200-x4-calibrated-2026-11-26-4xH200.json",
         ((f"{S1}/layout_table-mixtral-2L-1-0601.json",),
          tuple(f"{S1}/layout_table-mixtral-2L-2-{x}.json" for x in ("4xH200-0525-shard0", "4xH200-0525-shard1",
                                                                      "redo-0559-shard0", "redo-0559-shard1")),
          (f"{S1}/layout_table-mixtral-2L-4-4xH200-0520.json", f"{S1}/layout_table-mixtral-2L-4-redo-0557.json")),
         note="the executor before its experts' gate and up projections became one grouped GEMM and the fp32 main "
              "gradients one buffer per bucket (docs/benchmarks.md, 2026-11-26 07:47): the same 1-GPU layout "
              "took 512 ms here, 457 ms at (O)"),
    Call("Mixtral@2L, 4 × H200 (session 3)", "2026-11-26 08:19", "e5878aa", f"{S3}/h200-x4-calibrated.json",
         ((f"{S3}/tables/layout_table-mixtral-8x7b-2L-1-2026-11-26-gpu.json",),
          tuple(f"{S3}/tables/layout_table-mixtral-8x7b-2L-2-2026-11-26-gpu-shard{i}of2.json" for i in (0, 1)),
          (f"{S3}/tables/layout_table-mixtral-8x7b-2L-4-2026-11-26-gpu.json",))),
    Call("Mixtral@2L, 4 × H200 (session 4)", "2026-11-26 10:21", "8d3ae61", f"{S4}/h200-x4-calibrated.json",
         ((f"{S4}/run-1027/table1/layout_table-mixtral-8x7b-2L-1-2026-11-26-gpu.json",),
          tuple(f"{S4}/run-1027/table2/layout_table-mixtral-8x7b-2L-2-2026-11-26-gpu-shard{i}of2.json" for i in (0, 1)),
          (f"{S4}/table4/layout_table-mixtral-8x7b-2L-4-2026-11-26-gpu.json",))),
    Call("three proxies, 2 × H100 (A)", "2026-11-27 02:13", "8226803", f"{H100}/h100-sxm-calibrated.json",
         tuple(tuple(f"{H100}/{m}/layout_table-{m}-2L-{g}" for g in parts)
               for m in ("mixtral-8x7b", "deepseek-v2-lite")
               for parts in (("1-2026-11-27-gpu-shard0of2.json", "1-2026-11-27-gpu-shard1of2.json"),
                             ("2-2026-11-27-gpu.json",)))
         + ((f"{H100}/qwen3-30b-a3b/layout_table-qwen3-30b-a3b-2L-1-from-log.json",),
            (f"{H100}/qwen3-30b-a3b/layout_table-qwen3-30b-a3b-2L-2-from-log.json",)),
         note="measured before the loss's Triton kernels (0d53194) that the model prices now: the output layer and "
              "loss took 254 ms of Qwen3's 427 ms 1-GPU step on the H100 of (B), 130 ms of 277 ms at (O)"),
    Call("three proxies, 1 × H100 (B)", "2026-11-27 02:49", "81b057f", f"{H100_1}/h100-sxm-x1-calibrated.json",
         tuple((f"{H100_1}/{m}/layout_table-{m}-2L-1-2026-11-27-gpu.json",)
               for m in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v2-lite")),
         note="as (A): before the loss's Triton kernels (DeepSeek-V2-Lite's loss 174 ms of 315 ms here, 90 of 220 "
              "at (O)); the peaks are of that loss's whole fp32 logits"),
    Call("three proxies, 2 × H200 (D)", "2026-11-27 05:47", "2950abf", "issue16/h200-0545/h200-calibrated.json",
         _proxy("issue16/h200-0545")),
    Call("Qwen3@2L, 2 × H200 (E)", "2026-11-27 07:48", "48c52db", "issue16/h200-0746/h200-calibrated.json",
         _proxy("issue16/h200-0746", ("qwen3-30b-a3b",))),
    Call("three proxies, 2 × H200 (H)", "2026-11-27 08:19", "5099762", "issue16/h200-0816/h200-calibrated.json",
         _proxy("issue16/h200-0816")),
    Call("three proxies, 2 × H200 (K)", "2026-11-27 10:44", "f6e8e21", "issue16/h200-1042/h200-calibrated.json",
         _proxy("issue16/h200-1042")),
    Call("three proxies, 2 × H200 (O)", "2026-11-27 12:51", "5cb7b49", "issue16/h200-1248/h200-calibrated.json",
         _proxy("issue16/h200-1248")),
)


def priced_rows(call: Call, results: Path = RESULTS) -> list[dict]:
    """Every measured row of ``call``'s tables re-priced with its profile, tagged with the call and GPU count."""
    out = []
    for shards in call.tables:
        loaded = [json.loads((results / p).read_text()) for p in shards]
        table = loaded[0] if len(loaded) == 1 else merge_tables(loaded, loaded[0]["model"], ",".join(shards))
        training = {**DEFAULT_TRAINING, **{k: v for k, v in (table.get("training") or {}).items()
                                           if k in DEFAULT_TRAINING}}
        model, training_spec, cluster = build_specs(
            table["model"].split("@")[0], table["world_size"], profile=str(results / call.profile),
            layers=call.layers, distributed_optimizer=True, **training)
        rows, _ = compare(model, training_spec, cluster, table["rows"])
        out += [dict(r, call=call.label, gpus=table["world_size"], model=table["model"]) for r in rows]
    return out


def worst_provenance(row: dict) -> str:
    """The least certain provenance among the terms a row's step is made of."""
    found = set(row.get("provenance", {}).values())
    return max((p for p in found if p in PROVENANCES), key=PROVENANCES.index, default="measured")


def unlisted(results: Path = RESULTS) -> list[str]:
    """Layout tables under ``results`` that no call of :data:`CALLS` lists."""
    listed = {p for call in CALLS for shards in call.tables for p in shards}
    return sorted(str(p.relative_to(results)) for p in results.rglob("layout_table-*.json")
                  if str(p.relative_to(results)) not in listed)


def head_commit() -> str:
    """The checked-out commit (short), with '+changes' when the tree differs from it."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+changes" if dirty else "")


def summarize(rows: list[dict]) -> dict:
    """Coverage by call, by the rows' least certain provenance, over the GPU rows and over every row."""
    by_call = {call.label: interval_coverage([r for r in rows if r["call"] == call.label]) for call in CALLS}
    by_provenance = {p: interval_coverage([r for r in rows if worst_provenance(r) == p]) for p in PROVENANCES}
    gpu_calls = {call.label for call in CALLS if call.gpu}
    return {"by_call": by_call, "by_provenance": {p: c for p, c in by_provenance.items() if c["step_time"]["rows"]},
            "gpu": interval_coverage([r for r in rows if r["call"] in gpu_calls]),
            "all": interval_coverage(rows)}


def _pct(c: dict) -> str:
    return "—" if c["coverage"] is None else f"{c['covered']}/{c['rows']} = {c['coverage']:.1%}"


def doc_section(result: dict) -> str:
    s = result["summary"]
    lines = [HEADING, "",
             (f"**Re-priced**: the tables below were measured at the commits named (— where the session's notes "
              f"name none), and priced at {result['priced_at']} on {result['evaluated_at']} by "
              f"`python3 -m bench.interval_coverage`, each with the calibrated profile its own call measured (no "
              f"component factors). The intervals are meant to hold the measurement at {RATE:.0%} of layouts "
              "(docs/time-model.md, \"Intervals\"); a row is covered when its measured step (peak allocated "
              "memory) lies inside."), "",
             "| call | measured | code | step time covered | below / above | memory covered | mean width |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for call in CALLS:
        c = s["by_call"][call.label]
        width = c["mean_relative_width"]
        lines.append(f"| {call.label} | {call.measured} | {call.code} | {_pct(c['step_time'])} | "
                     f"{c['step_time']['below']} / {c['step_time']['above']} | {_pct(c['memory'])} | "
                     + ("—" if width is None else f"{width:.0%}") + " |")
    for label, c in (("**every GPU row**", s["gpu"]), ("**every row**", s["all"])):
        lines.append(f"| {label} | | | **{_pct(c['step_time'])}** | {c['step_time']['below']} / "
                     f"{c['step_time']['above']} | {_pct(c['memory'])} | {c['mean_relative_width']:.0%} |")
    lines += ["", "By the least certain provenance among a row's terms:", "",
              "| provenance | step time covered | below / above | mean width |", "| --- | ---: | ---: | ---: |"]
    for p, c in s["by_provenance"].items():
        lines.append(f"| {p} | {_pct(c['step_time'])} | {c['step_time']['below']} / {c['step_time']['above']} | "
                     f"{c['mean_relative_width']:.0%} |")
    notes = [(call.label, call.note) for call in CALLS if call.note]
    if notes:
        lines += ["", "Where rows miss, what their call measured differently from what the model prices now:", ""]
        lines += [f"- {label}: {note}." for label, note in notes]
    if result["not_judged"]:
        lines += ["", "Not judged (no call listed for them): " + ", ".join(f"`{p}`" for p in result["not_judged"])]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only: no JSON, no docs/benchmarks.md")
    args = parser.parse_args()
    rows = [r for call in CALLS for r in priced_rows(call)]
    summary = summarize(rows)
    result = {"priced_at": head_commit(), "evaluated_at": utc_now(), "rate": RATE, "summary": summary,
              "not_judged": unlisted(),
              "rows": [{k: r.get(k) for k in ("call", "model", "gpus", "layout", "measured_s", "predicted_s",
                                               "interval_s", "measured_peak_bytes", "predicted_memory_bytes",
                                               "memory_interval_bytes")} | {"provenance": worst_provenance(r)}
                       for r in rows]}
    print(f"{'call':<36} {'step time covered':>22} {'below/above':>12} {'memory covered':>20} {'width':>6}")
    for call in CALLS:
        c = summary["by_call"][call.label]
        print(f"{call.label:<36} {_pct(c['step_time']):>22} {c['step_time']['below']:>5} / {c['step_time']['above']:<4}"
              f" {_pct(c['memory']):>20} {c['mean_relative_width']:>6.0%}")
    for label, c in (("every GPU row", summary["gpu"]), ("every row", summary["all"])):
        print(f"{label:<36} {_pct(c['step_time']):>22} {c['step_time']['below']:>5} / {c['step_time']['above']:<4}"
              f" {_pct(c['memory']):>20} {c['mean_relative_width']:>6.0%}")
    for p, c in summary["by_provenance"].items():
        print(f"  least certain term {p:<20} {_pct(c['step_time']):>22}")
    if result["not_judged"]:
        print("not judged: " + ", ".join(result["not_judged"]))
    if not args.no_write:
        path = save_json(result, f"interval_coverage-{result['priced_at'].split('+')[0]}.json")
        replace_section(HEADING, doc_section(result))
        print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
