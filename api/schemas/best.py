"""Body of GET /best: the fastest measured layout for one (model, training, cluster) signature."""

from __future__ import annotations

from pydantic import BaseModel, Field

from api.schemas.jobs import ClusterOut, TrialOut
from api.schemas.training_run import TrainingRunOut


class BestOut(BaseModel):
    signature: str
    model: str
    cluster: ClusterOut
    job_id: int
    trial: TrialOut
    jobs_considered: int
    training_run: TrainingRunOut | None = Field(
        None, description="with tokens: the time (and with a price, the cost) to train them at the best trial's "
                          "measured step time, with its job's global batch and sequence length")
