"""Learning-rate schedule: linear warm-up then cosine decay to a floor."""

from __future__ import annotations

import math
from dataclasses import dataclass

from spec.errors import SpecError


@dataclass(frozen=True)
class LRSchedule:
    """``lr`` peak, reached after ``warmup_steps``; cosine decay to ``min_lr`` at ``decay_steps`` (then flat).

    A pure function of the step, so its only checkpoint state is the step itself.
    """

    lr: float
    min_lr: float = 0.0
    warmup_steps: int = 0
    decay_steps: int = 1

    def __post_init__(self) -> None:
        if not (self.lr > 0 and 0 <= self.min_lr <= self.lr):
            raise SpecError(f"need lr > 0 and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.warmup_steps < 0 or self.decay_steps < max(1, self.warmup_steps):
            raise SpecError(f"need 0 <= warmup_steps <= decay_steps and decay_steps >= 1, got "
                            f"warmup_steps={self.warmup_steps}, decay_steps={self.decay_steps}")

    def at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = self.decay_steps - self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / span) if span else 1.0
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))
