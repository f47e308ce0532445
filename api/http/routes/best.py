"""The best measured layout for a (model, training, cluster) signature, across the caller's jobs."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query

from api.http.deps import OwnerDep, SessionDep
from api.schemas.best import BestOut
from api.schemas.common import Name
from api.schemas.problem import problem_responses
from api.schemas.training_run import PRICE_FIELD, TOKENS_FIELD
from api.service.best import BestQuery, best_of, run_question
from spec.limits import MAX_LAYERS
from spec.proxy import PROXIES
from spec.training_spec import PRECISIONS

router = APIRouter(prefix="/v1", tags=["best"], responses=problem_responses(401, 404, 422))


@router.get("/best", operation_id="get_best", response_model=BestOut)
def get_best(owner: OwnerDep, session: SessionDep,
             signature: Annotated[str | None, Query(
                 pattern="^[0-9a-f]{64}$", description="a job's signature (any job model, incl. inline)")] = None,
             model: Annotated[Name | None, Query(description="catalog model name")] = None,
             gpu: Annotated[Name | None, Query()] = None,
             num_gpus: Annotated[int | None, Query(ge=1, le=65536)] = None,
             seq_length: Annotated[int | None, Query(ge=1, le=2**31 - 1)] = None,
             global_batch_size: Annotated[int | None, Query(ge=1, le=2**31 - 1)] = None,
             precision: Annotated[Literal[PRECISIONS] | None, Query(
                 description="default: fp32 on cpu, bf16 on GPUs (as POST /v1/jobs stores without one)")] = None,
             num_layers_override: Annotated[int | None, Query(
                 ge=1, le=MAX_LAYERS, description="the jobs' layers proxy (as POST /v1/jobs took it)")] = None,
             proxy: Annotated[Literal[PROXIES] | None, Query(
                 description="the jobs' proxy kind (as POST /v1/jobs took it)")] = None,
             tokens: Annotated[int | None, Query(**TOKENS_FIELD)] = None,
             price_per_gpu_hour: Annotated[float | None, Query(**PRICE_FIELD)] = None) -> BestOut:
    """The succeeded trial with the shortest measured step time over the caller's jobs of one signature,
    given directly or as model + gpu + num_gpus + seq_length + global_batch_size (+ precision; the other
    training fields at their defaults). A proxy's jobs are found by its name (``<model>@<N>L``,
    ``<model>@tiny``) or by ``num_layers_override`` / ``proxy`` beside the catalog name. With ``tokens`` (and
    ``price_per_gpu_hour``) the answer carries the time (and cost) of training that many tokens at the measured
    step time."""
    query = BestQuery(signature=signature, model=model, gpu=gpu, num_gpus=num_gpus, seq_length=seq_length,
                      global_batch_size=global_batch_size, precision=precision,
                      num_layers_override=num_layers_override, proxy=proxy)
    return best_of(session, owner, query, run_question(tokens, price_per_gpu_hour))
