"""Checks of issue 20's GPU bar, read from a tuning job's trials in the SQLite service database.

    python3 -m bench.multinode_check placement --db FILE [--job N] [--gpus-per-node G] [--want-gpus K]
    python3 -m bench.multinode_check overlap   --db FILE [--job N]

``placement``: every succeeded trial's ranks ran where the planner put them (ranks kG..kG+G-1 on one Ray
node, G the job's GPUs per node from its ``calibration.ray_cluster``), no two ranks on one GPU, and, with
``--want-gpus K``, each trial's ranks on K distinct GPUs. ``overlap``: the succeeded trials that ran at the
same time (their ``measurement.run_window`` intervals, Unix seconds, intersect), printed with UTC
timestamps, on disjoint GPUs; at least one such pair is required. Exit status 0 when the check holds, 1 when
not. It reads the database with ``sqlite3`` (no SQLAlchemy), so it runs on a GPU box with torch and the
wheelhouse alone; the job defaults to the newest one in the database.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sqlite3
import sys
from typing import Any

from executor.placement_audit import overlapping_pairs, placement_problems, rank_devices, shared_gpus


def load_trials(db_path: str, job_id: int | None = None) -> tuple[int, dict[str, Any], list[dict[str, Any]]]:
    """(job id, its calibration dict, its trials as dicts: number, status, failure_kind, measurement)."""
    con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        if job_id is None:
            row = con.execute("SELECT max(id) FROM jobs").fetchone()
            if row is None or row[0] is None:
                raise SystemExit(f"{db_path}: no job")
            job_id = int(row[0])
        cal = con.execute("SELECT calibration FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if cal is None:
            raise SystemExit(f"{db_path}: no job {job_id}")
        rows = con.execute("SELECT number, status, failure_kind, failure_reason, measurement FROM trials "
                           "WHERE job_id = ? ORDER BY number", (job_id,)).fetchall()
    finally:
        con.close()
    trials = [{"number": n, "status": s, "failure_kind": k, "failure_reason": r, "measurement": _json(m) or {}}
              for n, s, k, r, m in rows]
    return job_id, _json(cal[0]) or {}, trials


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _utc(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%H:%M:%S.%f")[:-3]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("check", choices=("placement", "overlap"))
    parser.add_argument("--db", required=True, help="the SQLite service database (foldtune.sqlite3)")
    parser.add_argument("--job", type=int, help="job id (default: the newest job)")
    parser.add_argument("--gpus-per-node", type=int, help="default: the job's calibration.ray_cluster")
    parser.add_argument("--want-gpus", type=int, help="placement: distinct GPUs each trial must use")
    args = parser.parse_args(argv)
    job_id, cal, trials = load_trials(args.db, args.job)
    for t in trials:
        m = t["measurement"]
        window = m.get("run_window") or []
        when = f"{_utc(window[0])} .. {_utc(window[1])} UTC" if len(window) == 2 else "-"
        print(f"job {job_id} trial {t['number']}: {t['status']:9s} {when}  ranks on "
              f"{rank_devices(m.get('placement') or [])}" + (f"  ({t['failure_reason']})" if t["failure_reason"] else ""))
    if args.check == "placement":
        per_node = args.gpus_per_node or (cal.get("ray_cluster") or {}).get("gpus_per_node")
        if not per_node:
            print("no gpus_per_node: pass --gpus-per-node")
            return 1
        problems = placement_problems(trials, per_node, args.want_gpus)
        print("\n".join(problems) if problems else f"placement ok: ranks where the planner put them ({per_node} "
                                                   f"per node), no GPU shared")
        return 1 if problems else 0
    pairs = overlapping_pairs(trials)
    bad = [(a, b) for a, b, _ in pairs if shared_gpus(trials, a, b)]
    for a, b, both in pairs:
        print(f"trials {a} and {b} ran side by side for {both:.1f} s"
              + (f" ON SHARED GPUs {sorted(shared_gpus(trials, a, b))}" if (a, b) in bad else " on disjoint GPUs"))
    if not pairs:
        print("no two trials ran at the same time")
    return 0 if pairs and not bad else 1


if __name__ == "__main__":
    sys.exit(main())
