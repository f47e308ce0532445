"""A training claimed by the runner: train its layout through the Ray launcher with
:func:`executor.train.loop.train_worker`, every step's metrics written to the database by rank 0, a
heartbeat from the runner, and a stop when the training is cancelled (or the runner shuts down).

Cancel path: rank 0 streams each step to the driver (:mod:`executor.progress`); when the heartbeat is
refused the driver answers "stop", rank 0 raises :class:`TrainingStopped` after storing that step, and
the launcher tears every rank down. A stopped training is not finished here: a cancelled one already is,
and one the runner gave up on (shutdown) goes back to the queue at once and resumes from its latest
checkpoint when claimed next.

Paths: a service runner (``data_root`` set) checks the stored ``data_path`` and ``checkpoint_dir`` again
against the owner's directory before it trains (api.service.paths: a symbolic link placed after
submission is refused here) and fails the training with the rule otherwise.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from api.service.checkpoint_space import checkpoint_space_problem
from api.service.errors import RuleViolation
from api.service.trainings import confined_paths, split_training_spec
from api.worker.metrics import DatabaseMetrics
from spec.hardware import HardwareProfile
from spec.model_spec import ModelSpec
from spec.multimodal import VisionLanguageSpec, stored_llm, stored_model
from spec.multimodal_layout import MultimodalLayout, layout_from_dict
from spec.parallel_config import ParallelConfig
from spec.router_options import FIELDS as ROUTER_FIELDS, RouterOptions
from db.models import Owner, Training
from db.queue import claim_next_training, finish_training, heartbeat_training, release_training
from executor import launch_ray, progress
from executor.options import ExecutorOptions
from executor.profile import peak_flops
from executor.train.loop import TrainConfig, train_worker
from executor.vlm.train_loop import vl_train_worker

log = logging.getLogger("foldtune.runner")

TRAINING_TIMEOUT_S = 7 * 24 * 3600.0


class TrainingStopped(Exception):
    """Rank 0 was told to stop (the training was cancelled or its runner is shutting down)."""


class RankStep:
    """``on_step`` of the training loop: hand the step to ``sink`` (rank 0 stores it), then stream it to
    the driver and stop when the driver says so. Module-level and holding only picklable state, so Ray
    can ship it to the ranks."""

    def __init__(self, sink: Callable) -> None:
        self.sink = sink

    def __call__(self, rank: int, metrics) -> None:
        self.sink(rank, metrics)
        if rank == 0 and progress.report_step(metrics.step, metrics.step_time_s):
            raise TrainingStopped(f"stopped after step {metrics.step + 1}")


def training_inputs(training: Training) -> tuple[ModelSpec | VisionLanguageSpec, ParallelConfig | MultimodalLayout,
                                                 ExecutorOptions, TrainConfig]:
    """What the training loop gets for a stored training: model, layout, executor options (the recipe's router
    options, model defaults decided) and the loop's settings; a vision-language model and its multimodal layout
    for a vision-language training."""
    model = stored_model(training.model_spec)
    config = layout_from_dict(training.config)
    spec, recipe = split_training_spec(training.training_spec)
    # Trainings stored before the router options were part of the recipe ran without them (defaults).
    router = RouterOptions.pick({key: recipe.pop(key) for key in ROUTER_FIELDS if key in recipe})
    options = ExecutorOptions.for_training(spec, router, stored_llm(training.model_spec))
    cfg = TrainConfig(training.data_path, steps=training.steps, seq_length=spec.seq_length,
                      global_batch_size=spec.global_batch_size, checkpoint_dir=training.checkpoint_dir,
                      checkpoint_every=training.checkpoint_every or 0, keep_last=training.keep_last or 0,
                      **recipe)
    return model, config, options, cfg


def run_training(training: Training, database_url: str, stop: threading.Event,
                 on_step: Callable[[int], None] | None = None) -> tuple[bool, str | None]:
    """Train the claimed ``training`` until its step budget, a failure or ``stop``; returns (ok, error).
    ``on_step(step)`` is called on the driver for every step rank 0 reports (1-based)."""
    model, config, options, cfg = training_inputs(training)
    spec, _ = split_training_spec(training.training_spec)
    vl = isinstance(model, VisionLanguageSpec)
    hardware = HardwareProfile.from_dict(training.cluster["hardware"])
    cpu = hardware.gpu.name.lower() == "cpu"
    peak = peak_flops(hardware.gpu.name, "fp32" if cpu else spec.precision, None)
    sink = RankStep(DatabaseMetrics(database_url, training.id, peak))

    def driver_step(step: int, _seconds: float) -> bool:
        if on_step is not None:
            on_step(step + 1)
        return stop.is_set()

    launcher = functools.partial(launch_ray.launch, on_step=driver_step, backend="gloo" if cpu else "nccl",
                                 timeout_s=TRAINING_TIMEOUT_S, placement_timeout_s=600.0,
                                 name=f"training-{training.id}")
    # a vision-language model trains through its own loop (executor.vlm.train_loop), as the multimodal layout
    result = launcher(vl_train_worker if vl else train_worker, config.world_size,
                      (model, config, options, cfg, sink, not cpu))
    if result.ok:
        return True, None
    return False, f"training {config.label()} failed: {result.failure_reason}"


def run_next_training(sessions: Callable, database_url: str, runner_id: str, heartbeat_s: float,
                      shutdown: threading.Event, data_root: str | Path | None = None) -> bool:
    """Claim the oldest queued training (db.queue) and run it (:func:`run_claimed_training`); False when
    none was queued."""
    with sessions() as session:
        training = claim_next_training(session, runner_id)
    if training is None:
        return False
    run_claimed_training(training, sessions, database_url, runner_id, heartbeat_s, shutdown, data_root=data_root)
    return True


def paths_problem(training: Training, sessions: Callable, data_root: str | Path) -> str | None:
    """Why the training's stored paths are not (any longer) inside its owner's directory under ``data_root``,
    or None when both are."""
    with sessions() as session:
        owner = session.get(Owner, training.owner_id)
        if owner is None:
            return "the training's owner no longer exists"
        try:
            confined_paths(training.data_path, training.checkpoint_dir, owner, data_root)
        except RuleViolation as exc:
            return str(exc)
    return None


def run_claimed_training(training: Training, sessions: Callable, database_url: str, runner_id: str,
                         heartbeat_s: float, shutdown: threading.Event,
                         on_step: Callable[[int], None] | None = None, data_root: str | Path | None = None) -> str:
    """Run a claimed training to its end, heartbeating every ``heartbeat_s`` seconds; ``on_step(step)``
    (1-based) runs on the driver after rank 0 stored each step. Ends it as succeeded or failed unless it
    was cancelled meanwhile or the runner is shutting down (then it is put back in the queue). ``data_root``:
    the service's data root, whose owner directory must still hold the training's paths (else it fails); None
    for the local CLI, which trusts them. Returns its status as this runner saw it."""
    problem = paths_problem(training, sessions, data_root) if data_root is not None else None
    if problem is None:  # the disk may have filled since submission: refuse before step 1, not at a save
        problem = checkpoint_space_problem(stored_model(training.model_spec), training.steps,
                                           training.checkpoint_every, training.keep_last, training.checkpoint_dir)
    if problem is not None:
        with sessions() as session:
            finish_training(session, training.id, runner_id, "failed", error=problem)
        log.warning("training %s refused: %s", training.id, problem)
        return "failed"
    stop = threading.Event()
    if shutdown.is_set():
        stop.set()

    def beat() -> None:
        while not stop.wait(heartbeat_s):
            try:
                with sessions() as session:
                    if not heartbeat_training(session, training.id, runner_id):
                        log.info("training %s: heartbeat refused (cancelled or reassigned); stopping", training.id)
                        stop.set()
            except Exception:  # a database hiccup: the next beat retries; the stale timeout is the backstop
                log.exception("training %s: heartbeat failed", training.id)
            if shutdown.is_set():
                stop.set()

    thread = threading.Thread(target=beat, daemon=True, name=f"heartbeat-training-{training.id}")
    thread.start()
    try:
        ok, error = run_training(training, database_url, stop, on_step)
    except Exception as exc:  # a bad stored spec or a launcher bug must not leave the training claimed
        log.exception("training %s: the runner failed", training.id)
        ok, error = False, f"runner error: {type(exc).__name__}: {exc}"
    stopped = stop.is_set()
    stop.set()
    thread.join(5)
    if stopped and not ok:
        log.info("training %s stopped: %s", training.id, error)
        if shutdown.is_set():  # not cancelled: give it back now rather than after the stale-claim timeout
            with sessions() as session:
                release_training(session, training.id, runner_id)
        return "stopped"
    status = "succeeded" if ok else "failed"
    with sessions() as session:
        finish_training(session, training.id, runner_id, status, error=error)
    log.info("training %s %s%s", training.id, status, f": {error}" if error else "")
    return status
