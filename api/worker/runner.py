"""The job runner (``foldtune runner``): claims queued tuning jobs from the database and runs them.

It is its own process, never the request handler. Several runners may share one PostgreSQL database
(claims use ``SKIP LOCKED``, see db.queue). Per job it

1. builds the ModelSpec / TrainingSpec / ClusterSpec stored with the job, with the GPUs per node that the
   Ray cluster has (read from Ray; ``FOLDTUNE_GPUS_PER_NODE`` overrides it, else the hardware profile's
   figure stands where Ray has no such nodes), asks the planner for the ranked fitting layouts the
   executor can run (:mod:`api.worker.candidates`; a job with ``search_precision`` gets those of each
   precision it searches, fp8 only where the GPU has an fp8 peak, and the job's events and result say what
   was left out), and runs as many trials side by side as the Ray cluster holds on disjoint devices (CPU
   ranks: on disjoint nodes);
2. runs :func:`planner.search.run_search` with the job's Optuna study (``job-<id>`` in the Optuna storage
   beside the service database), each trial a short profiled run through the Ray launcher
   (:mod:`api.worker.trials`), at the trial's own precision when the job searches it;
3. records every trial in the ``trials`` table when it starts and when it ends, keyed by (job, Optuna
   trial number), so a trial is stored exactly once even across restarts;
4. heartbeats the job (and its running trials) from a background thread; a heartbeat refused means the
   job was cancelled or given to another runner, and the running trial is abandoned at once (a trial about to
   start checks the job's status first, and the trials of a cancelled job end "cancelled", not lost);
5. ends the job with its best trial (``best_trial_id``) and, in ``calibration``, what the search learned:
   the calibration multipliers, the measured-vs-predicted table and why the search stopped.

On SIGTERM/SIGINT (``foldtune runner``; :meth:`Runner.stop`) the runner stops claiming, abandons its
running trial (failed as lost with the reason 'runner shut down') and puts the job back in the queue at
once, for itself or another runner. A runner restarted mid-job resumes it: under the same runner id it takes its job back at once, under
another one after the stale-claim timeout; the Optuna study resumes where it stopped (the trial that was
running is failed as 'lost' and measured again under a new number).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from api.service.paths import default_data_root
from api.worker.auto_profile import (AUTO_CALIBRATE_MODES, DATASHEET_SOURCE, PricingProfile, auto_profile_name,
                                     current_profile, pricing_profile, quick_calibration)
from api.worker.candidates import job_candidates, multimodal_job_candidates, repricer, stored_prediction
from api.worker.settings import DEFAULT_HEARTBEAT_S, DEFAULT_POLL_S, DEFAULT_STALE_AFTER_S, RunnerEnv
from api.worker.trainings import run_claimed_training, run_next_training
from api.worker.verify import run_verify
from api.worker.trials import (JobStopped, TrialExecutor, TrialSettings, fixed_cost_summary, is_cpu_cluster,
                               trial_settings_from_env)
from spec.errors import FoldtuneError, SpecError
from spec.failure import FailureKind
from spec.hardware import DEFAULT_MIN_HEADROOM, ClusterSpec, HardwareProfile
from spec.layout_codec import Labelled
from spec.model_spec import ModelSpec
from spec.multimodal import ImageInputs, VisionLanguageSpec, split_images
from spec.precision_search import split_precision_search
from spec.router_options import RouterOptions, split_router
from spec.training_spec import TrainingSpec
from db.engine import make_engine, make_sessionmaker, ping
from db.hardware_profiles import stored_profile, store_calibrated_profile
from db.jobs import job_claim, job_status
from db.migrate import upgrade
from db.models import Job, utcnow
from db.optuna_storage import ensure_optuna_storage
from db.queue import claim_job, claim_next_job, claim_training, finish_job, heartbeat_job, release_job, requeue_stale
from db.settings import database_settings
from db.trials import (fail_running_trials, heartbeat_running_trials, record_trial_finish, record_trial_start,
                       trial_by_number)
from executor import launch_ray
from planner.search import (ATTR_CONFIG, ATTR_FAILURE, ATTR_FAILURE_KIND, ATTR_LAYOUT, ATTR_PRECISION, ATTR_PRED_TIME,
                            SearchBudget, run_search)

log = logging.getLogger("foldtune.runner")
# The failure reason of a trial the runner abandoned on SIGTERM/SIGINT (kind 'lost': the layout is measured
# again under a new number when the job, released at once, is claimed next).
SHUTDOWN_REASON = "runner shut down"
CANCELLED_REASON = "the job was cancelled"
EventHook = Callable[[str, dict], None]


@dataclass(frozen=True)
class RunnerSettings:
    """Where the jobs are and how the runner paces itself (seconds). ``data_root``: the service's data root
    (FOLDTUNE_DATA_ROOT), inside whose owner directories a training's paths must lie when it runs; None
    trusts the stored paths (the local CLI's own trainings)."""

    database_url: str
    runner_id: str
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    stale_after_s: float = DEFAULT_STALE_AFTER_S
    poll_s: float = DEFAULT_POLL_S
    parallel_trials: int | None = None  # None: as many as fit the Ray cluster side by side (see _parallel_trials)
    gpus_per_node: int | None = None  # None: read from the Ray cluster (the planner's node boundary)
    trial: TrialSettings = field(default_factory=TrialSettings)
    data_root: Path | None = None
    # a job on a datasheet profile first calibrates its GPU type (api.worker.auto_profile): 'quick', 'minimal'
    # (tests) or 'off'; None: quick on GPU types, off on the CPU type (CPU runs are tests and smoke runs)
    auto_calibrate: str | None = None

    def __post_init__(self) -> None:
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise SpecError(f"GPUs per node must be >= 1, got {self.gpus_per_node}")
        if self.auto_calibrate is not None and self.auto_calibrate not in AUTO_CALIBRATE_MODES:
            raise SpecError(f"auto_calibrate must be one of {AUTO_CALIBRATE_MODES}, got {self.auto_calibrate!r}")

    def auto_calibrate_mode(self, hardware: HardwareProfile) -> str:
        if self.auto_calibrate is not None:
            return self.auto_calibrate
        return "off" if hardware.gpu.name.lower() == "cpu" else "quick"

    @classmethod
    def from_env(cls, database_url: str | None = None, runner_id: str | None = None,
                 environ: Mapping[str, str] | None = None) -> RunnerSettings:
        """Settings from FOLDTUNE_DATABASE_URL (or the data dir), FOLDTUNE_DATA_ROOT, the runner's variables
        (:class:`RunnerEnv`) and the trial settings (api.worker.trials), of ``environ`` (default: the process
        environment); ``database_url`` and ``runner_id`` win over their variables."""
        env, trial = RunnerEnv.read(environ), trial_settings_from_env(environ)  # each names its bad variable
        try:
            return cls(database_url=database_settings(database_url, environ).url,
                       runner_id=runner_id or env.runner_id or f"{socket.gethostname()}-{os.getpid()}",
                       heartbeat_s=env.heartbeat_s, stale_after_s=env.stale_after_s, poll_s=env.poll_s,
                       parallel_trials=env.parallel_trials, gpus_per_node=env.gpus_per_node,
                       trial=trial, data_root=default_data_root(environ), auto_calibrate=env.auto_calibrate)
        except SpecError as exc:  # the checks of __post_init__
            raise SpecError(f"bad runner setting in the environment: {exc}") from None


def job_specs(job: Job) -> tuple[ModelSpec | VisionLanguageSpec, TrainingSpec, ClusterSpec]:
    """The specs a job was submitted with (snapshots stored on the row): a vision-language job's model is its
    VisionLanguageSpec (its image inputs: :func:`job_images`)."""
    hardware = HardwareProfile.from_dict(job.cluster["hardware"])
    training, _ = split_precision_search(split_images(split_router(job.training_spec)[0])[0])
    model = VisionLanguageSpec.from_dict(job.model_spec) if "vision" in job.model_spec \
        else ModelSpec.from_dict(job.model_spec)
    return (model, TrainingSpec.from_dict(training),
            ClusterSpec(hardware=hardware, num_gpus=job.num_gpus,
                        min_headroom=job.cluster.get("min_headroom", DEFAULT_MIN_HEADROOM)))


def study_attributes(job: Job, model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec) -> dict:
    """What a job's Optuna study carries as user attributes (optuna-dashboard shows them): the job, its model,
    cluster and training shape, so a study named ``job-<id>`` explains itself outside foldtune. ``gpu`` is the GPU
    type the job named (what ``foldtune best --gpu`` looks it up by), ``hardware_profile`` the profile that priced
    it (``cpu-4-ranks-auto-calibrated`` after a calibration, api/worker/auto_profile.py)."""
    return {"foldtune_job_id": job.id, "owner_id": job.owner_id, "signature": job.signature, "model": model.name,
            "gpu": job.gpu_name or cluster.hardware.name, "hardware_profile": cluster.hardware.name,
            "num_gpus": cluster.num_gpus, "gpus_per_node": cluster.gpus_per_node,
            "seq_length": training.seq_length, "global_batch_size": training.global_batch_size,
            "precision": training.precision, "search_precision": job_searches_precision(job),
            "max_trials": job.max_trials}


def job_images(job: Job) -> ImageInputs | None:
    """The image inputs of a vision-language job (None: a text-only one)."""
    return split_images(split_router(job.training_spec)[0])[1]


def job_searches_precision(job: Job) -> bool:
    """Whether the job measures each trial at its own precision (submitted with ``search_precision``)."""
    return split_precision_search(split_router(job.training_spec)[0])[1]


def job_router(job: Job) -> RouterOptions:
    """The router options a job's trials train with (stored with its training spec; defaults if none)."""
    return split_router(job.training_spec)[1]


class Runner:
    """Claims jobs and runs them until told to stop (``stop()``, SIGTERM in the CLI)."""

    def __init__(self, settings: RunnerSettings, on_event: EventHook | None = None, migrate: bool = True) -> None:
        optuna.logging.set_verbosity(optuna.logging.WARNING)

        self.settings = settings
        self.on_event = on_event or (lambda kind, data: None)
        if migrate:
            upgrade(settings.database_url)
        self.engine = make_engine(settings.database_url)
        self.sessions = make_sessionmaker(self.engine)
        self.optuna_url = ensure_optuna_storage(settings.database_url)
        self._shutdown = threading.Event()
        self._job_stop: threading.Event | None = None

    def stop(self) -> None:
        """Stop claiming, abandon the running trial at once (its ranks are killed) and give the job back to
        the queue; :meth:`run` returns. Safe to call from a signal handler (it only sets events)."""
        self._shutdown.set()
        if self._job_stop is not None:
            self._job_stop.set()

    def close(self) -> None:
        self.engine.dispose()

    def health_checks(self) -> dict[str, Callable[[], None]]:
        """The runner's part of its ``/healthz`` (api.worker.health): still running, its database answers."""
        def running() -> None:
            if self._shutdown.is_set():
                raise RuntimeError(f"runner {self.settings.runner_id} is shutting down")

        return {"runner": running, "database": lambda: ping(self.engine)}

    # The loop ----------------------------------------------------------------------------------------
    def run(self, once: bool = False) -> int:
        """Claim and run jobs; with ``once`` return when the queue is empty. Returns how many jobs ran."""
        ran = 0
        while not self._shutdown.is_set():
            with self.sessions() as session:
                stale = requeue_stale(session, self.settings.stale_after_s)
                if stale.jobs_requeued or stale.jobs_failed:
                    log.info("requeued stale jobs %s, failed %s", stale.jobs_requeued, stale.jobs_failed)
                job = claim_next_job(session, self.settings.runner_id)
            if job is None and run_next_training(self.sessions, self.settings.database_url, self.settings.runner_id,
                                                 self.settings.heartbeat_s, self._shutdown, self.settings.data_root):
                ran += 1
                continue
            if job is None:
                if once:
                    break
                self._shutdown.wait(self.settings.poll_s)
                continue
            try:
                self.run_job(job)
            except Exception as exc:  # a bug or a lost database must not leave the job claimed forever
                log.exception("job %s: the runner failed", job.id)
                self._fail_job(job.id, f"runner error: {type(exc).__name__}: {exc}")
            ran += 1
        return ran

    def _fail_job(self, job_id: int, error: str) -> None:
        try:
            with self.sessions() as session:
                finish_job(session, job_id, self.settings.runner_id, "failed", error=error)
        except Exception:  # the database itself is gone: the stale-claim requeue will deal with the job
            log.exception("job %s: could not record its failure", job_id)

    def run_job_id(self, job_id: int) -> str | None:
        """Claim the queued job ``job_id`` and run it; its final status, or None if it was not queued."""
        with self.sessions() as session:
            job = claim_job(session, job_id, self.settings.runner_id)
        if job is None:
            return None
        return self.run_job(job)

    def run_training_id(self, training_id: int, on_step: Callable[[int], None] | None = None) -> str | None:
        """Claim the queued training ``training_id`` and run it; its final status as this runner saw it
        ('stopped' when stopped before its end), or None if it was not queued. ``on_step(step)`` as in
        :func:`api.worker.trainings.run_claimed_training`."""
        with self.sessions() as session:
            training = claim_training(session, training_id, self.settings.runner_id)
        if training is None:
            return None
        return run_claimed_training(training, self.sessions, self.settings.database_url, self.settings.runner_id,
                                    self.settings.heartbeat_s, self._shutdown, on_step, data_root=self.settings.data_root)

    def run_job(self, job: Job) -> str:
        """Run a claimed job to its end; returns its final status as this runner saw it."""
        stop = self._job_stop = threading.Event()
        if self._shutdown.is_set():
            stop.set()
        beat = threading.Thread(target=self._heartbeat, args=(job.id, stop), daemon=True,
                                name=f"heartbeat-job-{job.id}")
        beat.start()
        try:
            return (self._run_verify if job.kind == "verify" else self._run_job)(job, stop)
        finally:
            stop.set()
            beat.join(5)

    def _heartbeat(self, job_id: int, stop: threading.Event) -> None:
        while not stop.wait(self.settings.heartbeat_s):
            try:
                with self.sessions() as session:
                    if not heartbeat_job(session, job_id, self.settings.runner_id):
                        log.info("job %s: heartbeat refused (cancelled or reassigned); stopping", job_id)
                        stop.set()
                        return
                    heartbeat_running_trials(session, job_id, self.settings.runner_id)
            except Exception as exc:  # a database hiccup must not kill the job; the next beat retries
                log.warning("job %s: heartbeat failed: %s", job_id, exc)
            if self._shutdown.is_set():
                stop.set()

    def _run_job(self, job: Job, stop: threading.Event) -> str:
        sid = self.settings.runner_id
        try:
            model, training, cluster = job_specs(job)
            # from this (main) thread: Ray installs its signal handlers only here
            launch_ray.attach_ray()
            shape = launch_ray.cluster_shape(launch_ray.rank_resource("gloo" if is_cpu_cluster(cluster) else "nccl"))
            cluster, pricing = self._pricing_cluster(job, cluster, training, shape)
            cluster = cluster_on_ray(cluster, self.settings.gpus_per_node or shape.slots_per_node or None)
            images = job_images(job)
            if isinstance(model, VisionLanguageSpec):
                cands = multimodal_job_candidates(model, training, images, cluster, job.max_trials)
            else:
                cands = job_candidates(model, training, cluster, job.max_trials,
                                       search_precision=job_searches_precision(job))
            if cands.precision_note:
                log.info("job %s: %s", job.id, cands.precision_note)
            if cands.rejection is not None:  # the front door's check; the job was stored before it, or by hand
                raise FoldtuneError(str(cands.rejection))
        except FoldtuneError as exc:
            with self.sessions() as session:
                finish_job(session, job.id, sid, "failed", error=str(exc))
            self.on_event("job_finished", {"job_id": job.id, "status": "failed", "error": str(exc)})
            return "failed"
        self._recover(job)
        recorder = _TrialRecorder(self, job, cands, stop)
        executor = TrialExecutor(model, training, cluster, self.settings.trial, stop, job_router(job),
                                 name=f"job-{job.id}", images=images)
        remaining = _remaining_seconds(job)
        budget = SearchBudget(max_trials=job.max_trials, max_seconds=remaining,
                              parallel_trials=self._parallel_trials(cluster, shape))
        ray_cluster = {"resource": shape.resource, "nodes": shape.num_nodes,
                       "slots_per_node": [n.slots for n in shape.nodes], "gpus_per_node": cluster.gpus_per_node,
                       "parallel_trials": budget.parallel_trials}
        self.on_event("job_started", {"job_id": job.id, "model": model.name, "gpus": cluster.num_gpus,
                                      "gpu": job.gpu_name or cluster.hardware.name,
                                      "pricing_profile": pricing.to_dict(),
                                      "candidates": cands.summary(),
                                      "max_trials": job.max_trials, "parallel_trials": budget.parallel_trials,
                                      "ray_cluster": ray_cluster})
        try:
            try:
                result = run_search(cands.candidates, executor, capacity_bytes=cluster.usable_hbm_bytes,
                                    budget=budget, storage=self.optuna_url, study_name=f"job-{job.id}",
                                    on_event=recorder, study_attrs=study_attributes(job, model, training, cluster),
                                    repredict=repricer(model, training, cluster, cands)
                                    if isinstance(model, ModelSpec) and model.is_moe else None)
            finally:
                executor.close()  # the rank actors kept between trials
        except JobStopped:
            with self.sessions() as session:
                status, holder = job_claim(session, job.id)
                if self._shutdown.is_set() and status == "running" and holder == sid:
                    fail_running_trials(session, job.id, SHUTDOWN_REASON)
                    release_job(session, job.id, sid)
                    status = "queued"
                elif status == "cancelled":  # a trial that started after the cancel: cancelled too, not lost later
                    fail_running_trials(session, job.id, CANCELLED_REASON, FailureKind.CANCELLED)
            self.on_event("job_finished", {"job_id": job.id, "status": status})
            return status or "cancelled"
        summary = {**result.calibration.to_dict(),
                   "measured_vs_predicted": [_row_dict(r) for r in result.rows],
                   "stopped_because": result.stopped_because,
                   "best_layout": (Labelled(result.best_config, result.best_precision).label()
                                   if result.best_config else None),
                   "best_step_time_s": result.best_step_time, "candidates": cands.summary(),
                   "ray_cluster": ray_cluster, "pricing_profile": pricing.to_dict(),
                   "fixed_cost": fixed_cost_summary(recorder.fixed_costs)}
        if cands.precisions:  # the job searched precision: what it measured, what it dropped, the fit of each
            # each searched precision's best measured step, and what each bought over bf16, measured
            summary.update(best_precision=result.best_precision, precisions=list(cands.precisions),
                           precision_note=cands.precision_note,
                           calibration_by_precision={p: c.to_dict()
                                                     for p, c in result.calibration_by_precision.items()},
                           best_by_precision={p: {"layout": b.layout, "step_time_s": b.step_time}
                                              for p, b in result.best_by_precision.items()},
                           gain_over_bf16=result.gain_over_bf16)
        status, error = "succeeded", None
        if result.best_config is None:
            reasons = sorted({r.failure_reason for r in result.rows if r.failure_reason})
            status, error = "failed", "no layout ran successfully: " + ("; ".join(reasons[:3]) or "no trials")
        with self.sessions() as session:
            finished = finish_job(session, job.id, sid, status, error=error, calibration=summary)
            final = status if finished else (job_status(session, job.id) or status)
        self.on_event("job_finished", {"job_id": job.id, "status": final, "error": error, "result": summary,
                                       "rows": result.rows, "best": result.best_config,
                                       "best_precision": result.best_precision,
                                       "best_step_time": result.best_step_time})
        return final

    def _run_verify(self, job: Job, stop: threading.Event) -> str:
        """A verify job: plan its workload, check the top layouts by one-rank slices on this runner's device
        (each in a child process of its own, api.worker.verify) and store the report. Between layouts it stops
        when the job was cancelled or the runner is shutting down (the job is then back in the queue)."""
        sid = self.settings.runner_id
        request = job.verify or {}
        try:
            model, training, cluster = job_specs(job)
            stored = request.get("slice_hardware")
            slice_hardware = HardwareProfile.from_dict(stored) if stored else cluster.hardware
            self.on_event("job_started", {"job_id": job.id, "kind": "verify", "model": model.name,
                                          "gpus": cluster.num_gpus, "gpu": job.gpu_name or cluster.hardware.name,
                                          "top": request.get("top", job.max_trials),
                                          "slice_gpu": slice_hardware.name})

            def checked(layout) -> None:
                self.on_event("layout_checked", {"job_id": job.id, "plan_rank": layout.plan_rank,
                                                 "layout": layout.config.label(), "error": layout.error})
                if stop.is_set():
                    raise JobStopped(f"job {job.id} stopped")

            report = run_verify(model, training, cluster, slice_hardware, top=request.get("top", job.max_trials),
                                hot_factor=request.get("hot_expert_factor"),
                                cap=request.get("slice_layers", 2), isolated=True, router=job_router(job),
                                on_layout=checked)
        except JobStopped:
            with self.sessions() as session:
                status, holder = job_claim(session, job.id)
                if self._shutdown.is_set() and status == "running" and holder == sid:
                    release_job(session, job.id, sid)
                    status = "queued"
            self.on_event("job_finished", {"job_id": job.id, "status": status})
            return status or "cancelled"
        except FoldtuneError as exc:
            with self.sessions() as session:
                finish_job(session, job.id, sid, "failed", error=str(exc))
            self.on_event("job_finished", {"job_id": job.id, "status": "failed", "error": str(exc)})
            return "failed"
        status, error = "succeeded", None
        failures = [layout.error for layout in report.layouts if layout.error]
        if len(failures) == len(report.layouts):
            status, error = "failed", "no layout could be sliced: " + "; ".join(failures[:3])
        result = report.to_dict()
        with self.sessions() as session:
            finished = finish_job(session, job.id, sid, status, error=error, report=result)
            final = status if finished else (job_status(session, job.id) or status)
        self.on_event("job_finished", {"job_id": job.id, "status": final, "error": error, "report": result})
        return final

    def _pricing_cluster(self, job: Job, cluster: ClusterSpec, training: TrainingSpec,
                         shape: launch_ray.ClusterShape) -> tuple[ClusterSpec, PricingProfile]:
        """The job's cluster on the profile it prices with (api.worker.auto_profile) and where that came from. A
        calibration it needs runs through Ray on one node of ``shape``, where the job's trials will run."""
        def stored(name: str) -> dict | None:
            with self.sessions() as session:
                row = stored_profile(session, name)
                return None if row is None or row.source != "calibrate" else dict(row.profile)

        def store(name: str, profile: dict) -> bool:
            with self.sessions() as session:
                return store_calibrated_profile(session, name, profile)

        mode = self.settings.auto_calibrate_mode(cluster.hardware)
        name = auto_profile_name(cluster.hardware, cluster.num_gpus)
        if (mode != "off" and cluster.hardware.source == DATASHEET_SOURCE
                and current_profile(cluster.hardware, stored(name)) is None):
            self.on_event("calibrating", {"job_id": job.id, "gpu": cluster.hardware.gpu.name, "mode": mode,
                                          "name": name})
        calibrate = functools.partial(quick_calibration, slots_per_node=shape.slots_per_node,
                                      launcher=functools.partial(launch_ray.launch, name=f"job-{job.id}-calibrate"))
        start = time.monotonic()
        hardware, pricing = pricing_profile(cluster.hardware, cluster.num_gpus, training.precision, mode, stored,
                                            store, calibrate)
        if pricing.calibrated_by_job:  # how long the job's first minutes went on measuring, not searching
            self.on_event("calibrated", {"job_id": job.id, "name": pricing.name, "note": pricing.note,
                                         "seconds": time.monotonic() - start})
        return replace(cluster, hardware=hardware), pricing

    def _recover(self, job: Job) -> None:
        """Before resuming a job: trials its previous runner left running are lost (retried under new
        numbers), and trials the Optuna study finished but the database missed are written now."""
        with self.sessions() as session:
            lost = fail_running_trials(session, job.id, "its runner stopped mid-trial; retried")
        if lost:
            log.info("job %s: trials %s were running when the previous runner stopped", job.id, lost)
        try:
            study = optuna.load_study(study_name=f"job-{job.id}", storage=self.optuna_url)
        except KeyError:
            return  # a fresh job: no study yet
        for t in study.get_trials(deepcopy=False):
            if not t.state.is_finished() or ATTR_LAYOUT not in t.user_attrs:
                continue
            with self.sessions() as session:
                row = trial_by_number(session, job.id, t.number)
                if row is not None and (row.status != "running" and row.failure_kind != FailureKind.LOST.value):
                    continue
                precision = t.user_attrs.get(ATTR_PRECISION)
                record_trial_start(session, job.id, t.number, t.user_attrs.get(ATTR_CONFIG, {}),
                                   runner_id=self.settings.runner_id, label=t.user_attrs[ATTR_LAYOUT],
                                   predicted={"precision": precision} if precision else None,
                                   predicted_step_time_s=t.user_attrs.get(ATTR_PRED_TIME))
                if t.state == TrialState.COMPLETE:
                    record_trial_finish(session, job.id, t.number, "succeeded", step_time_s=t.value,
                                        measurement={"ok": True, "step_time": t.value, "recovered_from": "optuna"})
                elif t.state == TrialState.PRUNED:
                    record_trial_finish(session, job.id, t.number, "pruned")
                else:
                    reason = t.user_attrs.get(ATTR_FAILURE) or "failed"
                    kind = t.user_attrs.get(ATTR_FAILURE_KIND) or FailureKind.ERROR.value
                    record_trial_finish(session, job.id, t.number, "failed", failure_kind=kind, failure_reason=reason)

    def _parallel_trials(self, cluster: ClusterSpec, shape: launch_ray.ClusterShape) -> int:
        """Trials at once: the setting, else as many as fit the Ray cluster side by side, each on its own
        devices, ``cluster.gpus_per_node`` ranks on each of its nodes. CPU ranks (the 'CPU' resource) take
        their nodes whole: on a shared node they would share cores and distort each other's times, so one
        machine runs one CPU trial at a time and N CPU nodes run N."""
        if self.settings.parallel_trials:
            return self.settings.parallel_trials
        return max(1, shape.concurrent_trials(cluster.num_gpus, cluster.gpus_per_node))


def cluster_on_ray(cluster: ClusterSpec, gpus_per_node: int | None) -> ClusterSpec:
    """``cluster`` with the planner's node boundary at ``gpus_per_node`` (Ray's shape or the override); the
    hardware profile's own figure when None. A SpecError when the job's GPUs do not fill such nodes."""
    if not gpus_per_node or gpus_per_node == cluster.hardware.gpus_per_node:
        return cluster
    try:
        return ClusterSpec(hardware=dataclasses.replace(cluster.hardware, gpus_per_node=gpus_per_node),
                           num_gpus=cluster.num_gpus, hbm_reserved_bytes=cluster.hbm_reserved_bytes)
    except SpecError as exc:
        raise SpecError(f"on this Ray cluster ({gpus_per_node} per node): {exc}") from None


def _remaining_seconds(job: Job) -> float | None:
    """What is left of the job's wall-clock budget, counted from its first claim."""
    if job.max_seconds is None:
        return None
    spent = (utcnow() - job.started_at).total_seconds() if job.started_at else 0.0
    return max(1.0, job.max_seconds - spent)


def _row_dict(row: Any) -> dict[str, Any]:
    out = dataclasses.asdict(row)
    out["time_error"] = row.time_error
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}


class _TrialRecorder:
    """The search's ``on_event``: writes trials to the database as they start and finish."""

    def __init__(self, runner: Runner, job: Job, cands: Any, stop: threading.Event) -> None:
        self.runner, self.job, self.cands, self.stop = runner, job, cands, stop
        self.fixed_costs: dict[int, float] = {}  # trial number -> seconds from dispatch to its first timed step

    def __call__(self, kind: str, data: dict) -> None:
        job_id = self.job.id
        if kind == "trial_started":
            if self.stop.is_set():
                raise JobStopped(f"job {job_id} stopped")
            with self.runner.sessions() as session:
                if job_status(session, job_id) != "running":  # cancelled since the last heartbeat: start nothing
                    self.stop.set()
                    raise JobStopped(f"job {job_id} stopped")
            label = data["layout"]  # with the precision suffix when the job searches precision
            est = self.cands.estimates.get(data["labelled"])
            predicted = stored_prediction(est) if est else None
            if data.get("precision"):  # the trial's own precision, kept with its prediction (TrialOut.precision)
                predicted = {**(predicted or {}), "precision": data["precision"]}
            with self.runner.sessions() as session:
                record_trial_start(
                    session, job_id, data["number"], data["labelled"].config.to_dict() if est else {},
                    runner_id=self.runner.settings.runner_id, label=label, predicted=predicted,
                    predicted_step_time_s=data.get("predicted_step_time"))
        elif kind == "trial_finished":
            self._finish(data)
        self.runner.on_event(kind, {"job_id": job_id, **data})

    def _finish(self, data: dict) -> None:
        m = data.get("measurement")
        measurement = m.to_dict() if m is not None else None
        if m is not None and m.fixed_cost_s is not None:
            self.fixed_costs[data["number"]] = m.fixed_cost_s
        state = data["state"]
        with self.runner.sessions() as session:
            if state == "complete":
                record_trial_finish(session, self.job.id, data["number"], "succeeded",
                                    measurement=measurement, step_time_s=data["step_time"])
            elif state == "pruned":
                record_trial_finish(session, self.job.id, data["number"], "pruned",
                                    measurement=measurement, step_time_s=data.get("step_time"))
            else:
                reason = data.get("failure_reason") or "failed"
                kind = data.get("failure_kind") or FailureKind.ERROR.value
                record_trial_finish(session, self.job.id, data["number"], "failed",
                                    measurement=measurement, failure_kind=kind, failure_reason=reason)
