"""``foldtune train --job ID``: train the best layout of a finished tuning job, through the service code.

The training is stored exactly as ``POST /v1/trainings {"job_id": ID}`` stores it
(:func:`api.service.trainings.submit_training`: the job's model, cluster, sequence length, batch and
precision, its best trial's layout and that trial's predicted step time), then run in this process by the
same runner code ``foldtune runner`` uses (:meth:`api.worker.runner.Runner.run_training_id`: Ray launcher, rank 0
writing every step's metrics to the database, heartbeat), as ``foldtune tune`` runs its job. Each step is
printed from the stored metrics row, with the measured step time next to the cost model's prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

from sqlalchemy.engine import make_url

from api.cli._db import migrate_or_explain
from api.cli._local import check_ray_has_room, validated_request
from api.cli._router_args import router_body_from
from api.cli._units import seconds
from api.cli.trainings_cmd import metric_line, step_time_line
from api.schemas.trainings import TrainingCreate, TrainingMetricOut
from api.service.trainings import cancel_training, submit_training, training_views
from spec.errors import SpecError
from spec.shape_defaults import is_cpu
from spec.hardware import HardwareProfile
from db.models import Job, Owner, Training
from db.settings import database_settings
from db.trainings import metric_of_step


def _job_fields(job) -> dict[str, object]:
    """What the job fixes, keyed by the ``foldtune train`` option that would otherwise set it."""
    return {"--model": str(job.model_spec.get("name", job.model_name)), "--gpus": job.num_gpus,
            "--seq": job.training_spec.get("seq_length"), "--gbs": job.training_spec.get("global_batch_size")}


def check_no_conflicts(args: argparse.Namespace, job, device: str) -> None:
    """SpecError naming every option given with ``--job`` that disagrees with the job (equal values pass)."""
    given = {"--model": args.model, "--gpus": args.gpus, "--seq": args.seq, "--gbs": args.gbs}
    wrong = [f"{opt} {given[opt]} (the job's is {value})" for opt, value in _job_fields(job).items()
             if given[opt] is not None and str(given[opt]).lower() != str(value).lower()]
    if args.gpu is not None and is_cpu(args.gpu) != (device == "cpu"):
        wrong.append(f"--gpu {args.gpu} (the job's hardware {job.gpu_name} trains on {device})")
    if wrong:
        raise SpecError(f"job {job.id} fixes the model, GPUs, sequence length and batch; these options disagree: "
                        + "; ".join(wrong))
    if args.training_id is not None:
        raise SpecError("--training-id and --job exclude each other: --job stores its own training")


def training_request(args: argparse.Namespace, checkpoint_dir: str):
    """The POST /v1/trainings body ``foldtune train --job`` stands for (schema errors as one SpecError)."""
    body = {"job_id": args.job, "data_path": os.path.abspath(args.data), "steps": args.steps,
            "checkpoint_dir": checkpoint_dir, "checkpoint_every": args.checkpoint_every,
            "keep_last": args.keep_last, "lr": args.lr,
            "min_lr": args.min_lr, "warmup_steps": args.lr_warmup, "weight_decay": args.weight_decay,
            "max_grad_norm": args.clip_grad, "eval_every": args.eval_every, "eval_batches": args.eval_batches,
            "data_seed": args.seed}
    body = {k: v for k, v in body.items() if v is not None}  # a flag not given: the recipe's (the schema's default)
    body.update(router_body_from(args))
    return validated_request(TrainingCreate, body, whole="options")


class StoredStepPrinter:
    """The runner's per-step hook on the driver: prints the step rank 0 just stored, as ``foldtune train``
    prints it, with the predicted step time and its error ((predicted - measured) / measured)."""

    def __init__(self, sessions, training_id: int, predicted_s: float | None) -> None:
        self.sessions, self.training_id, self.predicted_s = sessions, training_id, predicted_s

    def __call__(self, step: int) -> None:
        with self.sessions() as session:
            row = metric_of_step(session, self.training_id, step)
            if row is None:  # rank 0 stores before it reports, so only a lost write gets here
                print(f"step {step:>6}  (metrics not stored)", flush=True)
                return
            m = TrainingMetricOut.model_validate(row).compared(self.predicted_s)
        print(metric_line(m.model_dump()), flush=True)


def run_job_training(args: argparse.Namespace) -> int:
    # the worker imports torch, Optuna and the executor: only `foldtune train --job` itself pays for them
    from api.worker.runner import Runner, RunnerSettings

    start = time.monotonic()
    # the local user's own training: any path of this machine, as stored below (no FOLDTUNE_DATA_ROOT)
    settings = dataclasses.replace(RunnerSettings.from_env(args.database_url, runner_id=f"train-{os.getpid()}"),
                                   data_root=None)
    migrate_or_explain(settings.database_url)
    runner = Runner(settings, migrate=False)
    try:
        with runner.sessions() as session:
            job = session.get(Job, args.job)
            if job is None:
                raise SpecError(f"job {args.job} does not exist in the database {_safe_url(settings.database_url)}")
            gpu = HardwareProfile.from_dict(job.cluster["hardware"]).gpu.name
            device = "cpu" if gpu.lower() == "cpu" else "cuda"
            check_no_conflicts(args, job, device)
            if job.best_trial_id is None:
                raise SpecError(f"job {job.id} ({job.status}) has no successful trial: nothing to train"
                                + (f" ({job.error})" if job.error else ""))
            job_id, num_gpus, owner_id = job.id, job.num_gpus, job.owner_id
        checkpoint_dir = args.checkpoint_dir or str(_default_checkpoint_dir(args.database_url, job_id))
        request = training_request(args, checkpoint_dir)
        check_ray_has_room(gpu, num_gpus)  # outside a transaction: starting Ray takes seconds
        with runner.sessions() as session:
            # The local CLI reads the database directly: the job's owner (the local one for `foldtune tune`,
            # an API key's owner for a submitted job) owns the training too, as over HTTP.
            # ... and names any path of this machine (data_root=None: the paths are the local user's own)
            row = submit_training(session, session.get(Owner, owner_id), request, data_root=None)
            view = training_views(session, [row])[0]
        predicted = view.predicted_step_time_s
        print(f"database {_safe_url(settings.database_url)}; training {view.id} stored: job {job_id}'s best layout "
              f"{view.label}, {view.model} on {num_gpus} x {gpu} ({device}), {args.steps} steps of "
              f"{view.training['global_batch_size']}x{view.training['seq_length']} tokens, "
              f"{view.training.get('precision', '?')}; predicted {seconds(predicted)} per step; "
              f"checkpoints in {checkpoint_dir} (Ray: {os.environ.get('FOLDTUNE_RAY_ADDRESS') or 'local'})",
              flush=True)
        try:
            status = runner.run_training_id(view.id, on_step=StoredStepPrinter(runner.sessions, view.id, predicted))
        except KeyboardInterrupt:  # cancelled, so that no service runner resumes it behind the user's back
            with runner.sessions() as session:
                cancel_training(session, session.get(Training, view.id))
            print(f"training {view.id} cancelled; the same command resumes from the latest checkpoint in "
                  f"{checkpoint_dir}, if one was saved (--checkpoint-every)", flush=True)
            raise
        with runner.sessions() as session:
            final = training_views(session, [session.get(Training, view.id)], measured=True)[0]
        print(f"training {final.id}: {final.status}" + (f": {final.error}" if final.error else ""), flush=True)
        print(step_time_line(final.model_dump()) or "no steps stored", flush=True)
    finally:
        runner.close()
    print(f"done in {time.monotonic() - start:.0f} s (runner saw: {status})", flush=True)
    return 0 if final.status == "succeeded" else 1


def _default_checkpoint_dir(database_url: str | None, job_id: int) -> Path:
    return database_settings(database_url).data_dir / "checkpoints" / f"job-{job_id}"


def _safe_url(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)

