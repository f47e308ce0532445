"""The best-layout use case: the fastest measured layout of one signature across an owner's jobs."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from api.schemas.best import BestOut
from api.schemas.jobs import ClusterOut, TrialOut
from api.service.errors import NotFound, RuleViolation
from api.service.jobs import ResolvedJob, resolve_cluster, resolve_model
from spec.errors import FoldtuneError
from spec.training_spec import TrainingSpec
from db.jobs import count_of_signature
from db.models import Job, Owner
from db.trials import best_trial

BY_SPEC = ("model", "gpu", "num_gpus", "seq_length", "global_batch_size")


@dataclass(frozen=True)
class BestQuery:
    """A signature, or the fields that make one (the other training fields at their defaults)."""

    signature: str | None = None
    model: str | None = None
    gpu: str | None = None
    num_gpus: int | None = None
    seq_length: int | None = None
    global_batch_size: int | None = None
    precision: str = "bf16"


def signature_of(session: Session, query: BestQuery) -> str:
    """The query's signature, given or computed; RuleViolation when neither is complete."""
    if query.signature is not None:
        return query.signature
    values = {k: getattr(query, k) for k in BY_SPEC}
    missing = [k for k in BY_SPEC if values[k] is None]
    if missing:
        raise RuleViolation("query", "signature_or_spec",
                            f"give signature, or all of {', '.join(BY_SPEC)} (missing: {', '.join(missing)})")
    spec = resolve_model(query.model, "query.model")
    cluster = resolve_cluster(session, query.gpu, query.num_gpus, "query")
    try:
        training = TrainingSpec(seq_length=query.seq_length, global_batch_size=query.global_batch_size,
                                precision=query.precision)
    except FoldtuneError as exc:
        raise RuleViolation("query", "training_spec_rules", str(exc)) from None
    return ResolvedJob(spec, training, cluster).signature


def best_of(session: Session, owner: Owner, query: BestQuery) -> BestOut:
    """The succeeded trial with the shortest measured step time over the owner's jobs of the query's
    signature; NotFound ('no-best') when none has one. Commits."""
    signature = signature_of(session, query)
    trial = best_trial(session, owner_id=owner.id, signature=signature)
    if trial is None:
        raise NotFound(f"none of your jobs of signature {signature[:12]}... has a succeeded trial",
                       kind="no-best", title="No measured layout yet")
    job = session.get(Job, trial.job_id)
    considered = count_of_signature(session, owner.id, signature)
    session.commit()
    return BestOut(signature=signature, model=job.model_name,
                   cluster=ClusterOut(gpu=job.gpu_name, num_gpus=job.num_gpus),
                   job_id=job.id, trial=TrialOut.model_validate(trial, from_attributes=True),
                   jobs_considered=considered)
