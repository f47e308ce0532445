"""Bodies of POST /plans: the cost model's instant ranking of folded layouts (no run, no job)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from api.schemas.jobs import ClusterOut, WorkloadIn


class PlanCreate(WorkloadIn):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "model": "mixtral-8x7b", "training": {"seq_length": 4096, "global_batch_size": 256},
        "cluster": {"gpu": "h100", "num_gpus": 64}, "top": 5}]})

    top: int = Field(10, ge=1, le=100, description="how many of the fastest fitting layouts to return")


class RejectedRule(BaseModel):
    count: int = Field(description="configs rejected by this rule")
    example: str = Field(description="the reason, for one of them")


class PlanOut(BaseModel):
    """Estimates (fastest first) carry the layout, its ParallelConfig, predicted step time (s),
    tokens/s/GPU, TFLOPS/GPU, MFU, memory bytes by term, the limiter and a one-line explanation."""

    model: str
    cluster: ClusterOut
    training: dict[str, Any]
    considered: int = Field(description="configs enumerated")
    valid: int = Field(description="configs passing every Megatron validity rule")
    rejected: dict[str, RejectedRule]
    pruned_by_memory: int
    fitting: int
    ranked: list[dict[str, Any]]
    closest: dict[str, Any] | None = Field(description="the least-over-memory config when none fits")
    seconds: float = Field(description="planning wall time")
