"""`foldtune plan` of every catalog model at its published (or a stated) scale, timed as a whole process.

The issue-16 bar: each finishes in under 2 s, interpreter start, imports, enumeration, pruning, ranking and
printing included. Each run is ``python -m api.cli.main plan ...`` in a fresh process; the table reports its
wall time and its CPU time (user + system of the process and its planner workers: on a shared machine the
wall time grows with the load, the CPU time much less), with the load average beside them.

    python -m bench.catalog_plan_time                  # every catalog model, 3 runs each
    python -m bench.catalog_plan_time --models deepseek-v3,qwen3-235b-a22b --repeat 5 --json out.json

This is a benchmark, not a test: its numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BAR_SECONDS = 2.0
# model -> (GPUs, seq, global batch, where the scale comes from)
SCALES = {
    "deepseek-v3": (2048, 4096, 15360, "DeepSeek-V3 report: 2048 H800, 4K context, batch 15360"),
    "deepseek-v2-lite": (64, 4096, 4608, "assumed GPUs; DeepSeek-V2 paper's batch 4608 at 4K"),
    "gpt-oss-120b": (128, 4096, 1024, "assumed (not published)"),
    "mixtral-8x22b": (128, 4096, 256, "assumed (not published); the issue's case"),
    "mixtral-8x7b": (64, 4096, 512, "assumed (not published)"),
    "olmoe-1b-7b": (256, 4096, 1024, "OLMoE paper: 256 H100, 4096 tokens, ~4M tokens a batch"),
    "qwen2-57b-a14b": (128, 4096, 1024, "assumed (not published)"),
    "qwen3-235b-a22b": (256, 4096, 1024, "the issue's case"),
    "qwen3-30b-a3b": (64, 4096, 512, "assumed (not published)"),
    "byte-moe-650m": (8, 2048, 64, "this project's byte-level proxy, one node"),
    "small-moe": (8, 1024, 64, "test model, one node"),
    "tiny-moe": (8, 128, 16, "test model, one node"),
    "tiny-moe-shared": (8, 128, 16, "test model, one node"),
}


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def time_plan(model: str, gpu: str) -> dict:
    """One fresh `foldtune plan` process: wall and CPU seconds, its exit code and its best layout."""
    gpus, seq, gbs, _ = SCALES[model]
    cmd = [sys.executable, "-m", "api.cli.main", "plan", "--model", model, "--gpus", str(gpus), "--gpu", gpu,
           "--seq", str(seq), "--gbs", str(gbs), "--json", "--top", "10"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cpu0, t0 = _children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    best = None
    if proc.stdout.strip():
        ranked = json.loads(proc.stdout).get("ranked") or []
        best = ranked[0]["layout"] if ranked else None
    return {"model": model, "gpus": gpus, "wall_s": wall, "cpu_s": cpu, "rc": proc.returncode, "best": best,
            "stderr": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(SCALES), help="comma-separated catalog models")
    parser.add_argument("--gpu", default="h100-sxm", help="catalog hardware (default h100-sxm)")
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes per model (default 3)")
    parser.add_argument("--json", metavar="FILE", help="also write the runs as JSON")
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in SCALES]
    if unknown:
        parser.error(f"no scale for {unknown}; known: {', '.join(SCALES)}")
    load_before = os.getloadavg()[0]
    rows = []
    print(f"{'model':<18} {'GPUs':>5} {'wall s (median, min)':>21} {'CPU s':>6} {'< 2 s':>6}  best layout / error")
    for model in models:
        runs = [time_plan(model, args.gpu) for _ in range(args.repeat)]
        walls = [r["wall_s"] for r in runs]
        med, cpu = statistics.median(walls), statistics.median(r["cpu_s"] for r in runs)
        ok = "yes" if med < BAR_SECONDS else "NO"
        last = runs[-1]
        print(f"{model:<18} {last['gpus']:>5} {med:>13.2f}, {min(walls):>5.2f} {cpu:>6.2f} {ok:>6}  "
              f"{last['best'] or '(exit ' + str(last['rc']) + ') ' + last['stderr']}", flush=True)
        rows.append({"model": model, "scale": SCALES[model], "runs": runs})
    print(f"load average before / after: {load_before:.1f} / {os.getloadavg()[0]:.1f} "
          f"({os.cpu_count()} CPUs); wall times on a loaded machine overstate a quiet one's")
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": args.gpu, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
