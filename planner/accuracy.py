"""The cost model's accuracy against measured layout tables: each measured layout predicted and compared
(step time, peak memory, and per term where the executor times a matching phase, read on the rank that sets
the pace), summarised as MAPE, max error and Spearman rank correlation; tables of several GPU counts pooled;
the held-out error after calibrating on the first ``k`` trials the search would run; the coverage of the
estimates' intervals (how many measured steps and peaks fall inside them, :func:`interval_coverage`); and
measured host seconds per micro-batch against the model's host floor.

A layout table is what ``executor.profile_table.measure_table`` returns (rows with ``layout``, ``config``,
``ok``, ``step_time`` in seconds, ``phases``/``phases_by_rank`` in seconds, ``peak_allocated_bytes``);
``bench/costmodel_accuracy.py`` and ``bench/accuracy_bars.py`` print and store what this module computes.
Errors are relative: (predicted - measured) / measured.
"""

from __future__ import annotations

import math
import statistics

from costmodel.estimate import estimate
from costmodel.step_time import host_seconds_per_micro_batch
from planner.calibration import Observation, fit_calibration
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


def merge_tables(tables: list[dict], model_name: str, source: str) -> dict:
    """One table from the shards of one measurement (rows concatenated; the first shard's header). ValueError,
    naming ``source``, where a shard was measured on another model or world size."""
    for t in tables:
        if t.get("model") not in (None, model_name):
            raise ValueError(f"{source}: measured on {t['model']!r}, not {model_name!r} "
                             "(pass the same --model/--layers)")
        if t.get("world_size") != tables[0].get("world_size"):
            raise ValueError(f"{source}: shards of different world sizes {[x.get('world_size') for x in tables]}")
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
        if e.interval is not None:
            row.update(interval_s=(e.interval.step_time.low, e.interval.step_time.high),
                       memory_interval_bytes=(e.interval.memory.low, e.interval.memory.high),
                       provenance={p.term: p.provenance for p in e.interval.terms
                                   if e.time.term(p.term) > 0 or dict(e.time.hidden).get(p.term, 0.0) > 0})
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
    summary["interval_coverage"] = interval_coverage(rows)
    return summary


def interval_coverage(rows: list[dict]) -> dict:
    """How many measured values fall inside their predicted intervals, over rows of :func:`compare`.

    Step time: rows with ``measured_s`` and ``interval_s`` (low, high) in seconds; memory: rows with
    ``measured_peak_bytes`` and ``memory_interval_bytes``. Returns, for each of ``'step_time'`` and ``'memory'``,
    ``{'rows', 'covered', 'coverage', 'below', 'above'}``: the rows judged, those inside (ends included), their
    share (None without rows), and the rows measured below the low end / above the high end; and the mean
    relative width of the step-time intervals ``(high - low) / predicted``."""
    def judge(pairs: list[tuple[float, tuple[float, float]]]) -> dict:
        below = sum(1 for v, (lo, _) in pairs if v < lo)
        above = sum(1 for v, (_, hi) in pairs if v > hi)
        covered = len(pairs) - below - above
        return {"rows": len(pairs), "covered": covered, "coverage": covered / len(pairs) if pairs else None,
                "below": below, "above": above}
    timed = [(r["measured_s"], r["interval_s"]) for r in rows if r.get("interval_s") and r.get("measured_s")]
    peaks = [(r["measured_peak_bytes"], r["memory_interval_bytes"]) for r in rows
             if r.get("memory_interval_bytes") and r.get("measured_peak_bytes")]
    widths = [(r["interval_s"][1] - r["interval_s"][0]) / r["predicted_s"] for r in rows
              if r.get("interval_s") and r.get("predicted_s")]
    return {"step_time": judge(timed), "memory": judge(peaks),
            "mean_relative_width": statistics.fmean(widths) if widths else None}


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
    out.pop("interval_coverage")
    out.update(k=k, fitted_on=[r["layout"] for r in tried], calibration=calibration.to_dict())
    return out


def pooled(model: str, layers: int, tables: list[dict], seq: int, gbs: int, precision: str, **hardware) -> dict:
    """Rows of every table priced on its own GPU count (``world_size``) with ``hardware`` (build_specs' gpu= or
    profile=), each tagged with ``gpus``, and the pooled summary: step-time MAPE, max error and Spearman over all
    rows, the same over the 2-GPU rows alone (pooling GPU counts ranks mostly by GPU count), peak-memory errors."""
    rows = []
    for table in tables:
        spec, training, cluster = build_specs(model, table["world_size"], layers=layers, seq_length=seq,
                                              global_batch_size=gbs, precision=precision,
                                              distributed_optimizer=True, **hardware)
        priced, _ = compare(spec, training, cluster, table["rows"])
        rows += [dict(r, gpus=table["world_size"]) for r in priced]
    two = [r for r in rows if r["gpus"] == 2]
    mem = [r["memory_error"] for r in rows if "memory_error" in r]
    return {"rows": rows, "layouts": len(rows),
            "mape": statistics.fmean(abs(r["error"]) for r in rows),
            "max_error": max(abs(r["error"]) for r in rows),
            "spearman": spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]),
            "spearman_2gpu": spearman([r["predicted_s"] for r in two], [r["measured_s"] for r in two]) if two else None,
            "mape_2gpu": statistics.fmean(abs(r["error"]) for r in two) if two else None,
            "memory_mape": statistics.fmean(abs(m) for m in mem) if mem else None,
            "memory_worst_under": min(mem) if mem else None,
            "memory_worst_over": max(mem) if mem else None}


def host_floor_ratios(probe: dict, profile: str) -> list[dict]:
    """Each measured layout of a stored host probe (``bench/host_probe_gpu.py``'s JSON) against the model's host
    floor per micro-batch (base + full recomputation, busiest stage) under the profile file ``profile``:
    [{'layout', 'measured_ms', 'model_ms', 'ratio'}] (milliseconds; ratio measured / model)."""
    training = probe["training"]
    model = probe["model"].split("@")[0]
    layers = int(probe["model"].split("@")[1][:-1]) if "@" in probe["model"] else None
    out = []
    for r in probe["results"]:
        if "failure" in r:
            continue
        config = ParallelConfig.from_dict(r["config"])
        spec, train, cluster = build_specs(model, config.world_size, layers=layers, profile=profile,
                                           seq_length=training["seq_length"],
                                           global_batch_size=training["global_batch_size"],
                                           precision=training["precision"])
        base, recompute = host_seconds_per_micro_batch(spec, train, cluster, config)
        model_ms = (base + recompute) * 1e3
        out.append({"layout": r["layout"], "measured_ms": r["host_ms_per_micro_batch"], "model_ms": model_ms,
                    "ratio": r["host_ms_per_micro_batch"] / model_ms})
    return out
