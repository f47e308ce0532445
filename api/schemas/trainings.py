"""Bodies of the trainings endpoints: what a client submits to train one layout, and how a training and
its per-step metrics are shown."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, model_validator
from pydantic_core import PydanticCustomError

from api.schemas.common import MAX_ID, Name, valid_line
from api.schemas.hf import HFConfigIn
from api.schemas.jobs import ClusterIn, ClusterOut, ModelSpecIn
from api.schemas.router import RouterOptionsIn
from spec.router_options import FIELDS as ROUTER_FIELDS
from api.schemas.proxy import ProxyIn, ProxyOut
from spec.limits import MAX_EXPERT_LOAD_CELLS, MAX_GLOBAL_BATCH, MAX_KEEP_LAST, MAX_SEQ_LENGTH
from spec.recipe import DEFAULT_RECIPE

TrainingStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]

ServerPath = Annotated[str, StringConstraints(min_length=1, max_length=4096, strip_whitespace=True),
                       AfterValidator(valid_line)]

MAX_STEPS = 10_000_000


class TrainingCreate(RouterOptionsIn, ProxyIn, HFConfigIn):
    """A training of one layout: either the best trial of a tuning job (``job_id``) or an explicit
    ``layout`` string (``foldtune`` label syntax, e.g. ``tp2 ep2 mbs1``) with its model and cluster. Paths
    are on the server that runs the training."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "layout": "tp1 ep2 dp2 mbs1", "model": "tiny-moe", "cluster": {"gpu": "cpu", "num_gpus": 2},
        "seq_length": 64, "global_batch_size": 8, "data_path": "/data/corpus", "steps": 200,
        "checkpoint_dir": "/ckpt/run1"}]})

    job_id: int | None = Field(None, ge=1, le=MAX_ID, description="train the best layout this tuning job found")
    layout: Name | None = Field(None, description="an explicit layout (ParallelConfig label), with model and cluster")
    model: Name | None = Field(None, description="catalog model name, with layout")
    model_spec: ModelSpecIn | None = Field(None, description="an inline model, with layout")
    cluster: ClusterIn | None = Field(None, description="GPUs to train on, with layout")
    seq_length: int | None = Field(None, ge=1, le=MAX_SEQ_LENGTH, description="tokens per sequence (default: the job's)")
    global_batch_size: int | None = Field(None, ge=1, le=MAX_GLOBAL_BATCH,
                                          description="sequences per optimizer step (default: the job's)")
    data_path: ServerPath = Field(description="a dataset made by `foldtune data prepare`, on the server")
    steps: int = Field(ge=1, le=MAX_STEPS, description="optimizer steps")
    checkpoint_dir: ServerPath = Field(description="where checkpoints are written and resumed from, on the server")
    checkpoint_every: int = Field(0, ge=0, le=MAX_STEPS, description="steps between checkpoints; 0: only at the end")
    keep_last: int = Field(0, ge=0, le=MAX_KEEP_LAST,
                           description="complete checkpoints kept, the newest (older ones are deleted once a new one "
                                       "is complete, so N + 1 exist while one is written); 0: all")
    lr: float = Field(DEFAULT_RECIPE.lr, gt=0, le=10, description="peak learning rate")
    min_lr: float = Field(DEFAULT_RECIPE.min_lr, ge=0, le=10,
                          description="learning rate at the end of the cosine decay")
    warmup_steps: int = Field(DEFAULT_RECIPE.warmup_steps, ge=0, le=MAX_STEPS)
    weight_decay: float = Field(DEFAULT_RECIPE.weight_decay, ge=0, le=10)
    max_grad_norm: float = Field(DEFAULT_RECIPE.max_grad_norm, gt=0, le=1e6)
    eval_every: int = Field(DEFAULT_RECIPE.eval_every, ge=0, le=MAX_STEPS,
                            description="steps between held-out evaluations; 0: at the end")
    eval_batches: int = Field(DEFAULT_RECIPE.eval_batches, ge=1, le=10_000)
    data_seed: int = Field(DEFAULT_RECIPE.data_seed, ge=0, le=MAX_ID)
    moe_aux_loss_coeff: float = Field(DEFAULT_RECIPE.moe_aux_loss_coeff, ge=0, le=100,
                                      description="MoE load-balancing loss coefficient (as `foldtune train`)")
    moe_z_loss_coeff: float = Field(DEFAULT_RECIPE.moe_z_loss_coeff, ge=0, le=100,
                                    description="router z-loss coefficient")

    @model_validator(mode="after")
    def _one_source(self) -> TrainingCreate:
        if (self.job_id is None) == (self.layout is None):
            raise PydanticCustomError("job_id_xor_layout", "give exactly one of job_id (its best layout) or layout")
        if self.layout is not None:
            if (self.model is None) == (self.model_spec is None):
                raise PydanticCustomError("model_xor_model_spec",
                                          "with layout, give exactly one of model (a catalog name) or model_spec")
            if self.cluster is None or self.seq_length is None or self.global_batch_size is None:
                raise PydanticCustomError("layout_needs_workload",
                                          "with layout, give cluster, seq_length and global_batch_size")
        elif (self.model is not None or self.model_spec is not None or self.cluster is not None
              or self.num_layers_override is not None or self.proxy is not None):
            raise PydanticCustomError("job_fixes_workload", "with job_id, the model (and its proxy) and cluster "
                                                            "are the job's; leave them out")
        if self.min_lr > self.lr:
            raise PydanticCustomError("min_lr_le_lr", "min_lr ({min_lr}) must not exceed lr ({lr})",
                                      {"min_lr": self.min_lr, "lr": self.lr})
        return self

    def recipe(self) -> dict[str, Any]:
        """The optimizer/evaluation settings and the router options the runner passes to the training loop."""
        return self.model_dump(include=set(DEFAULT_RECIPE.to_dict()) | set(ROUTER_FIELDS))


class TrainingMetricOut(BaseModel):
    """One optimizer step. Seconds, tokens/s, TFLOPS per GPU, bytes; expert load in tokens per expert."""

    model_config = ConfigDict(from_attributes=True)

    step: int
    loss: float | None
    eval_loss: float | None
    lr: float | None
    grad_norm: float | None
    step_time_s: float | None
    tokens_per_s: float | None
    tflops_per_gpu: float | None
    mfu: float | None
    peak_memory_bytes: int | None
    expert_load_max: float | None
    expert_load_mean: float | None
    created_at: datetime
    predicted_step_time_s: float | None = Field(None, description="the training's cost-model seconds per step "
                                                                  "(the same on every step)")
    step_time_error: float | None = Field(None, description="(predicted - measured) / measured step time")

    def compared(self, predicted_s: float | None) -> TrainingMetricOut:
        """This step with the cost model's step time ``predicted_s`` (seconds) next to the measured one."""
        error = None
        if predicted_s is not None and self.step_time_s:
            error = (predicted_s - self.step_time_s) / self.step_time_s
        return self.model_copy(update={"predicted_step_time_s": predicted_s, "step_time_error": error})


class TrainingOut(BaseModel):
    id: int
    status: TrainingStatus
    job_id: int | None = Field(description="the tuning job whose best layout this trains, if any")
    config: dict[str, Any] = Field(description="the ParallelConfig trained")
    label: str
    model: str = Field(description="the model trained: a proxy's name says so (<model>@tiny, <model>@<N>L)")
    model_spec: dict[str, Any]
    proxy: ProxyOut | None = Field(None, description="the proxy trained instead of the full model, if any")
    training: dict[str, Any] = Field(description="the TrainingSpec (seq_length, global_batch_size, ...)")
    recipe: dict[str, Any] = Field(description="lr, min_lr, warmup_steps, weight_decay, max_grad_norm, eval_*, "
                                               "and the router options (moe_aux_loss_coeff, ...)")
    cluster: ClusterOut
    data_path: str
    steps: int
    checkpoint_dir: str
    checkpoint_every: int | None
    keep_last: int | None = Field(None, description="complete checkpoints kept (the newest); null or 0: all")
    predicted_step_time_s: float | None = Field(description="the cost model's seconds per step for this layout "
                                                            "(a job's best trial's prediction, or the cost model "
                                                            "on the cluster's profile for an explicit layout)")
    measured_step_time_s: float | None = Field(None, description="median seconds per stored step; only on GET "
                                                                 "/v1/trainings/{id}")
    step_time_error: float | None = Field(None, description="(predicted - measured) / measured, with "
                                                            "measured_step_time_s")
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error: str | None
    attempts: int
    runner: str | None
    heartbeat_at: datetime | None
    latest_metrics: TrainingMetricOut | None = Field(description="the last step stored")


class ExpertLoadOut(BaseModel):
    """One optimizer step's routed tokens of each expert in each MoE layer, summed over the global batch."""

    step: int
    moe_layers: int = Field(description="the model's MoE layers (MTP blocks included)")
    layers: list[int] = Field(description="the decoder layer number (0-based; head blocks such as MTP numbered on "
                                          "from the last decoder layer) of each row of tokens: every MoE layer, or "
                                          f"evenly spaced ones where layers × experts exceeds {MAX_EXPERT_LOAD_CELLS}")
    num_experts: int
    tokens: list[list[int]] = Field(description="[row][expert] routed tokens (before any capacity drop)")
    tokens_per_layer: int = Field(description="what each row sums to: global batch × sequence length × top-k")
    max_over_mean: list[float | None] = Field(description="per row: the busiest expert's tokens over the mean "
                                                          "expert's (1 = balanced; null for a row of zeros)")
    max_cells: int = Field(MAX_EXPERT_LOAD_CELLS, description="the most counts stored per step")


class ExpertImbalanceOut(BaseModel):
    step: int
    layers: list[int] = Field(description="decoder layer numbers, as ExpertLoadOut.layers")
    max_over_mean: list[float | None] = Field(description="per layer: busiest expert's tokens / mean expert's")


class ExpertImbalancePage(BaseModel):
    """Steps after ``after_step`` in step order; ``next_after_step`` is null on the last page."""

    items: list[ExpertImbalanceOut]
    limit: int
    after_step: int
    next_after_step: int | None


class MetricsPage(BaseModel):
    """Steps after ``after_step`` in step order; ``next_after_step`` is null on the last page."""

    items: list[TrainingMetricOut]
    limit: int
    after_step: int
    next_after_step: int | None
