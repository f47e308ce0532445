"""The README's main job, run as a new user runs it: ``foldtune tune`` in a fresh HOME (so it calibrates this
machine first), several times, and how far its raw predictions land from the measured steps.

Each run starts ``foldtune tune`` (the embedded defaults: tiny-moe on four CPU ranks) with a new empty HOME and no
``FOLDTUNE_*`` variable, reads its measured-vs-predicted table, and reports per trial the raw error
(predicted − measured) / measured of the cost model's prediction (the "predicted" column: the calibrated profile,
before the search's online fit) and per run the median |error| (issue 41's bar: ≤ 25 % on a quiet machine). The
machine's load average before each run and a Python loop's speed are printed with it: the same machine differs by
tens of percent from day to day.

    python3 -m bench.tune_accuracy [--runs 5] [--gpu cpu] [--no-write]

``--gpu`` is passed to ``foldtune tune`` (on a host with GPUs tune's default is its GPU; ``--gpu cpu`` runs the
README's CPU demo there too).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from bench.report import machine, replace_section, save_json, utc_now

HEADING = "## `foldtune tune` on the development machine: raw predictions against measured steps"
# a row of tune's measured-vs-predicted table: number, layout, state, predicted, calibrated, measured, error
ROW = re.compile(r"^\s+(\d+)\s+(tp\d.*?)\s+(\S+)\s+([0-9.]+|-)\s+([0-9.]+|-)\s+([0-9.]+|-)\s+(\S+)\s*$")
BAR = 0.25


def python_loop_seconds() -> float:
    """Seconds of a 10M-iteration Python add loop: how fast this machine's cores are today."""
    start = time.perf_counter()
    total = 0
    for i in range(10_000_000):
        total += i
    return time.perf_counter() - start


def trial_errors(output: str) -> list[dict]:
    """The trials of tune's table that have both a prediction and a measurement: layout, state, seconds, error."""
    rows = []
    table = output.split("measured vs predicted", 1)[-1]
    for line in table.splitlines():
        match = ROW.match(line)
        if not match or "-" in (match[4], match[6]):
            continue
        predicted, measured = float(match[4]), float(match[6])
        rows.append({"layout": match[2], "state": match[3], "predicted_s": predicted, "measured_s": measured,
                     "error": (predicted - measured) / measured})
    return rows


def run_once(timeout_s: float, tune_args: list[str]) -> dict:
    """One ``foldtune tune`` (with ``tune_args``) in a fresh HOME; its rc, seconds, trials and median |error|."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FOLDTUNE_")}
    with tempfile.TemporaryDirectory(prefix="tune-accuracy-") as home:
        env["HOME"] = home
        load = os.getloadavg()[0]
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", "from api.cli.main import main; main()", "tune", *tune_args],
                              env=env,
                              capture_output=True, text=True, timeout=timeout_s)
        seconds = time.perf_counter() - start
    trials = trial_errors(proc.stdout)
    median = statistics.median(abs(t["error"]) for t in trials) if trials else None
    return {"rc": proc.returncode, "seconds": seconds, "load": load, "trials": trials, "median_abs_error": median,
            "tail": proc.stdout[-2000:] + proc.stderr[-2000:] if proc.returncode else ""}


def short(layout: str) -> str:
    """A trial's layout in a few words: the sizes that differ from 1 and its knobs."""
    words = [w for w in layout.split() if not re.fullmatch(r"(tp|cp|pp|vpp|ep|etp)1", w)]
    return " ".join(w for w in words if not w.startswith("edp") and w != "distopt=off")


def table(runs: list[dict]) -> str:
    lines = ["| run | load | rc | seconds | raw errors of the trials, in order | median \\|error\\| |",
             "|---:|---:|---:|---:|---|---:|"]
    for i, r in enumerate(runs, 1):
        errors = "; ".join(f"{short(t['layout'])} {t['error']:+.0%}" for t in r["trials"]) or "-"
        median = f"{r['median_abs_error']:.1%}" if r["median_abs_error"] is not None else "-"
        lines.append(f"| {i} | {r['load']:.1f} | {r['rc']} | {r['seconds']:.0f} | {errors} | {median} |")
    return "\n".join(lines)


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    return out + ("+dirty" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="tune runs, one after another (default 5)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before one run is stopped")
    parser.add_argument("--gpu", help="passed to foldtune tune (default: tune's own)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)
    if not 1 <= args.runs <= 50:
        parser.error("--runs must be between 1 and 50")
    loop = python_loop_seconds()
    when, code = utc_now(), commit()
    print(f"{machine()}, {os.cpu_count()} CPUs, Python 10M-add loop {loop:.2f} s, commit {code}, {when}", flush=True)
    runs = []
    for i in range(args.runs):
        r = run_once(args.timeout, ["--gpu", args.gpu] if args.gpu else [])
        runs.append(r)
        median = f"{r['median_abs_error']:.1%}" if r["median_abs_error"] is not None else "-"
        print(f"run {i + 1}: rc {r['rc']}, {r['seconds']:.0f} s, load {r['load']:.1f}, "
              f"{len(r['trials'])} trials, median |error| {median}", flush=True)
        if r["rc"]:
            print(r["tail"], file=sys.stderr)
    print(table(runs))
    medians = [r["median_abs_error"] for r in runs if r["median_abs_error"] is not None]
    within = sum(m <= BAR for m in medians)
    summary = (f"{within} of {len(runs)} runs within the {BAR:.0%} bar"
               + (f"; medians {min(medians):.1%}–{max(medians):.1%}" if medians else ""))
    print(summary)
    if not args.no_write:
        save_json({"commit": code, "when": when, "machine": machine(), "python_loop_s": loop, "runs": runs},
                  "tune_accuracy.json")
        replace_section(HEADING, f"{HEADING}\n\n`python3 -m bench.tune_accuracy --runs {args.runs}` at {code}, {when}, "
                                 f"{machine()} (Python 10M-add loop {loop:.2f} s). Each run: `foldtune tune` in a fresh "
                                 f"HOME with no `FOLDTUNE_*` variable (it calibrates the machine first); errors are the "
                                 f"raw predictions' (predicted − measured) / measured; load is the 1-min load average "
                                 f"before the run.\n\n{table(runs)}\n\n{summary}.\n")
    return 0 if runs and all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
