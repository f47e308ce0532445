"""Measure a set of layouts once and keep the table: the shared input of the cost-model accuracy and
search-regret benchmarks (``bench/costmodel_accuracy.py``, ``bench/search_regret.py``).

The space is the planner's enumeration (``planner.enumerate``) under a benchmark ``SearchSpace``, minus
what the executor cannot run today (the executor rules of ``spec.validity``). Each layout is measured by
``executor.profile.profile_layout`` on the local devices (GPUs with NCCL, else CPU ranks with gloo).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

from spec.hardware import ClusterSpec
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec
from spec.validity import Validator
from executor.options import check_model_supported  # spec only, no torch
from planner.enumerate import enumerate_layouts

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "bench" / "results"


def executable_space(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, space) -> list[ParallelConfig]:
    """Every valid layout of the enumeration that the executor can build, in enumeration order."""
    check_model_supported(model)  # a model the executor cannot build fails loudly, not as an empty space
    validator = Validator(model, training, cluster)
    return [config for config in enumerate_layouts(model, training, cluster, space).configs()
            if not validator.executor(config)]


# The layout dimensions a subset must spread over (ParallelConfig fields; recompute and dispatcher are
# the knobs whose cost-model terms differ most besides the parallel sizes).
DIVERSITY_DIMS = ("tp", "cp", "pp", "vpp", "ep", "etp", "dp", "micro_batch_size", "recompute",
                  "moe_token_dispatcher_type", "sequence_parallel")


def _features(config: ParallelConfig) -> tuple[tuple[str, Any], ...]:
    d = config.to_dict()
    d["dp"] = config.dp
    d["recompute"] = (config.recompute_granularity, tuple(config.recompute_modules))
    return tuple((dim, d[dim]) for dim in DIVERSITY_DIMS)


def diverse_subset(configs: list[ParallelConfig], k: int) -> list[ParallelConfig]:
    """At most ``k`` layouts spread over :data:`DIVERSITY_DIMS`, deterministically (enumeration order kept).

    Greedy: each pick is the layout adding the most (dimension, value) pairs not yet covered, then the
    most pairs of such pairs (tp=2 with ep=1, ...), ties going to the earliest in enumeration order; so
    every value of every dimension appears before any combination repeats.
    """
    if k >= len(configs):
        return list(configs)
    feats = [_features(c) for c in configs]
    singles: set = set()
    pairs: set = set()
    chosen: list[int] = []
    left = list(range(len(configs)))
    while len(chosen) < k and left:
        def gain(i: int) -> tuple[int, int, int]:
            f = feats[i]
            new_pairs = sum((f[a], f[b]) not in pairs for a in range(len(f)) for b in range(a + 1, len(f)))
            return (sum(x not in singles for x in f), new_pairs, -i)
        best = max(left, key=gain)
        left.remove(best)
        chosen.append(best)
        f = feats[best]
        singles.update(f)
        pairs.update((f[a], f[b]) for a in range(len(f)) for b in range(a + 1, len(f)))
    return [configs[i] for i in sorted(chosen)]


def measure_table(model: ModelSpec, training: TrainingSpec, configs: list[ParallelConfig], *, warmup: int,
                  steps: int, device: str, hardware: str | None, timeout_s: float,
                  on_row: Callable[[dict[str, Any]], None] | None = None, reuse: bool = True) -> list[dict[str, Any]]:
    """Profile every layout; one row per layout (failed ones keep their reason), each passed to ``on_row``.

    ``reuse``: the layouts run one after another in the same rank processes (:mod:`executor.rank_pool`;
    the process group, CUDA context and compiled kernels stay warm), else each in processes of its own.
    """
    from executor.profile import profile_layout  # torch: a replayed --table never measures
    from executor.rank_pool import LocalRankPool

    pool = LocalRankPool() if reuse else None
    try:
        return _measure_rows(profile_layout, model, training, configs, warmup, steps, device, hardware, timeout_s,
                             on_row, pool.launch if pool is not None else None)
    finally:
        if pool is not None:
            pool.close()


def _measure_rows(profile_layout: Callable, model: ModelSpec, training: TrainingSpec, configs: list[ParallelConfig],
                  warmup: int, steps: int, device: str, hardware: str | None, timeout_s: float,
                  on_row: Callable[[dict[str, Any]], None] | None, launcher: Callable | None) -> list[dict[str, Any]]:
    rows = []
    for i, config in enumerate(configs, 1):
        start = time.monotonic()
        m = profile_layout(model, training, config, warmup_steps=warmup, timed_steps=steps, timeout_s=timeout_s,
                           device=device, hardware=hardware, launcher=launcher)
        rows.append({"layout": config.label(), "config": config.to_dict(), "ok": m.ok,
                     "failure_reason": m.failure_reason, "device": m.device, "step_time": m.step_time,
                     "step_times": m.step_times, "phases": m.phases, "peak_allocated_bytes": m.peak_allocated_bytes,
                     "peak_reserved_bytes": m.peak_reserved_bytes,
                     "static_allocated_bytes": m.static_allocated_bytes,
                     "static_after_step_allocated_bytes": m.static_after_step_allocated_bytes,
                     "tokens_per_expert": m.tokens_per_expert, "phases_by_rank": m.phases_by_rank,
                     "memory_by_rank": m.memory_by_rank,
                     "fixed_cost_s": m.fixed_cost_s, "startup_s": m.startup_s, "warmup_s": m.warmup_s,
                     "reused_ranks": m.reused_ranks})
        if on_row is not None:
            on_row(rows[-1])
        shown = f"{m.step_time * 1e3:9.2f} ms" if m.ok else f"failed: {m.failure_reason}"
        fixed = f", fixed cost {m.fixed_cost_s:.1f} s" if m.fixed_cost_s is not None else ""
        print(f"[{i}/{len(configs)}] {config.label():<60} {shown}  ({time.monotonic() - start:.0f} s{fixed})",
              flush=True)
    return rows


def machine() -> str:
    """The devices a table was measured on, in words."""
    try:
        import torch  # optional: a machine without torch is described by its CPU

        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs)"


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def save_json(data: dict, name: str, results_dir: Path = RESULTS) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / name
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def replace_section(heading: str, text: str, doc: Path = DOC) -> None:
    """Replace the section that starts with the line ``heading`` (up to the next '## ') or append it."""
    old = doc.read_text() if doc.exists() else ""
    start = old.find(heading + "\n")
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
    else:
        end = old.find("\n## ", start + len(heading))
        new = old[:start] + text.rstrip("\n") + "\n" + ("\n" + old[end + 1:] if end >= 0 else "")
    doc.write_text(new)
