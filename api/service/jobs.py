"""What the jobs routes do, kept out of the routers: turn a request into specs and a stored job,
list/show jobs with their trial counts, cancel, and find the best trial of a signature.

The cost-model specs (ModelSpec, TrainingSpec, HardwareProfile, ClusterSpec) are resolved and checked
here, at submission, so a runner never receives a job it cannot even describe.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.service.capability import apply_proxy, check_job_runnable, check_model_runnable
from api.service.errors import Conflict, RuleViolation, not_found
from api.service.planning import PlanningGate, no_gate
from api.service.vl_jobs import VLWorkload, check_vl_runnable, vl_workload
from api.service.quotas import Quotas, check_active_jobs, check_trials_per_job
from api.schemas.proxy import proxy_view
from api.schemas.jobs import BudgetOut, ClusterOut, JobCreate, JobOut, TrialCounts, TrialOut, VerifyIn, WorkloadIn
from spec.catalog import get_hardware, get_model
from spec.errors import FoldtuneError
from spec.hardware import DEFAULT_HBM_RESERVED, DEFAULT_MIN_HEADROOM, ClusterSpec, HardwareProfile, headroom_problem
from spec.model_spec import ModelSpec
from spec.multimodal import with_images
from spec.precision_search import with_precision_search
from spec.router_options import RouterOptions, with_router
from spec.training_spec import TrainingSpec
from db import jobs as db_jobs
from db.hardware_profiles import stored_profile
from db.jobs import job_by_idempotency_key, jobs_page, trial_status_counts, trials_by_id
from db.models import Job, Owner
from db.ownership import owned_row
from db.trials import trials_page


def job_signature(model_spec: dict[str, Any], training_spec: dict[str, Any], gpu: str, num_gpus: int) -> str:
    """SHA-256 (hex) of the canonical JSON of what a tuning job answers for: same signature, same question."""
    canonical = json.dumps({"model": model_spec, "training": training_spec, "gpu": gpu, "num_gpus": num_gpus},
                           sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def resolve_hardware(session: Session | None, name: str) -> HardwareProfile:
    """A stored hardware profile called ``name``, else the built-in one; CatalogError when neither exists.
    Without a session (a CLI checking before it opens the database) only the catalog is asked."""
    row = stored_profile(session, name.strip()) if session is not None else None
    if row is not None:
        return HardwareProfile.from_dict(row.profile)
    return get_hardware(name)


@dataclass(frozen=True)
class ResolvedJob:
    model: ModelSpec
    training: TrainingSpec
    cluster: ClusterSpec

    @property
    def signature(self) -> str:
        return job_signature(self.model.to_dict(), self.training.to_dict(), self.cluster.hardware.name,
                             self.cluster.num_gpus)


def check_router_options(router: RouterOptions, model: ModelSpec, loc: str = "body") -> RouterOptions:
    """``router`` unchanged when it can train ``model``; RuleViolation naming the rule otherwise."""
    problem = router.resolve_model_defaults(model).model_problem(model)
    if problem:
        raise RuleViolation(f"{loc}.moe_router_enable_expert_bias", "expert_bias_needs_sigmoid", problem)
    return router


def resolve_model(name: str, loc: str = "body.model") -> ModelSpec:
    try:
        return get_model(name)
    except FoldtuneError as exc:
        raise RuleViolation(loc, "known_model", str(exc)) from None


def resolve_cluster(session: Session | None, gpu: str, num_gpus: int, loc: str = "body.cluster",
                    min_headroom: float | None = None) -> ClusterSpec:
    """The cluster of a request; RuleViolation for an unknown GPU, partial nodes or a headroom that leaves
    nothing to plan with (``min_headroom`` None: the default)."""
    try:
        hardware = resolve_hardware(session, gpu)
    except FoldtuneError as exc:
        raise RuleViolation(f"{loc}.gpu", "known_gpu", str(exc)) from None
    if min_headroom is None:
        min_headroom = DEFAULT_MIN_HEADROOM
    problem = headroom_problem(min_headroom, hardware.gpu.hbm_bytes, DEFAULT_HBM_RESERVED)
    if problem:
        raise RuleViolation(f"{loc}.min_headroom", "headroom_fits", problem)
    try:
        return ClusterSpec(hardware=hardware, num_gpus=num_gpus, min_headroom=min_headroom)
    except FoldtuneError as exc:
        raise RuleViolation(f"{loc}.num_gpus", "whole_nodes", str(exc)) from None


def resolve_job(session: Session | None, request: WorkloadIn) -> ResolvedJob:
    """The specs of a job or plan request, the model as the proxy asked for; RuleViolation for an unknown
    model or GPU, partial nodes, or a proxy out of bounds."""
    model = request.model_spec if request.model_spec is not None else resolve_model(request.model or "")
    model = apply_proxy(model, request.num_layers_override, request.proxy)
    cluster = resolve_cluster(session, request.cluster.gpu, request.cluster.num_gpus,
                              min_headroom=request.cluster.min_headroom)
    return ResolvedJob(model=model, training=request.training_for(cluster.hardware.gpu.name), cluster=cluster)


def submit_job(session: Session, owner: Owner, request: JobCreate, idempotency_key: str | None, *,
               quotas: Quotas | None = None, gate: PlanningGate | None = None) -> tuple[Job, bool]:
    """Store a queued job; returns it and whether it is new. A repeated ``idempotency_key`` returns the job
    stored the first time (Conflict if the request differs), so a retried submission is stored exactly once.
    A job the executor cannot run (its model, or no runnable fitting layout on the cluster) is refused here
    with the rule it breaks, never queued to fail later. ``quotas`` (the HTTP service's; none for the local
    CLI): QuotaExceeded past the trials per job or the owner's active jobs (a retry of a stored job is
    answered with it, whatever the quota). ``gate`` (the HTTP service's) bounds the runnable check's planning
    (Unavailable beyond)."""
    vl = vl_workload(request)
    if vl is not None:
        return _submit_vl_job(session, owner, request, vl, idempotency_key, quotas=quotas, gate=gate)
    resolved = resolve_job(session, request)
    verify = request.kind == "verify"
    max_trials = request.verify.top if verify else request.budget.max_trials
    if quotas is not None:
        check_trials_per_job(quotas, max_trials)
    router = check_router_options(request.router_options(), resolved.model)
    # router options that differ from the defaults ride in the stored training spec (and so in the signature),
    # as does the precision search flag (spec.precision_search)
    training_spec = with_router(with_precision_search(resolved.training.to_dict(), request.search_precision), router)
    if verify:  # its layouts are planned by the runner; the slices need modules the executor builds
        check_model_runnable(resolved.model)
        verify_request = verify_job_request(session, request.verify, resolved.cluster)
    else:
        session.commit()  # the check below plans for seconds at most; no transaction is held open meanwhile
        with (gate or no_gate)():
            check_job_runnable(resolved.model, resolved.training, resolved.cluster, request.budget.max_trials,
                               search_precision=request.search_precision)
        verify_request = None
    job = Job(owner_id=owner.id, status="queued", kind=request.kind, verify=verify_request,
              model_name=resolved.model.name,
              model_spec=resolved.model.to_dict(), training_spec=training_spec,
              cluster={"gpu": resolved.cluster.hardware.name, "num_gpus": resolved.cluster.num_gpus,
                       "hardware": resolved.cluster.hardware.to_dict(),
                       "min_headroom": resolved.cluster.min_headroom},
              gpu_name=resolved.cluster.hardware.name, num_gpus=resolved.cluster.num_gpus,
              signature=job_signature(resolved.model.to_dict(), training_spec, resolved.cluster.hardware.name,
                                      resolved.cluster.num_gpus), max_trials=max_trials,
              max_seconds=request.budget.max_seconds, idempotency_key=idempotency_key)
    return _store_job(session, owner, job, idempotency_key, quotas)


def _submit_vl_job(session: Session, owner: Owner, request: JobCreate, vl: VLWorkload, idempotency_key: str | None,
                   *, quotas: Quotas | None, gate: PlanningGate | None) -> tuple[Job, bool]:
    """:func:`submit_job` of a vision-language model (api.service.vl_jobs): its spec and its image inputs
    stored with the job (the images in the training spec, so in the signature)."""
    cluster = resolve_cluster(session, request.cluster.gpu, request.cluster.num_gpus,
                              min_headroom=request.cluster.min_headroom)
    training = request.training_for(cluster.hardware.gpu.name)
    if quotas is not None:
        check_trials_per_job(quotas, request.budget.max_trials)
    router = check_router_options(request.router_options(), vl.model.llm)
    training_spec = with_images(with_router(training.to_dict(), router), vl.images)
    session.commit()  # the check below plans; no transaction is held open meanwhile
    with (gate or no_gate)():
        check_vl_runnable(vl, training, cluster, request.budget.max_trials)
    model_spec = vl.model.to_dict()
    job = Job(owner_id=owner.id, status="queued", kind="tune", verify=None, model_name=vl.model.name,
              model_spec=model_spec, training_spec=training_spec,
              cluster={"gpu": cluster.hardware.name, "num_gpus": cluster.num_gpus,
                       "hardware": cluster.hardware.to_dict(), "min_headroom": cluster.min_headroom},
              gpu_name=cluster.hardware.name, num_gpus=cluster.num_gpus,
              signature=job_signature(model_spec, training_spec, cluster.hardware.name, cluster.num_gpus),
              max_trials=request.budget.max_trials, max_seconds=request.budget.max_seconds,
              idempotency_key=idempotency_key)
    return _store_job(session, owner, job, idempotency_key, quotas)


def _store_job(session: Session, owner: Owner, job: Job, idempotency_key: str | None,
               quotas: Quotas | None) -> tuple[Job, bool]:
    """Store ``job`` once per idempotency key (the first one's answer for a repeat; Conflict if it differs)."""
    if idempotency_key is not None:
        existing = job_by_idempotency_key(session, owner.id, idempotency_key)
        if existing is not None:
            return _same_request_or_conflict(existing, job), False
    if quotas is not None:
        check_active_jobs(session, owner, quotas)
    session.add(job)
    try:
        session.commit()
    except IntegrityError:  # a concurrent request with the same key won the race
        session.rollback()
        existing = job_by_idempotency_key(session, owner.id, idempotency_key) if idempotency_key else None
        if existing is None:
            raise
        return _same_request_or_conflict(existing, job), False
    return job, True


def verify_job_request(session: Session | None, request: VerifyIn, cluster: ClusterSpec) -> dict[str, Any]:
    """What a verify job stores of its request: the fields, and the slices' hardware profile resolved now (the
    cluster's when none is named), so the job keeps meaning the same thing; RuleViolation for an unknown one."""
    hardware = cluster.hardware
    if request.slice_gpu is not None:
        try:
            hardware = resolve_hardware(session, request.slice_gpu)
        except FoldtuneError as exc:
            raise RuleViolation("body.verify.slice_gpu", "known_gpu", str(exc)) from None
    return {**request.model_dump(), "slice_gpu": hardware.name, "slice_hardware": hardware.to_dict()}


def _same_request_or_conflict(existing: Job, new: Job) -> Job:
    same = (existing.signature, existing.max_trials, existing.max_seconds, existing.kind, existing.verify) == (
        new.signature, new.max_trials, new.max_seconds, new.kind, new.verify)
    if not same:
        raise Conflict("idempotency-key-reused", "Idempotency key reused",
                       f"job {existing.id} was submitted with this Idempotency-Key and a different request")
    return existing


def owned_job(session: Session, owner: Owner, job_id: int) -> Job:
    """The owner's job ``job_id``; another owner's job is reported exactly like a missing one (NotFound)."""
    job = owned_row(session, Job, job_id, owner.id)
    if job is None:
        raise not_found(f"job {job_id}")
    return job


def trial_counts(session: Session, job_ids: list[int]) -> dict[int, TrialCounts]:
    counts = {job_id: TrialCounts() for job_id in job_ids}
    for job_id, status, n in trial_status_counts(session, job_ids):
        setattr(counts[job_id], status, n)
        counts[job_id].total += n
    return counts


def job_views(session: Session, jobs: list[Job]) -> list[JobOut]:
    """Jobs as the API shows them, with trial counts and best trial (two queries for the whole list)."""
    counts = trial_counts(session, [j.id for j in jobs])
    best_ids = [j.best_trial_id for j in jobs if j.best_trial_id is not None]
    best = trials_by_id(session, best_ids)
    return [JobOut(
        id=j.id, status=j.status, model=j.model_name, model_spec=j.model_spec, proxy=proxy_view(j.model_spec),
        training=j.training_spec,
        cluster=ClusterOut(gpu=j.gpu_name, num_gpus=j.num_gpus),
        budget=BudgetOut(max_trials=j.max_trials, max_seconds=j.max_seconds), signature=j.signature,
        created_at=j.created_at, updated_at=j.updated_at, started_at=j.started_at, finished_at=j.finished_at,
        error=j.error, attempts=j.attempts, runner=j.claimed_by, heartbeat_at=j.heartbeat_at,
        trials=counts[j.id], calibration=j.calibration, kind=j.kind, verify=_verify_view(j.verify),
        report=j.report,
        best_trial=TrialOut.model_validate(best[j.best_trial_id], from_attributes=True)
        if j.best_trial_id in best else None,
    ) for j in jobs]


def _verify_view(request: dict[str, Any] | None) -> dict[str, Any] | None:
    """A verify job's request as the API shows it (the stored hardware profile left out: its name is there)."""
    if request is None:
        return None
    return {k: v for k, v in request.items() if k != "slice_hardware"}


def list_jobs(session: Session, owner: Owner, *, status: str | None, model: str | None, limit: int,
              offset: int) -> tuple[list[Job], int]:
    """A page of the owner's jobs, newest first, and how many match in all."""
    return jobs_page(session, owner.id, status=status, model=model, limit=limit, offset=offset)


def list_trials(session: Session, owner: Owner, job_id: int, limit: int, offset: int) -> tuple[list[TrialOut], int]:
    """A page of the owner's job's trials in Optuna number order, and how many it has; NotFound for
    another owner's job."""
    owned_job(session, owner, job_id)
    trials, total = trials_page(session, job_id, limit, offset)
    return [TrialOut.model_validate(t, from_attributes=True) for t in trials], total


def cancel_job(session: Session, job: Job) -> Job:
    """Cancel a queued or running job (its runner learns it at its next heartbeat) and fail its running
    trials; cancelling a cancelled job is a no-op; a finished one is a Conflict. Commits.

    The status change is one guarded UPDATE (db.jobs.cancel_job), so a runner finishing the job at the
    same moment either wins (Conflict here) or loses (its finish_job returns False); never both."""
    db_jobs.cancel_job(session, job.id)
    session.refresh(job)
    if job.status in ("succeeded", "failed"):
        raise Conflict("job-finished", "Job already finished", f"job {job.id} already {job.status}")
    return job
