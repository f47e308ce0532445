"""The "time and cost to train N tokens" question of POST /v1/plans and GET /v1/best, and its answer
(costmodel.training_run: steps = ceil(tokens / (global batch × seq)), wall time = steps × step time, cost =
GPUs × hours × price)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from spec.limits import MAX_PRICE_PER_GPU_HOUR, MAX_TRAIN_TOKENS

TOKENS_DESCRIPTION = (f"tokens to train (1 to {MAX_TRAIN_TOKENS:.0e}; a JSON number such as 1.5e12): the answer "
                      "gives the wall time at the step time and, with price_per_gpu_hour, the cost")
PRICE_DESCRIPTION = (f"US dollars per GPU-hour (more than 0, at most {MAX_PRICE_PER_GPU_HOUR:g}; needs tokens): "
                     "cost = GPUs × hours × price")
TOKENS_FIELD = dict(ge=1, le=MAX_TRAIN_TOKENS, description=TOKENS_DESCRIPTION)
PRICE_FIELD = dict(gt=0, le=MAX_PRICE_PER_GPU_HOUR, allow_inf_nan=False, description=PRICE_DESCRIPTION)
PRICE_NEEDS_TOKENS = "price_needs_tokens"


class TrainingRunOut(BaseModel):
    """Training ``tokens`` tokens at one layout's step time (seconds; hours; USD)."""

    layout: str | None = Field(None, description="the layout this run is of (a plan's ranked layouts, in order)")
    tokens: int
    tokens_per_step: int = Field(description="global_batch_size × seq_length")
    steps: int = Field(description="optimizer steps: ceil(tokens / tokens_per_step)")
    step_time_s: float = Field(description="seconds per step the run is priced at")
    wall_s: float = Field(description="steps × step_time_s (steady-state steps only)")
    num_gpus: int
    gpu_hours: float = Field(description="num_gpus × wall_s / 3600")
    price_per_gpu_hour: float | None = Field(description="US dollars, as asked (null: not asked)")
    cost_usd: float | None = Field(description="gpu_hours × price_per_gpu_hour (null without a price)")
