"""Read-only views for the dashboard: a job's best measured layout as Megatron-LM arguments, a training's
checkpoints. Both go through the owner checks of the jobs and trainings use cases."""

from __future__ import annotations

from sqlalchemy.orm import Session

from api.schemas.views import CheckpointOut, CheckpointsOut, MegatronArgsOut
from api.service.errors import NotFound, RuleViolation
from api.service.jobs import owned_job
from api.service.trainings import owned_training
from db.models import Owner, Trial
from executor.train.checkpoint_names import list_checkpoints
from planner.megatron_args import megatron_args, megatron_env, megatron_script
from planner.megatron_multimodal import (MEGATRON_MULTIMODAL_RULE, megatron_multimodal_args, megatron_multimodal_env,
                                         megatron_multimodal_script)
from spec.errors import SpecError
from spec.model_spec import ModelSpec
from spec.multimodal import VisionLanguageSpec, split_images
from spec.multimodal_layout import MultimodalLayout
from spec.router_options import split_router
from spec.parallel_config import ParallelConfig
from spec.precision_search import trial_training
from spec.training_spec import TrainingSpec

MAX_CHECKPOINTS = 1000


def best_megatron_args(session: Session, owner: Owner, job_id: int) -> MegatronArgsOut:
    """The arguments of the job's fastest succeeded trial (jobs.best_trial_id, kept by finish_trial);
    NotFound when nothing has been measured yet."""
    job = owned_job(session, owner, job_id)
    trial = session.get(Trial, job.best_trial_id) if job.best_trial_id is not None else None
    if trial is None or trial.step_time_s is None:
        raise NotFound(f"job {job_id} has no measured layout yet", kind="no-measured-layout",
                       title="No measured layout")
    if "llm" in trial.config:  # a vision-language job's multimodal layout
        return _multimodal_megatron_args(job, trial)
    config = ParallelConfig.from_dict(trial.config)
    # the job's training (router options and the precision search flag apart) at the precision the trial ran
    model = ModelSpec.from_dict(job.model_spec)
    training = TrainingSpec.from_dict(trial_training(job.training_spec, trial.precision))
    # the trial's label: the layout, naming its precision when the job searched it
    return MegatronArgsOut(job_id=job.id, trial_number=trial.number, layout=trial.label or config.label(),
                           step_time_s=trial.step_time_s, args=megatron_args(config, model, training),
                           environment=megatron_env(config), text=megatron_script(config, model, training))


def _multimodal_megatron_args(job, trial: Trial) -> MegatronArgsOut:
    """:func:`best_megatron_args` of a multimodal layout (planner.megatron_multimodal); RuleViolation
    ``megatron_multimodal`` naming what Megatron-LM lacks when it cannot express the layout."""
    layout = MultimodalLayout.from_dict(trial.config)
    vl = VisionLanguageSpec.from_dict(job.model_spec)
    images = split_images(split_router(job.training_spec)[0])[1]
    training = TrainingSpec.from_dict(trial_training(job.training_spec, trial.precision))
    try:
        args = megatron_multimodal_args(layout, vl, training, images)
    except SpecError as exc:
        raise RuleViolation("path.job_id", MEGATRON_MULTIMODAL_RULE,
                            f"job {job.id}'s best layout has no Megatron-LM arguments: {exc}") from None
    return MegatronArgsOut(job_id=job.id, trial_number=trial.number, layout=trial.label or layout.label(),
                           step_time_s=trial.step_time_s, args=args, environment=megatron_multimodal_env(layout),
                           text=megatron_multimodal_script(layout, vl, training, images))


def training_checkpoints(session: Session, owner: Owner, training_id: int) -> CheckpointsOut:
    """The checkpoints under the training's own checkpoint_dir (as the server sees that path; a runner on
    another machine writes where the server may not look: the list is then empty)."""
    row = owned_training(session, owner, training_id)
    entries = list_checkpoints(row.checkpoint_dir, limit=MAX_CHECKPOINTS)
    return CheckpointsOut(training_id=row.id, checkpoint_dir=row.checkpoint_dir,
                          items=[CheckpointOut(**vars(e)) for e in entries])
