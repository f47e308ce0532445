"""Planner speed: full enumeration, memory pruning and ranking of every valid layout, timed in fresh processes.

The bar (issue 2): DeepSeek-V3 on 1024 H100 (seq 4096, global batch 8192) in under 2 s on the 2-core CI
machine. Each run is a new Python process, so the cost models' caches start cold as they do for a user;
the time reported is ``planner.plan`` itself (enumerate + prune + rank + the top-10 estimates), with the
interpreter start and imports reported beside it.

    python -m bench.plan_speed                 # the bar case and two more, 3 runs each, updates docs/benchmarks.md
    python -m bench.plan_speed --no-write      # print only
    python -m bench.plan_speed --cases deepseek-v3@1024 --repeat 5
    python -m bench.plan_speed --check-exact   # also compare the top 10 with an exhaustive ranking (minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.report import DOC, ROOT, replace_section
from planner.rank import plan
from spec.catalog import get_hardware, get_model
from spec.hardware import ClusterSpec
from spec.training_spec import TrainingSpec

SECTION = "## Planner speed"
BAR_CASE = "deepseek-v3@1024"
BAR_SECONDS = 2.0
# name@gpus -> (model, gpus, gpu, seq, global batch)
CASES = {
    "deepseek-v3@1024": ("deepseek-v3", 1024, "h100-sxm", 4096, 8192),
    "mixtral-8x22b@128": ("mixtral-8x22b", 128, "h100-sxm", 4096, 256),
    "qwen3-235b-a22b@256": ("qwen3-235b-a22b", 256, "h100-sxm", 4096, 1024),
}


def exact_check(case: str, workers: int | None) -> dict:
    """Run in a child process: the default ranking against the exhaustive one (every fitting config timed)."""
    model_name, gpus, gpu, seq, gbs = CASES[case]
    args = (get_model(model_name), TrainingSpec(seq_length=seq, global_batch_size=gbs),
            ClusterSpec(get_hardware(gpu), gpus))
    fast = plan(*args, top=10, workers=workers)
    full = plan(*args, top=10, exhaustive=True, workers=workers)
    same = [e.time.step_time for e in fast.ranked] == [e.time.step_time for e in full.ranked]
    return {"case": case, "same_top10": same, "exhaustive_time_calls": full.time_calls,
            "time_calls": fast.time_calls, "exhaustive_wall_s": full.enumerate_seconds + full.rank_seconds}


def one_run(case: str, workers: int | None) -> dict:
    """Run in a child process: time planner.plan on one case and return the numbers."""
    t_start = time.perf_counter()

    model_name, gpus, gpu, seq, gbs = CASES[case]
    model, cluster = get_model(model_name), ClusterSpec(get_hardware(gpu), gpus)
    training = TrainingSpec(seq_length=seq, global_batch_size=gbs)
    t_imported = time.perf_counter()
    cpu0 = _cpu_seconds()
    result = plan(model, training, cluster, top=10, workers=workers)
    wall = time.perf_counter() - t_imported
    best = result.best
    return {
        "case": case, "wall_s": wall, "cpu_s": _cpu_seconds() - cpu0, "import_s": t_imported - t_start,
        "enumerate_s": result.enumerate_seconds, "layouts": len(result.enumeration.layouts),
        "considered": result.enumeration.considered, "valid": result.enumeration.valid, "fitting": result.fitting,
        "memory_calls": result.memory_calls, "time_calls": result.time_calls, "workers": result.workers,
        "order_violations": result.order_violations, "bound_violations": result.bound_violations,
        "bound_calls": result.bound_calls,
        "best": best.config.label() if best else None, "best_step_s": best.time.step_time if best else None,
        "best_mfu": best.time.mfu if best else None,
    }


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def measure(case: str, repeat: int, workers: int | None) -> list[dict]:
    runs = []
    for _ in range(repeat):
        cmd = [sys.executable, __file__, "--child", case] + (["--workers", str(workers)] if workers else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True)
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return runs


def table(rows: list[tuple[str, list[dict]]]) -> list[str]:
    lines = ["| case | layouts | valid configs | fit in memory | memory / time estimates | workers | "
             "plan wall s (median, min) | CPU s | valid configs/s | best predicted layout (step s, MFU) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for case, runs in rows:
        r = runs[0]
        walls = [x["wall_s"] for x in runs]
        med = statistics.median(walls)
        lines.append(
            f"| {case} | {r['layouts']:,} | {r['valid']:,} | {r['fitting']:,} | {r['memory_calls']:,} / "
            f"{r['time_calls']:,} | {r['workers']} | {med:.2f}, {min(walls):.2f} | "
            f"{statistics.median(x['cpu_s'] for x in runs):.2f} | {r['valid'] / med:,.0f} | "
            f"`{r['best']}` ({r['best_step_s']:.2f}, {r['best_mfu']:.1%}) |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--repeat", type=int, default=3, help="fresh-process runs per case (default 3)")
    parser.add_argument("--workers", type=int, default=None, help="processes for the scan (default: the planner's)")
    parser.add_argument("--no-write", action="store_true", help=f"do not update {DOC.relative_to(ROOT)}")
    parser.add_argument("--check-exact", action="store_true",
                        help="also rank every case exhaustively and compare the top 10 (slow: minutes)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-exact", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_run(args.child, args.workers)))
        return 0
    if args.child_exact:
        print(json.dumps(exact_check(args.child_exact, args.workers)))
        return 0
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    load_before = os.getloadavg()
    rows = []
    for case in cases:
        runs = measure(case, args.repeat, args.workers)
        rows.append((case, runs))
        r = runs[0]
        med = statistics.median(x["wall_s"] for x in runs)
        print(f"{case}: {r['valid']:,} valid configs ({r['layouts']:,} layouts), {r['fitting']:,} fit; "
              f"plan {med:.2f} s median of {len(runs)} (imports {r['import_s']:.2f} s), "
              f"{r['valid'] / med:,.0f} configs/s; best {r['best']} at {r['best_step_s']:.2f} s")
    checks = []
    if args.check_exact:
        for case in cases:
            cmd = [sys.executable, __file__, "--child-exact", case] + (["--workers", str(args.workers)]
                                                                       if args.workers else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True)
            check = json.loads(proc.stdout.strip().splitlines()[-1])
            checks.append(check)
            print(f"{case}: top 10 {'equal to' if check['same_top10'] else 'DIFFERENT from'} the exhaustive ranking "
                  f"({check['time_calls']:,} vs {check['exhaustive_time_calls']:,} time estimates, exhaustive "
                  f"{check['exhaustive_wall_s']:.1f} s)")
    load_after = os.getloadavg()
    lines = table(rows)
    print("\n".join(lines))
    verdict = ""
    if BAR_CASE in dict(rows):
        med = statistics.median(x["wall_s"] for x in dict(rows)[BAR_CASE])
        verdict = (f"Bar ({BAR_CASE.replace('@', ' on ')} H100, seq 4096, GBS 8192, under {BAR_SECONDS:.0f} s): "
                   f"{'met' if med < BAR_SECONDS else 'NOT met'} — {med:.2f} s median.")
        print(verdict)
    if not args.no_write:
        date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        text = "\n".join([
            SECTION, "",
            f"Measured {date} on {cpu_model()} ({os.cpu_count()} logical CPUs), Python "
            f"{platform.python_version()}, by `python -m bench.plan_speed --repeat {args.repeat}`"
            + (f" --workers {args.workers}" if args.workers else "") + ". Each run is a fresh process (cold "
            "cost-model caches); 'plan wall' is `planner.plan` (enumerate, prune by memory, rank, build the top-10 "
            "estimates), without the interpreter start and imports "
            f"(~{statistics.median(r['import_s'] for _, runs in rows for r in runs):.2f} s). Load average "
            f"before/after: {load_before[0]:.1f} / {load_after[0]:.1f} (a shared machine: other jobs inflate "
            "wall times).",
            "",
            *lines,
            "",
            verdict,
            "",
            "Valid configs are every layout × micro-batch × dispatcher × recompute × optimizer setting of the "
            "search space (its caps are printed by `foldtune plan`). Memory is evaluated on a staircase per "
            "layout; time once per (tp, cp, ep, etp, dispatcher, micro-batch) group as a lower bound (the "
            "single-stage steady state), then only for candidates whose bound beats the 10th best time; see "
            "`planner/rank.py`. Monotone-property breaches seen in these runs (order / bound): "
            + ", ".join(f"{case} {runs[0]['order_violations']}/{runs[0]['bound_violations']}" for case, runs in rows)
            + ".",
            "",
            *([("Exactness (`--check-exact`): " + "; ".join(
                f"{c['case']} top 10 {'equal to' if c['same_top10'] else 'DIFFERENT from'} the exhaustive ranking "
                f"({c['time_calls']:,} vs {c['exhaustive_time_calls']:,} time estimates)" for c in checks) + "."), ""]
              if checks else []),
        ])
        replace_section(SECTION, text)
        print(f"updated {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
