"""Body of GET /best: the fastest measured layout for one (model, training, cluster) signature."""

from __future__ import annotations

from pydantic import BaseModel

from api.schemas.jobs import ClusterOut, TrialOut


class BestOut(BaseModel):
    signature: str
    model: str
    cluster: ClusterOut
    job_id: int
    trial: TrialOut
    jobs_considered: int
