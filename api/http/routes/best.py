"""The best measured layout for a (model, training, cluster) signature, across the caller's jobs."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from sqlalchemy import func, select

from api.service import jobs as jobs_service
from api.http.deps import OwnerDep, SessionDep
from api.http.problems import ProblemError, rule_violation
from api.schemas.best import BestOut
from api.schemas.common import Name
from api.schemas.jobs import ClusterOut, TrialOut
from api.schemas.problem import problem_responses
from spec.errors import FoldtuneError
from spec.training_spec import PRECISIONS, TrainingSpec
from db.models import Job
from db.trials import best_trial

router = APIRouter(prefix="/v1", tags=["best"], responses=problem_responses(401, 404, 422))

_BY_SPEC = ("model", "gpu", "num_gpus", "seq_length", "global_batch_size")


@router.get("/best", operation_id="get_best", response_model=BestOut)
def get_best(owner: OwnerDep, session: SessionDep,
             signature: Annotated[str | None, Query(
                 pattern="^[0-9a-f]{64}$", description="a job's signature (any job model, incl. inline)")] = None,
             model: Annotated[Name | None, Query(description="catalog model name")] = None,
             gpu: Annotated[Name | None, Query()] = None,
             num_gpus: Annotated[int | None, Query(ge=1, le=65536)] = None,
             seq_length: Annotated[int | None, Query(ge=1, le=2**31 - 1)] = None,
             global_batch_size: Annotated[int | None, Query(ge=1, le=2**31 - 1)] = None,
             precision: Annotated[Literal[PRECISIONS], Query()] = "bf16") -> BestOut:
    """The succeeded trial with the shortest measured step time over the caller's jobs of one signature,
    given directly or as model + gpu + num_gpus + seq_length + global_batch_size (+ precision; the other
    training fields at their defaults)."""
    if signature is None:
        values = {"model": model, "gpu": gpu, "num_gpus": num_gpus, "seq_length": seq_length,
                  "global_batch_size": global_batch_size}
        missing = [k for k in _BY_SPEC if values[k] is None]
        if missing:
            raise rule_violation("query", "signature_or_spec",
                                 f"give signature, or all of {', '.join(_BY_SPEC)} (missing: {', '.join(missing)})")
        spec = jobs_service.resolve_model(model, "query.model")
        cluster = jobs_service.resolve_cluster(session, gpu, num_gpus, "query")
        try:
            training = TrainingSpec(seq_length=seq_length, global_batch_size=global_batch_size, precision=precision)
        except FoldtuneError as exc:
            raise rule_violation("query", "training_spec_rules", str(exc)) from None
        signature = jobs_service.ResolvedJob(spec, training, cluster).signature
    trial = best_trial(session, owner_id=owner.id, signature=signature)
    if trial is None:
        raise ProblemError(404, "no-best", "No measured layout yet",
                           f"none of your jobs of signature {signature[:12]}... has a succeeded trial")
    job = session.get(Job, trial.job_id)
    considered = session.scalar(select(func.count()).select_from(Job)
                                .where(Job.owner_id == owner.id, Job.signature == signature))
    session.commit()
    return BestOut(signature=signature, model=job.model_name,
                   cluster=ClusterOut(gpu=job.gpu_name, num_gpus=job.num_gpus),
                   job_id=job.id, trial=TrialOut.model_validate(trial, from_attributes=True),
                   jobs_considered=considered)
