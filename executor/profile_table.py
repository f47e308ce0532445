"""A layout table: a list of layouts profiled one after another on the local devices (GPUs with NCCL, else CPU
ranks with gloo), one row per layout, failures kept with their reason. It is the measured side of the cost
model's accuracy (``planner.accuracy``) and of the search-regret replay (``bench/search_regret.py``)."""

from __future__ import annotations

import time
from typing import Any, Callable

from executor.profile import profile_layout
from executor.rank_pool import LocalRankPool
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec


def measure_table(model: ModelSpec, training: TrainingSpec, configs: list[ParallelConfig], *, warmup: int,
                  steps: int, device: str, hardware: str | None, timeout_s: float,
                  on_row: Callable[[dict[str, Any]], None] | None = None, reuse: bool = True) -> list[dict[str, Any]]:
    """Profile every layout; one row per layout (failed ones keep their reason), each passed to ``on_row``.

    ``reuse``: the layouts run one after another in the same rank processes (:mod:`executor.rank_pool`;
    the process group, CUDA context and compiled kernels stay warm), else each in processes of its own.
    Times in the rows are seconds, memory bytes.
    """
    pool = LocalRankPool() if reuse else None
    try:
        return _measure_rows(model, training, configs, warmup, steps, device, hardware, timeout_s,
                             on_row, pool.launch if pool is not None else None)
    finally:
        if pool is not None:
            pool.close()


def _measure_rows(model: ModelSpec, training: TrainingSpec, configs: list[ParallelConfig], warmup: int, steps: int,
                  device: str, hardware: str | None, timeout_s: float,
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
