"""Rank 0's training metrics as files beside the checkpoints: ``metrics.csv`` (one row per optimizer step) and
TensorBoard event files under ``tensorboard/`` (``tensorboard --logdir <checkpoint dir>/tensorboard``).

A resumed run continues both: rows and events of steps at or after the step it resumes from (steps that the
previous run measured past its last checkpoint, which this run measures again) are dropped first, so every
step appears once, with the values of the run whose weights the checkpoints hold.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (a core dependency)

CSV_NAME = "metrics.csv"
TENSORBOARD_DIR = "tensorboard"


class MetricsLog:
    """Appends each step (a dataclass with a ``step`` field and the ``columns``) to ``<directory>/metrics.csv`` and
    as TensorBoard scalars ``train/<field>`` (``eval/loss`` for ``eval_loss``); ``start_step`` is the first step
    this run measures (0, or the step it resumed from)."""

    def __init__(self, directory: str | os.PathLike[str], start_step: int, columns: Sequence[str]) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.columns = list(columns)
        self.csv_path = self.dir / CSV_NAME
        kept = self._rows_before(start_step)
        with open(self.csv_path, "w", newline="") as f:  # rewritten once: the kept rows, then appended per step
            writer = csv.DictWriter(f, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(kept)
        self._csv = open(self.csv_path, "a", newline="")
        self._writer = csv.DictWriter(self._csv, fieldnames=self.columns)
        # purge_step drops events at or after start_step that an earlier run wrote past its last checkpoint
        self._tb = SummaryWriter(log_dir=str(self.dir / TENSORBOARD_DIR),
                                 purge_step=start_step if start_step > 0 else None)

    def _rows_before(self, start_step: int) -> list[dict]:
        if start_step == 0 or not self.csv_path.exists():
            return []
        with open(self.csv_path, newline="") as f:
            return [{k: row.get(k, "") for k in self.columns} for row in csv.DictReader(f)
                    if row.get("step", "").isdigit() and int(row["step"]) < start_step]

    def write(self, m: Any) -> None:
        row = asdict(m)
        self._writer.writerow({k: "" if row[k] is None else row[k] for k in self.columns})
        self._csv.flush()
        for name, value in row.items():
            if name == "step" or value is None:
                continue
            self._tb.add_scalar("eval/loss" if name == "eval_loss" else f"train/{name}", float(value), m.step)
        self._tb.flush()

    def close(self) -> None:
        self._csv.close()
        self._tb.close()
