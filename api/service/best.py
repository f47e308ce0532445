"""The best-layout use case: the fastest measured layout of one signature across an owner's jobs."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from api.schemas.best import BestOut
from api.schemas.jobs import ClusterOut, TrialOut
from api.schemas.training_run import PRICE_NEEDS_TOKENS
from costmodel.training_run import training_run
from api.service.errors import NotFound, RuleViolation
from api.service.jobs import ResolvedJob, resolve_cluster, resolve_model
from spec.errors import FoldtuneError
from spec.model_spec import ModelSpec
from spec.proxy import ProxyError, proxy_model, proxy_of
from spec.run_inputs import RunQuestion
from spec.shape_defaults import default_precision
from spec.training_spec import TrainingSpec
from db.jobs import count_of_signature
from db.models import Job, Owner
from db.trials import best_trial

BY_SPEC = ("model", "gpu", "num_gpus", "seq_length", "global_batch_size")


@dataclass(frozen=True)
class BestQuery:
    """A signature, or the fields that make one (the other training fields at their defaults; precision None:
    the default of the GPU kind, :func:`spec.shape_defaults.default_precision`, as a job without one stores)."""

    signature: str | None = None
    model: str | None = None
    gpu: str | None = None
    num_gpus: int | None = None
    seq_length: int | None = None
    global_batch_size: int | None = None
    precision: str | None = None
    num_layers_override: int | None = None
    proxy: str | None = None


def run_question(tokens: int | None, price_per_gpu_hour: float | None) -> RunQuestion | None:
    """The query's time-and-cost question (None without tokens); RuleViolation for a price without tokens."""
    if tokens is None:
        if price_per_gpu_hour is not None:
            raise RuleViolation("query.price_per_gpu_hour", PRICE_NEEDS_TOKENS,
                                "price_per_gpu_hour needs tokens (the number to price)")
        return None
    return RunQuestion(tokens, price_per_gpu_hour)


def signature_of(session: Session, query: BestQuery) -> tuple[str, str]:
    """(the query's signature, given or computed; what it stands for in words: the model, cluster and training
    looked for); RuleViolation when neither is complete."""
    if query.signature is not None:
        return query.signature, f"signature {query.signature[:12]}..."
    values = {k: getattr(query, k) for k in BY_SPEC}
    missing = [k for k in BY_SPEC if values[k] is None]
    if missing:
        raise RuleViolation("query", "signature_or_spec",
                            f"give signature, or all of {', '.join(BY_SPEC)} (missing: {', '.join(missing)})")
    spec = _proxy_model(query)
    cluster = resolve_cluster(session, query.gpu, query.num_gpus, "query")
    try:
        training = TrainingSpec(seq_length=query.seq_length, global_batch_size=query.global_batch_size,
                                precision=query.precision or default_precision(cluster.hardware.gpu.name))
    except FoldtuneError as exc:
        raise RuleViolation("query", "training_spec_rules", str(exc)) from None
    signature = ResolvedJob(spec, training, cluster).signature
    return signature, (f"model {spec.name} on {query.num_gpus} x {query.gpu}, seq {training.seq_length}, global batch "
                       f"{training.global_batch_size}, {training.precision} (signature {signature[:12]}...)")


def best_of(session: Session, owner: Owner, query: BestQuery, question: RunQuestion | None = None) -> BestOut:
    """The succeeded trial with the shortest measured step time over the owner's jobs of the query's
    signature; NotFound ('no-best') when none has one. With ``question``, also the time and cost of training
    its tokens at that step time. Commits."""
    signature, looked_for = signature_of(session, query)
    trial = best_trial(session, owner_id=owner.id, signature=signature)
    if trial is None:
        raise NotFound(f"none of your jobs of {looked_for} has a succeeded trial (the other training fields at "
                       f"their defaults; a job of another precision, shape or router options has its own signature)",
                       kind="no-best", title="No measured layout yet")
    job = session.get(Job, trial.job_id)
    considered = count_of_signature(session, owner.id, signature)
    run = None
    if question is not None:
        run = training_run(question.tokens, trial.step_time_s, job.training_spec["seq_length"],
                           job.training_spec["global_batch_size"], job.num_gpus,
                           question.price_per_gpu_hour).to_dict()
    session.commit()
    return BestOut(signature=signature, model=job.model_name,
                   cluster=ClusterOut(gpu=job.gpu_name, num_gpus=job.num_gpus),
                   job_id=job.id, trial=TrialOut.model_validate(trial, from_attributes=True),
                   jobs_considered=considered, training_run=run)


def _proxy_model(query: BestQuery) -> ModelSpec:
    """The model the query's jobs ran: a proxy named as a job names it (``<model>[@tiny][@<N>L]``) or by
    ``num_layers_override`` / ``proxy``; RuleViolation when the name and the fields disagree."""
    info = proxy_of(query.model)
    for field, named, given in (("num_layers_override", info.num_layers, query.num_layers_override),
                                ("proxy", info.proxy, query.proxy)):
        if named is not None and given is not None and named != given:
            raise RuleViolation(f"query.{field}", "proxy_agrees",
                                f"model {query.model!r} names {field} {named!r}, the query gives {given!r}")
    layers = query.num_layers_override if query.num_layers_override is not None else info.num_layers
    proxy = query.proxy if query.proxy is not None else info.proxy
    try:
        return proxy_model(resolve_model(info.base, "query.model"), layers, proxy)
    except ProxyError as exc:
        where = "query.num_layers_override" if exc.rule == "proxy_layers" else "query.proxy"
        raise RuleViolation(where, exc.rule, str(exc)) from None
