"""Time and cost of a whole training run: how long N tokens take at a step time, and what the GPUs cost.

A run of ``tokens`` tokens takes ``ceil(tokens / tokens_per_step)`` optimizer steps, where one step trains
``global_batch_size × seq_length`` tokens (a partial last step is still a step). Its wall time is steps ×
step time (seconds); its GPU-hours are num_gpus × wall time / 3600; its cost, with a price per GPU-hour,
is GPU-hours × price (US dollars). Nothing else (start-up, checkpoint
writes, evaluation, failures) is counted: this is the steady-state training time the step time implies.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class TrainingRun:
    """``tokens`` asked for; ``tokens_per_step`` = global batch × sequence length; ``steps`` optimizer steps;
    ``step_time_s`` seconds per step; ``wall_s`` seconds in all; ``num_gpus``; ``gpu_hours``;
    ``price_per_gpu_hour`` (USD; None when not given) and ``cost_usd`` = gpu_hours × price (None without a
    price)."""

    tokens: int
    tokens_per_step: int
    steps: int
    step_time_s: float
    wall_s: float
    num_gpus: int
    gpu_hours: float
    price_per_gpu_hour: float | None
    cost_usd: float | None

    @property
    def wall_hours(self) -> float:
        return self.wall_s / SECONDS_PER_HOUR

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def training_run(tokens: int, step_time_s: float, seq_length: int, global_batch_size: int, num_gpus: int,
                 price_per_gpu_hour: float | None = None) -> TrainingRun:
    """The run that trains ``tokens`` tokens at ``step_time_s`` seconds per step of ``global_batch_size``
    sequences of ``seq_length`` tokens on ``num_gpus`` GPUs (see the module's docstring)."""
    if tokens < 1 or seq_length < 1 or global_batch_size < 1 or num_gpus < 1 or not step_time_s > 0:
        raise ValueError("tokens, seq_length, global_batch_size, num_gpus and step_time_s must be positive")
    per_step = seq_length * global_batch_size
    steps = -(-tokens // per_step)  # whole steps: the last one trains the remainder and costs a full step
    wall_s = steps * step_time_s
    gpu_hours = num_gpus * wall_s / SECONDS_PER_HOUR
    cost_usd = None if price_per_gpu_hour is None else gpu_hours * price_per_gpu_hour
    return TrainingRun(tokens=tokens, tokens_per_step=per_step, steps=steps, step_time_s=step_time_s,
                       wall_s=wall_s, num_gpus=num_gpus, gpu_hours=gpu_hours,
                       price_per_gpu_hour=price_per_gpu_hour, cost_usd=cost_usd)
