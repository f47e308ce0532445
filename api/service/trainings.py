"""What the trainings routes do, kept out of the routers: resolve a request (a job's best layout or an
explicit one) into a stored queued training, show trainings with their latest metrics, page through the
metrics series, and cancel.

Everything a runner needs is checked here, at submission: the layout parses for the cluster and passes
the planner's validity rules for the model, the job has a best trial, the paths lie in the owner's own
directory (api.service.paths) and the data path exists there."""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from api.schemas.proxy import proxy_view
from api.service.checkpoint_space import checkpoint_space_problem
from api.service.capability import apply_proxy, check_layout_runnable, check_model_runnable, check_training_layout
from api.service.jobs import check_router_options, owned_job, resolve_cluster, resolve_model
from api.service.errors import Conflict, NotFound, RuleViolation, not_found
from api.service.paths import confine, owner_root
from api.service.quotas import Quotas, check_training
from api.service.vl_trainings import (VLTrainingSource, check_vl_training, predicted_vl_step_time,
                                      vl_training_source)
from api.schemas.jobs import ClusterOut
from api.schemas.trainings import (ExpertImbalanceOut, ExpertLoadOut, TrainingCreate, TrainingMetricOut,
                                   TrainingOut)
from costmodel.step_time import estimate_step_time
from spec.errors import FoldtuneError
from spec.hardware import ClusterSpec
from spec.model_spec import ModelSpec
from spec.multimodal import ImageInputs, VisionLanguageSpec, split_images, stored_llm, stored_model, with_images
from spec.multimodal_layout import MultimodalLayout, layout_from_dict
from spec.parallel_config import ParallelConfig
from spec.precision_search import split_precision_search
from spec.router_options import RouterOptions, split_router
from spec.training_spec import TrainingSpec
from db import trainings as db_trainings
from db.models import Owner, Training, TrainingExpertLoad, Trial
from db.ownership import owned_row
from db.trainings import (expert_load_at, expert_loads_after, latest_metrics, metrics_after, predicted_step_time,
                          step_times, trainings_page)
from spec.layout_rules import folds_the_world
from spec.validity import batch_rule

RECIPE_KEY = "recipe"  # training_spec holds the TrainingSpec fields plus the optimizer recipe under this key


def split_training_spec(stored: dict[str, Any]) -> tuple[TrainingSpec, dict[str, Any]]:
    """A stored ``Training.training_spec`` as its TrainingSpec and its recipe (lr, warmup_steps, ...); a
    vision-language training's image inputs (spec.multimodal.IMAGES_KEY) are left out."""
    spec = split_images({k: v for k, v in stored.items() if k != RECIPE_KEY})[0]
    return TrainingSpec.from_dict(spec), dict(stored.get(RECIPE_KEY, {}))


def _training_spec(base: dict[str, Any], request: TrainingCreate) -> TrainingSpec:
    overrides = {k: v for k, v in (("seq_length", request.seq_length),
                                   ("global_batch_size", request.global_batch_size)) if v is not None}
    try:
        return TrainingSpec.from_dict({**base, **overrides})
    except FoldtuneError as exc:
        raise RuleViolation("body", "training_spec_rules", str(exc)) from None


def _check_batch(training: TrainingSpec, config: ParallelConfig) -> None:
    """RuleViolation ``batch_divides`` at the global batch when it does not split over the layout's DP ranks
    (a layout whose sizes do not fold the world has no dp: the rule book names that rule instead)."""
    if not folds_the_world(config):
        return
    rejection = batch_rule(training.global_batch_size, config.micro_batch_size, config.dp)
    if rejection is not None:
        raise RuleViolation("body.global_batch_size", "batch_divides", f"{rejection.reason} (layout {config.label()})")


def _predicted_step_time(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec,
                         config: ParallelConfig) -> float | None:
    """The cost model's seconds per step for an explicit layout on the cluster's hardware profile: the same
    (uncalibrated) figure a tuning job stores as its trials' ``predicted_step_time_s``. None where the cost
    model cannot price the layout (it has already passed the planner's validity rules)."""
    try:
        return estimate_step_time(model, training, cluster, config).step_time
    except FoldtuneError:
        return None


def confined_paths(data_path: str, checkpoint_dir: str, owner: Owner, data_root: str | Path) -> tuple[str, str]:
    """(data_path, checkpoint_dir) resolved inside the owner's directory under ``data_root``; RuleViolation
    ``path_in_owner_root`` for either one that is not (api.service.paths)."""
    root = owner_root(data_root, owner.name, owner.id)
    return confine(data_path, root, "body.data_path"), confine(checkpoint_dir, root, "body.checkpoint_dir")


def submit_training(session: Session, owner: Owner, request: TrainingCreate, *, data_root: str | Path | None,
                    quotas: Quotas | None = None) -> Training:
    """Store a queued training; RuleViolation names the broken rule (known_job, job_has_best, layout_parses,
    path_in_owner_root, data_path_exists, checkpoint_space, ...), QuotaExceeded the quota. ``data_root``: the service's data
    root, whose ``<owner>/`` directory must hold both paths (they are stored resolved); None only for the
    local CLI, whose user names any path of their own machine. Commits."""
    if quotas is not None:
        check_training(session, owner, quotas)
    predicted = None
    vl = vl_training_source(request, request.cluster.num_gpus) if request.layout is not None else None
    if vl is not None:
        return _submit_vl_training(session, owner, request, vl, data_root)
    if request.job_id is not None:
        try:
            job = owned_job(session, owner, request.job_id)
        except NotFound:
            raise RuleViolation("body.job_id", "known_job", f"job {request.job_id} does not exist") from None
        best = session.get(Trial, job.best_trial_id) if job.best_trial_id is not None else None
        if best is None:
            raise RuleViolation("body.job_id", "job_has_best",
                                f"job {job.id} ({job.status}) has no best trial to train yet")
        if "llm" in best.config:  # a vision-language job: its model, multimodal layout and images
            return _submit_vl_training_from_job(session, owner, request, job, best, data_root)
        try:
            config = ParallelConfig.from_dict(best.config)
        except (FoldtuneError, TypeError) as exc:
            raise RuleViolation("body.job_id", "best_config_valid",
                                f"job {job.id}'s best trial has an unusable layout: {exc}") from None
        model_spec, cluster = job.model_spec, job.cluster
        job_training, job_router = split_router(job.training_spec)
        # a precision search's flag is no training field; the run trains at the job's precision (foldtune's
        # training step runs bf16/fp32 only, docs/executor.md), whatever precision the best trial measured
        job_training = split_precision_search(job_training)[0]
        training = _training_spec(job_training, request)
        _check_batch(training, config)
        try:
            job_model = ModelSpec.from_dict(model_spec)
        except FoldtuneError as exc:
            raise RuleViolation("body.job_id", "best_config_valid", f"job {job.id}'s model is unusable: {exc}") from None
        # the job ran this layout, but the executor's rules may have changed since (and seq_length may not)
        check_layout_runnable(job_model, training, config, "body.job_id")
        predicted = best.predicted_step_time_s
        # the job's router options (what its trials measured), unless the request sets them
        recipe = {**request.recipe(), **job_router.non_default(), **request.given_router_options()}
    else:
        model = request.model_spec if request.model_spec is not None else resolve_model(request.model or "")
        model = apply_proxy(model, request.num_layers_override, request.proxy)
        resolved = resolve_cluster(session, request.cluster.gpu, request.cluster.num_gpus)
        try:
            config = ParallelConfig.parse(request.layout or "", world_size=resolved.num_gpus)
        except (FoldtuneError, ValueError) as exc:  # ValueError: a non-integer count, e.g. recompute=full:x
            raise RuleViolation("body.layout", "layout_parses", str(exc)) from None
        training = _training_spec({}, request)
        _check_batch(training, config)
        check_model_runnable(model)
        # the planner's rule ids (layers_pp, experts_ep, ...) as `foldtune plan --explain`, then the executor's
        check_training_layout(model, training, resolved, config)
        predicted = _predicted_step_time(model, training, resolved, config)
        model_spec = model.to_dict()
        cluster = {"gpu": resolved.hardware.name, "num_gpus": resolved.num_gpus,
                   "hardware": resolved.hardware.to_dict()}
        recipe = request.recipe()
    check_router_options(RouterOptions.pick(recipe), ModelSpec.from_dict(model_spec))
    data_path, checkpoint_dir = _server_paths(request, owner, data_root)
    space = checkpoint_space_problem(ModelSpec.from_dict(model_spec), request.steps, request.checkpoint_every,
                                     request.keep_last, checkpoint_dir)
    if space is not None:  # refused now rather than failing at a save after hours of training
        raise RuleViolation("body.checkpoint_dir", "checkpoint_space", space)
    row = Training(owner_id=owner.id, job_id=request.job_id, status="queued", config=config.to_dict(),
                   model_spec=model_spec, training_spec={**training.to_dict(), RECIPE_KEY: recipe},
                   cluster=cluster, data_path=data_path, steps=request.steps,
                   checkpoint_dir=checkpoint_dir, checkpoint_every=request.checkpoint_every,
                   keep_last=request.keep_last,
                   predicted_step_time_s=predicted)
    session.add(row)
    session.commit()
    return row


def _server_paths(request: TrainingCreate, owner: Owner, data_root: str | Path | None) -> tuple[str, str]:
    """(data_path, checkpoint_dir) as the runner will use them (confined to the owner's directory when the
    service has a data root); RuleViolation ``data_path_exists`` for a data path the server does not have."""
    data_path, checkpoint_dir = request.data_path, request.checkpoint_dir
    if data_root is not None:
        data_path, checkpoint_dir = confined_paths(data_path, checkpoint_dir, owner, data_root)
    if not os.path.exists(data_path):
        raise RuleViolation("body.data_path", "data_path_exists",
                            f"data path {request.data_path!r} does not exist on the server")
    return data_path, checkpoint_dir


def _submit_vl_training(session: Session, owner: Owner, request: TrainingCreate, vl: VLTrainingSource,
                        data_root: str | Path | None) -> Training:
    """:func:`submit_training` of a vision-language model under an explicit multimodal layout
    (api.service.vl_trainings): the image inputs read from its dataset are stored with the training spec."""
    resolved = resolve_cluster(session, request.cluster.gpu, request.cluster.num_gpus)
    training = _training_spec({}, request)
    return _store_vl_training(session, owner, request, vl, training, resolved, request.recipe(), data_root)


def _submit_vl_training_from_job(session: Session, owner: Owner, request: TrainingCreate, job, best: Trial,
                                 data_root: str | Path | None) -> Training:
    """:func:`submit_training` from a vision-language job's best trial: the job's model, cluster, training
    (seq_length and global_batch_size unless the request sets them), router options and images, the best
    trial's multimodal layout and prediction. The dataset's images must be the job's (rule ``vl_job_images``):
    the layout was chosen for them."""
    try:
        model = stored_model(job.model_spec)
        layout = MultimodalLayout.from_dict(best.config)
    except (FoldtuneError, TypeError, KeyError) as exc:
        raise RuleViolation("body.job_id", "best_config_valid",
                            f"job {job.id}'s best trial has an unusable layout: {exc}") from None
    if not isinstance(model, VisionLanguageSpec):
        raise RuleViolation("body.job_id", "best_config_valid",
                            f"job {job.id}'s best layout is multimodal ({best.label}) but its model has no encoder")
    job_training, job_router = split_router(job.training_spec)
    job_training, job_images = split_images(split_precision_search(job_training)[0])
    training = _training_spec(job_training, request)
    resolved = resolve_cluster(session, job.cluster["gpu"], job.cluster["num_gpus"], loc="body.job_id")
    recipe = {**request.recipe(), **job_router.non_default(), **request.given_router_options()}
    return _store_vl_training(session, owner, request, VLTrainingSource(model, layout), training, resolved, recipe,
                              data_root, job_id=job.id, job_images=job_images,
                              predicted=best.predicted_step_time_s)


def _store_vl_training(session: Session, owner: Owner, request: TrainingCreate, vl: VLTrainingSource,
                       training: TrainingSpec, resolved: ClusterSpec, recipe: dict, data_root: str | Path | None, *,
                       job_id: int | None = None, job_images: ImageInputs | None = None,
                       predicted: float | None = None) -> Training:
    """Check and store a vision-language training (``job_images``: the images its job tuned for, which the
    dataset must hold; ``predicted``: the job's prediction, else the cost model's)."""
    check_router_options(RouterOptions.pick(recipe), vl.model.llm)
    data_path, checkpoint_dir = _server_paths(request, owner, data_root)
    images = check_vl_training(vl, training, resolved, data_path)
    if job_images is not None and images != job_images:
        raise RuleViolation("body.data_path", "vl_job_images",
                            f"the dataset holds {images.images_per_sample} image(s) of {images.image_height}x"
                            f"{images.image_width} px per sample; job {job_id} tuned its layout for "
                            f"{job_images.images_per_sample} of {job_images.image_height}x{job_images.image_width} px")
    space = checkpoint_space_problem(vl.model, request.steps, request.checkpoint_every, request.keep_last,
                                     checkpoint_dir)
    if space is not None:
        raise RuleViolation("body.checkpoint_dir", "checkpoint_space", space)
    if predicted is None:
        predicted = predicted_vl_step_time(vl, training, images, resolved)
    row = Training(owner_id=owner.id, job_id=job_id, status="queued", config=vl.layout.to_dict(),
                   model_spec=vl.model.to_dict(),
                   training_spec={**with_images(training.to_dict(), images), RECIPE_KEY: recipe},
                   cluster={"gpu": resolved.hardware.name, "num_gpus": resolved.num_gpus,
                            "hardware": resolved.hardware.to_dict()},
                   data_path=data_path, steps=request.steps, checkpoint_dir=checkpoint_dir,
                   checkpoint_every=request.checkpoint_every,
                   keep_last=request.keep_last, predicted_step_time_s=predicted)
    session.add(row)
    session.commit()
    return row


def owned_training(session: Session, owner: Owner, training_id: int) -> Training:
    """The owner's training; another owner's is reported exactly like a missing one (NotFound)."""
    row = owned_row(session, Training, training_id, owner.id)
    if row is None:
        raise not_found(f"training {training_id}")
    return row


def measured_step_time(session: Session, training_id: int) -> float | None:
    """Median seconds per step over the training's stored steps (the median, so that the first step's
    one-off start-up and evaluation steps do not move it); None before the first step."""
    times = [t for t in step_times(session, training_id) if t is not None]
    return statistics.median(times) if times else None


def training_views(session: Session, rows: list[Training], *, measured: bool = False) -> list[TrainingOut]:
    """Trainings as the API shows them, each with its latest metrics row (one query for the whole list).
    ``measured`` adds the median measured step time and its comparison with the prediction (one query
    per training over its whole series, so only for single trainings)."""
    latest = latest_metrics(session, [t.id for t in rows])
    views = []
    for t in rows:
        median = measured_step_time(session, t.id) if measured else None
        error = None
        if median and t.predicted_step_time_s is not None:
            error = (t.predicted_step_time_s - median) / median
        spec = {k: v for k, v in t.training_spec.items() if k != RECIPE_KEY}  # images included
        metric = latest.get(t.id)
        views.append(TrainingOut(
            id=t.id, status=t.status, job_id=t.job_id, config=t.config, label=layout_from_dict(t.config).label(),
            model=str(t.model_spec.get("name", "")), model_spec=t.model_spec, proxy=proxy_view(t.model_spec),
            training=spec,
            recipe=t.training_spec.get(RECIPE_KEY, {}),
            cluster=ClusterOut(gpu=t.cluster["gpu"], num_gpus=t.cluster["num_gpus"]), data_path=t.data_path,
            steps=t.steps, checkpoint_dir=t.checkpoint_dir, checkpoint_every=t.checkpoint_every,
            keep_last=t.keep_last,
            predicted_step_time_s=t.predicted_step_time_s, measured_step_time_s=median, step_time_error=error,
            created_at=t.created_at, updated_at=t.updated_at,
            started_at=t.started_at, finished_at=t.finished_at, error=t.error, attempts=t.attempts,
            runner=t.claimed_by, heartbeat_at=t.heartbeat_at,
            latest_metrics=(TrainingMetricOut.model_validate(metric).compared(t.predicted_step_time_s)
                            if metric is not None else None)))
    return views


def list_trainings(session: Session, owner: Owner, *, status: str | None, limit: int,
                   offset: int) -> tuple[list[Training], int]:
    """A page of the owner's trainings, newest first, and how many match in all."""
    return trainings_page(session, owner.id, status=status, limit=limit, offset=offset)


def metric_views(session: Session, training_id: int, after_step: int, limit: int) -> list[TrainingMetricOut]:
    """:func:`db.trainings.metrics_after` as the API shows it: each step with the training's predicted step time and
    the error of that prediction against the step's measured time."""
    predicted = predicted_step_time(session, training_id)
    return [TrainingMetricOut.model_validate(m).compared(predicted)
            for m in metrics_after(session, training_id, after_step, limit)]


def _max_over_mean(row: list[int]) -> float | None:
    total = sum(row)
    return max(row) * len(row) / total if total else None


def expert_load_view(session: Session, training: Training, step: int | None) -> ExpertLoadOut:
    """The stored per-layer expert load of step ``step`` of ``training`` (None: its latest); NotFound when that
    step (or any, for None) has none."""
    stored = expert_load_at(session, training.id, step)
    if stored is None:  # the training exists (the caller checked): say why there is nothing to show
        at = f"at step {step}" if step is not None else "yet"
        raise NotFound(f"training {training.id} has no per-layer expert load stored {at} (it stores one per step "
                       f"of a model with MoE layers)", kind="no-expert-load", title="No expert load stored")
    spec, _ = split_training_spec(training.training_spec)
    per_layer = spec.seq_length * spec.global_batch_size * stored_llm(training.model_spec).moe_router_topk
    return ExpertLoadOut(step=stored.step, moe_layers=stored.moe_layers, layers=stored.layers,
                         num_experts=len(stored.tokens[0]), tokens=stored.tokens, tokens_per_layer=per_layer,
                         max_over_mean=[_max_over_mean(row) for row in stored.tokens])


def _imbalance(stored: TrainingExpertLoad) -> ExpertImbalanceOut:
    return ExpertImbalanceOut(step=stored.step, layers=stored.layers,
                              max_over_mean=[_max_over_mean(row) for row in stored.tokens])


def expert_imbalance_views(session: Session, training_id: int, after_step: int,
                           limit: int) -> list[ExpertImbalanceOut]:
    """Each stored step after ``after_step`` (at most ``limit``, in step order) as its per-layer busiest / mean."""
    return [_imbalance(row) for row in expert_loads_after(session, training_id, after_step, limit)]


def cancel_training(session: Session, training: Training) -> Training:
    """Cancel a queued or running training (its runner learns it at its next heartbeat); cancelling a
    cancelled one is a no-op; a finished one is a Conflict. One guarded UPDATE, as for jobs. Commits."""
    db_trainings.cancel_training(session, training.id)
    session.refresh(training)
    if training.status in ("succeeded", "failed"):
        raise Conflict("training-finished", "Training already finished",
                       f"training {training.id} already {training.status}")
    return training
