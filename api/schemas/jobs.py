"""Bodies of the jobs endpoints: what a client submits, and how jobs and trials are shown."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator
from pydantic_core import PydanticCustomError

from api.schemas.common import Name, spec_validator
from api.schemas.hf import HFConfigIn
from api.schemas.router import RouterOptionsIn
from api.schemas.proxy import ProxyIn, ProxyOut
from spec.hardware import DEFAULT_MIN_HEADROOM, MAX_HEADROOM_FRACTION
from spec.limits import MAX_EXPERT_RATIO, MAX_GPUS, MAX_SLICE_LAYERS, MAX_TRIALS, MAX_VERIFY_LAYOUTS
from spec.routing_scenarios import DEFAULT_HOT_FACTOR
from spec.model_spec import ModelSpec
from spec.multimodal import MAX_IMAGE_SIDE, MAX_IMAGES_PER_SAMPLE, ImageInputs
from spec.shape_defaults import default_precision
from spec.training_spec import TrainingSpec

JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
JobKind = Literal["tune", "verify"]
TrialStatus = Literal["running", "succeeded", "pruned", "failed"]

ModelSpecIn = Annotated[ModelSpec, spec_validator(ModelSpec, "model_spec_rules")]
TrainingSpecIn = Annotated[TrainingSpec, spec_validator(TrainingSpec, "training_spec_rules")]

MAX_SECONDS = 30 * 24 * 3600.0


class ClusterIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gpu: Name = Field(description="hardware profile: built-in (h100, h200, cpu, ...) or stored via /hardware-profiles",
                      examples=["h100"])
    num_gpus: int = Field(ge=1, le=MAX_GPUS, examples=[8])
    min_headroom: float | None = Field(
        None, ge=0, le=2**50,  # plans and jobs; a training's layout is the user's
        description="memory per GPU kept free when pruning layouts: a fraction of the GPU's memory below 1 "
                    f"(at most {MAX_HEADROOM_FRACTION}), else bytes; default {DEFAULT_MIN_HEADROOM}",
        examples=[0.1, 4e9])


class BudgetIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_trials: int = Field(20, ge=1, le=MAX_TRIALS, description="measured trials at most")
    max_seconds: float | None = Field(3600.0, gt=0, le=MAX_SECONDS, description="wall-clock seconds of search at most")


class WorkloadIn(ProxyIn, HFConfigIn):
    """What to lay out: a model (by catalog name ``model``, inline ``model_spec`` or a Hugging Face ``hf_config``,
    optionally as a proxy), the training recipe and the cluster."""

    model_config = ConfigDict(extra="forbid")

    model: Name | None = Field(None, description="catalog model name (GET /v1/models)")
    model_spec: ModelSpecIn | None = Field(None, description="an inline model in Megatron argument names")
    training: TrainingSpecIn = Field(description="the training recipe; without a precision: fp32 on cpu, bf16 on "
                                                 "GPUs (spec.shape_defaults, as the CLI)")
    cluster: ClusterIn
    _precision_given: bool = PrivateAttr(True)

    @model_validator(mode="wrap")
    @classmethod
    def _note_precision(cls, data: Any, handler) -> WorkloadIn:
        """Remember whether the body named the training's precision: the default depends on the cluster's GPU
        kind, which only the service knows (a stored profile's name), so :meth:`training_for` applies it."""
        request = handler(data)
        training = data.get("training") if isinstance(data, dict) else None
        if isinstance(training, dict):
            request._precision_given = "precision" in training
        return request

    def training_for(self, gpu_kind: str) -> TrainingSpec:
        """The training, at the shared default precision of ``gpu_kind`` when the body named none."""
        if self._precision_given:
            return self.training
        return dataclasses.replace(self.training, precision=default_precision(gpu_kind))

    @model_validator(mode="after")
    def _one_model(self) -> WorkloadIn:
        if (self.model is None) == (self.model_spec is None):
            raise PydanticCustomError("model_xor_model_spec",
                                      "give exactly one of model (a catalog name) or model_spec")
        return self


class ImagesIn(BaseModel):
    """The images of each training sample of a vision-language model (spec.multimodal.ImageInputs): still
    images of ``image_height`` x ``image_width`` pixels, ``images_per_sample`` per sample."""

    model_config = ConfigDict(extra="forbid")

    images_per_sample: int = Field(ge=1, le=MAX_IMAGES_PER_SAMPLE, examples=[4])
    image_height: int = Field(448, ge=1, le=MAX_IMAGE_SIDE, description="pixels")
    image_width: int = Field(448, ge=1, le=MAX_IMAGE_SIDE, description="pixels")

    def inputs(self) -> ImageInputs:
        return ImageInputs(self.images_per_sample, self.image_height, self.image_width)


class VerifyIn(BaseModel):
    """What a verify job checks: the plan's ``top`` layouts, each by one rank built and timed on the runner's
    device (docs/verify.md)."""

    model_config = ConfigDict(extra="forbid")

    top: int = Field(3, ge=1, le=MAX_VERIFY_LAYOUTS, description="how many of the plan's fastest layouts to check")
    slice_gpu: Name | None = Field(None, description="the hardware the slices run on (the runner's device), which "
                                                     "prices their compute for the comparison: built-in or stored "
                                                     "profile, cpu for CPU slices; default: the cluster's gpu")
    slice_layers: int = Field(2, ge=1, le=MAX_SLICE_LAYERS,
                              description="decoder layers of each kind a slice builds at most")
    hot_expert_factor: float = Field(DEFAULT_HOT_FACTOR, ge=1.0, le=MAX_EXPERT_RATIO,
                                     description="the skewed routing's hottest expert, in multiples of the mean")


class JobCreate(WorkloadIn, RouterOptionsIn):
    """A job: the workload, and for a tuning job (``kind`` 'tune', the default) the search budget and the router
    options its trials train with; for a verify job ('verify') what to check (``verify``)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "model": "tiny-moe", "training": {"seq_length": 128, "global_batch_size": 8},
        "cluster": {"gpu": "cpu", "num_gpus": 4}, "budget": {"max_trials": 6, "max_seconds": 600}}]})

    kind: JobKind = Field("tune", description="tune: search layouts by measured trials; verify: check the plan's "
                                              "top layouts by one-rank slices timed on the runner's device")
    verify: VerifyIn | None = Field(None, description="a verify job's request (kind 'verify'; defaults if absent)")
    budget: BudgetIn = Field(default_factory=BudgetIn)
    images: ImagesIn | None = Field(
        None, description="a vision-language model's images per sample (GET /v1/models lists no such model; "
                          "docs/multimodal.md: qwen3-vl-30b-a3b, tiny-vl-moe, ENCODER+LLM): its trials search "
                          "multimodal layouts (placement, encoder tp/dp) on synthetic images; stored with the "
                          "training spec under 'images', so part of the signature")
    search_precision: bool = Field(
        False, description="measure precision as a knob: the trials run the training's precision, bf16 and fp8 "
                           "(fp8 only on GPUs with an fp8 peak; the job's result says when it is left out), each "
                           "trial at its own, ranked together by predicted step time; stored with the training "
                           "spec, so such a job has its own signature")


    @model_validator(mode="after")
    def _verify_request(self) -> JobCreate:
        if self.kind == "verify":
            if self.verify is None:
                self.verify = VerifyIn()
            if self.search_precision:
                raise PydanticCustomError("verify_one_precision",
                                          "a verify job checks one precision's plan: search_precision is a tuning "
                                          "job's")
        elif self.verify is not None:
            raise PydanticCustomError("verify_needs_kind", "verify is a verify job's request: give kind 'verify'")
        return self


class ClusterOut(BaseModel):
    gpu: str
    num_gpus: int


class PlanClusterOut(ClusterOut):
    min_headroom: float = Field(description="memory per GPU kept free: a fraction below 1, else bytes")
    min_headroom_bytes: int = Field(description="the bytes per GPU that keeps free")
    usable_hbm_bytes: int = Field(description="bytes per GPU a layout may use: memory less reserved and headroom")


class BudgetOut(BaseModel):
    max_trials: int
    max_seconds: float | None


class TrialCounts(BaseModel):
    total: int = 0
    running: int = 0
    succeeded: int = 0
    pruned: int = 0
    failed: int = 0


class TrialOut(BaseModel):
    """One measured (or attempted) layout. Times in seconds; ``measurement`` is the executor's Measurement."""

    id: int
    job_id: int
    number: int = Field(description="Optuna trial number within the job")
    status: TrialStatus
    config: dict[str, Any] = Field(description="the ParallelConfig (tp, cp, pp, vpp, ep, etp, micro_batch_size, ...)")
    label: str | None = Field(description="the layout's label, with the trial's precision as its last token when "
                                           "the job searched precision (reads back with "
                                           "ParallelConfig.parse_labelled)")
    precision: str | None = Field(None, description="the training precision the trial ran at (a job with "
                                                    "search_precision measures each trial at its own)")
    predicted_step_time_s: float | None
    predicted: dict[str, Any] | None = Field(description="the cost model's breakdown")
    step_time_s: float | None = Field(description="measured seconds per optimizer step")
    measurement: dict[str, Any] | None
    failure_kind: str | None
    failure_reason: str | None
    started_at: datetime
    finished_at: datetime | None


class JobOut(BaseModel):
    id: int
    status: JobStatus
    model: str = Field(description="the model measured: a proxy's name says so (<model>@tiny, <model>@<N>L)")
    model_spec: dict[str, Any]
    proxy: ProxyOut | None = Field(None, description="the proxy measured instead of the full model, if any")
    training: dict[str, Any]
    cluster: ClusterOut
    budget: BudgetOut
    signature: str = Field(description="SHA-256 of (model spec, training spec, gpu, num_gpus); GET /v1/best?signature=")
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error: str | None
    attempts: int = Field(description="how many times a runner claimed the job")
    runner: str | None = Field(description="id of the runner holding the job")
    heartbeat_at: datetime | None
    trials: TrialCounts
    best_trial: TrialOut | None
    calibration: dict[str, Any] | None = Field(description="what the search learned about the cost model")
    kind: JobKind = Field("tune", description="tune (trials) or verify (one-rank slices of the plan's top layouts)")
    verify: dict[str, Any] | None = Field(None, description="a verify job's request")
    report: dict[str, Any] | None = Field(None, description="a verify job's report: per layout and routing, the "
                                                            "measured vs predicted compute per term, the checked step "
                                                            "and the re-ranking (planner.verify)")
