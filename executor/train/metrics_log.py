"""Rank 0's training metrics as files beside the checkpoints: ``metrics.csv`` (one row per optimizer step) and
TensorBoard event files under ``tensorboard/`` (``tensorboard --logdir <checkpoint dir>/tensorboard``).

Steps are counted from 1 (the step that ends with 1 optimizer update is step 1), as the CLI, the API and the
dashboard count them. A resumed run continues both: rows and events of the steps it measures again (those the
previous run measured past its last checkpoint) are dropped first, so every step appears once, with the
values of the run whose weights the checkpoints hold.

The event files need the ``tensorboard`` package (a dependency of foldtune's install); the executor itself
needs torch alone, so where it is missing (a bare GPU image) the run keeps ``metrics.csv`` and says once that
it writes no events.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import warnings

try:  # the tensorboard package: a dependency of foldtune's install, not of the executor (torch alone)
    from torch.utils.tensorboard import SummaryWriter
    _NO_TENSORBOARD = ""
except ImportError as exc:
    SummaryWriter = None
    _NO_TENSORBOARD = str(exc)

CSV_NAME = "metrics.csv"
TENSORBOARD_DIR = "tensorboard"


class MetricsLog:
    """Appends each step (a dataclass with a 0-based ``step`` index and the ``columns``, numbers; its other
    fields are left out) to ``<directory>/metrics.csv`` and as TensorBoard scalars ``train/<field>``
    (``eval/loss`` for ``eval_loss``), both numbered from 1; ``start_step`` is the optimizer steps already done
    (0, or the checkpoint's)."""

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
        self._tb = _summary_writer(self.dir / TENSORBOARD_DIR, start_step)

    def _rows_before(self, start_step: int) -> list[dict]:
        if start_step == 0 or not self.csv_path.exists():
            return []
        with open(self.csv_path, newline="") as f:
            return [{k: row.get(k, "") for k in self.columns} for row in csv.DictReader(f)
                    if row.get("step", "").isdigit() and int(row["step"]) <= start_step]

    def write(self, m: Any) -> None:
        row = {**asdict(m), "step": m.step + 1}
        self._writer.writerow({k: "" if row[k] is None else row[k] for k in self.columns})
        self._csv.flush()
        if self._tb is None:
            return
        for name in self.columns:
            value = row[name]
            if name == "step" or value is None:
                continue
            self._tb.add_scalar("eval/loss" if name == "eval_loss" else f"train/{name}", float(value), row["step"])
        self._tb.flush()

    def close(self) -> None:
        self._csv.close()
        if self._tb is not None:
            self._tb.close()


def _summary_writer(log_dir: Path, start_step: int):
    """A TensorBoard SummaryWriter on ``log_dir``, or None (with a warning) without the tensorboard package."""
    if SummaryWriter is None:
        warnings.warn(f"no TensorBoard event files ({_NO_TENSORBOARD or 'tensorboard missing'}); metrics.csv only. "
                      f"pip install tensorboard to add them", stacklevel=3)
        return None
    # purge_step drops the events of steps after the checkpoint's (numbered from 1) that an earlier run wrote
    return SummaryWriter(log_dir=str(log_dir), purge_step=start_step + 1 if start_step > 0 else None)
