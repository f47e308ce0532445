"""metrics.csv and TensorBoard events beside the checkpoints: a resume from an earlier checkpoint replaces the
steps the previous run measured past it, so each step appears once with the resumed run's values."""

from __future__ import annotations

import csv
from dataclasses import fields

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from executor.train.loop import PER_LAYER_FIELDS, StepMetrics
from executor.train.metrics_log import MetricsLog


COLUMNS = [f.name for f in fields(StepMetrics) if f.name not in PER_LAYER_FIELDS]


def _step(step: int, loss: float) -> StepMetrics:
    return StepMetrics(step=step, loss=loss, ce=loss, router_loss=0.0, lr=1e-3, grad_norm=1.0, step_time_s=0.01,
                       tokens_per_s=100.0, tflops_per_gpu=0.1, expert_load_max=2.0, expert_load_mean=1.0,
                       eval_loss=loss + 1 if step == 4 else None)


def test_a_resume_replaces_the_steps_after_its_checkpoint(tmp_path):
    log = MetricsLog(tmp_path, 0, COLUMNS)
    for step in range(5):  # the first run measured steps 0..4, but its last checkpoint is at step 3
        log.write(_step(step, 10.0 - step))
    log.close()
    log = MetricsLog(tmp_path, 3, COLUMNS)
    for step in (3, 4, 5):
        log.write(_step(step, 100.0 + step))
    log.close()
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    # numbered from 1, as the CLI, API and dashboard count steps: index 3 is step 4
    assert [(r["step"], float(r["loss"])) for r in rows] == [("1", 10.0), ("2", 9.0), ("3", 8.0), ("4", 103.0),
                                                             ("5", 104.0), ("6", 105.0)]
    assert rows[4]["eval_loss"] == "105.0" and rows[3]["eval_loss"] == ""
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 10.0), (2, 9.0), (3, 8.0), (4, 103.0),
                                                                         (5, 104.0), (6, 105.0)]
    assert "train/tokens_per_s" in events.Tags()["scalars"] and "train/peak_memory_bytes" not in events.Tags()["scalars"]


def test_without_the_tensorboard_package_the_run_keeps_its_csv(tmp_path, monkeypatch):
    from executor.train import metrics_log

    monkeypatch.setattr(metrics_log, "SummaryWriter", None)  # as on a GPU image with torch alone
    with __import__("pytest").warns(UserWarning, match="no TensorBoard event files"):
        log = MetricsLog(tmp_path, 0, COLUMNS)
    log.write(_step(0, 1.0))
    log.close()
    assert (tmp_path / "metrics.csv").read_text().count("\n") == 2 and not (tmp_path / "tensorboard").exists()
