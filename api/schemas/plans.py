"""Bodies of POST /plans: the cost model's instant ranking of folded layouts (no run, no job)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from spec.parallel_config import ACTIVATION_OFFLOAD_MODULES, ParallelConfig
from spec.limits import MAX_LAYERS
from spec.pipeline_layout import MAX_LAYOUT_CHARS, PipelineSplit
from planner.enumerate import VPP_LIMIT
from api.schemas.jobs import PlanClusterOut, WorkloadIn
from api.schemas.training_run import PRICE_FIELD, PRICE_NEEDS_TOKENS, TOKENS_FIELD, TrainingRunOut


class PipelineIn(BaseModel):
    """Megatron-LM's pipeline placement options, applied to every layout of the plan (``spec.pipeline_layout``).
    The layout string excludes the others; first/last stage layers exclude the embedding/loss accounting."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True}]})

    pipeline_model_parallel_layout: str | None = Field(
        None, min_length=1, max_length=MAX_LAYOUT_CHARS,
        description="e.g. 'Et*3|(tt|)*29,m|L': E embedding, t decoder layer, m MTP layer, L loss, '|' between "
                    "chunks (flattened: chunk j is virtual stage j // pp of rank j % pp); it fixes pp·vpp")
    decoder_first_pipeline_num_layers: int | None = Field(None, ge=0, le=MAX_LAYERS)
    decoder_last_pipeline_num_layers: int | None = Field(None, ge=0, le=MAX_LAYERS)
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False

    def split(self) -> PipelineSplit:
        return PipelineSplit(self.pipeline_model_parallel_layout, self.decoder_first_pipeline_num_layers,
                             self.decoder_last_pipeline_num_layers, self.account_for_embedding_in_pipeline_split,
                             self.account_for_loss_in_pipeline_split)


class PlanCreate(WorkloadIn):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "model": "mixtral-8x7b", "training": {"seq_length": 4096, "global_batch_size": 256},
        "cluster": {"gpu": "h100", "num_gpus": 64}, "top": 5}]})

    top: int = Field(10, ge=1, le=100, description="how many of the fastest fitting layouts to return")
    megatron: bool = Field(False, description="rank by step time alone: what Megatron-Core can run (default: the "
                                              "layouts foldtune's executor runs first)")
    pipeline: PipelineIn | None = Field(None, description="Megatron's pipeline placement options (default: "
                                                          "pp·vpp chunks differing by at most one layer)")
    vpp_max: int = Field(4, ge=1, le=VPP_LIMIT, description="largest number of virtual stages per pipeline rank "
                                                             "tried (a layout string fixes it instead)")
    search_precision: bool = Field(False, description="plan bf16 and fp8 (fp8 only on GPUs with an fp8 peak) and "
                                                      "return the better by rank_by; training.precision is then ignored")
    optimizer_offload: list[float] = Field(
        [], max_length=4, description="optimizer CPU offload fractions (0, 1] tried beside none (Megatron's "
                                      "--optimizer-offload-fraction; only with the distributed optimizer)")
    optimizer_dtypes: list[str] = Field(
        [], max_length=4, description="optimizer state dtypes tried beside fp32, each 'EXP_AVG+EXP_AVG_SQ+MAIN_PARAMS' "
                                      "(e.g. 'bf16+bf16+fp32'; Megatron's precision-aware optimizer: --exp-avg-dtype, "
                                      "--exp-avg-sq-dtype, --main-params-dtype; only with the distributed optimizer)")
    activation_offload: list[list[str]] = Field(
        [], max_length=4, description="module sets whose saved activations are tried in CPU memory, each of "
                                      f"{', '.join(ACTIVATION_OFFLOAD_MODULES)}")
    tokens: int | None = Field(None, **TOKENS_FIELD)
    price_per_gpu_hour: float | None = Field(None, **PRICE_FIELD)
    rank_by: Literal["robust", "point"] = Field(
        "robust", description="order of ``ranked``: robust, by the high end of each layout's step-time interval, "
                              "or point, by the point estimate")

    @model_validator(mode="after")
    def _price_needs_tokens(self) -> PlanCreate:
        if self.price_per_gpu_hour is not None and self.tokens is None:
            raise PydanticCustomError(PRICE_NEEDS_TOKENS, "price_per_gpu_hour needs tokens (the number to price)")
        return self


class RejectedRule(BaseModel):
    count: int = Field(description="configs rejected by this rule")
    example: str = Field(description="the reason, for one of them")


# Seconds or bytes as the cost model computed them: a whole number stays an int, so this JSON is the same
# as `foldtune plan --json` writes (a bare float would turn 313984 into 313984.0).
Number = int | float


class MemoryBytesOut(BaseModel):
    """Predicted peak memory of the most loaded pipeline stage, bytes per GPU by term."""

    total: Number
    stage: int = Field(description="the pipeline stage the peak is on")
    weights: Number
    grads: Number
    optimizer: Number
    activations: Number
    logits: Number
    comm_buffers: Number
    allocator_overhead: Number
    details: dict[str, Number] = Field(description="finer terms (bytes), e.g. per activation tensor")
    host_offloaded: Number = Field(0, description="bytes the offload knobs keep in this rank's CPU memory instead "
                                                  "(optimizer state, activations); not part of total")


class IntervalOut(BaseModel):
    """Where the measured value should lie (the plan's ``interval_rate`` of layouts): low and high end."""

    low: Number
    high: Number


class TermProvenanceOut(BaseModel):
    """Where one term's constants come from and the relative width that gives it
    (``costmodel.uncertainty``): the term lies in [v·(1 − low), v·(1 + high)]."""

    source: str = Field(description="what it is priced from; terms of one source err together")
    provenance: str = Field(description="calibrated, measured, extrapolated, datasheet, unmeasured_network or "
                                        "derived (recomputation, bubble: the widths of the terms they repeat)")
    low: Number
    high: Number
    note: str


class EstimateOut(BaseModel):
    """One layout's prediction: ``Estimate.to_dict`` (seconds, tokens/s/GPU, TFLOP/s per GPU, bytes)."""

    layout: str = Field(description="ParallelConfig.label(); parses back with ParallelConfig.parse")
    config: ParallelConfig
    step_time_s: Number
    tokens_per_s_per_gpu: Number
    tflops_per_gpu: Number
    mfu: Number
    fits: bool
    memory_headroom_bytes: Number = Field(description="usable HBM minus the predicted peak (negative: over)")
    limiter: str = Field(description="'memory' when it does not fit or has < 5 % headroom, else the bottleneck")
    explanation: str
    executable: bool | None = Field(description="whether foldtune's executor runs this layout (false: only "
                                                "Megatron-Core does; null: not judged)")
    executable_reason: str | None = Field(description="why foldtune's executor does not run it: every executor "
                                                       "rule of the rule book it breaks, '[rule] reason'; null when "
                                                       "it does")
    bottleneck: str
    time_terms_s: dict[str, Number] = Field(description="exposed seconds per step by term")
    time_hidden_s: dict[str, Number] = Field(description="seconds per step hidden behind other work, by term")
    memory_bytes: MemoryBytesOut
    step_time_interval_s: IntervalOut | None = Field(
        None, description="step time interval (s): independent sources in quadrature, overlapped collectives "
                          "worst case; its high end is what the robust rank orders by")
    memory_interval_bytes: IntervalOut | None = Field(None, description="peak memory interval (bytes per GPU)")
    interval_rate: Number | None = Field(None, description="share of layouts whose measurement the intervals "
                                                           "are meant to hold")
    time_provenance: dict[str, TermProvenanceOut] | None = Field(None, description="per term of the term table")


class PlanOut(BaseModel):
    """Estimates (best first by ``rank_by``) carry the layout, its ParallelConfig, predicted step time (s) and its
    interval, tokens/s/GPU, TFLOPS/GPU, MFU, memory bytes by term and their interval, the limiter and a one-line
    explanation."""

    model: str
    cluster: PlanClusterOut
    training: dict[str, Any]
    considered: int = Field(description="configs enumerated")
    valid: int = Field(description="configs passing every Megatron validity rule")
    rejected: dict[str, RejectedRule]
    pruned_by_memory: int
    fitting: int
    ranking: Literal["executable_first", "megatron"] = Field(
        description="executable_first: the fastest layouts foldtune's executor runs, then (when fewer than top "
                    "run) the fastest only Megatron-Core runs; megatron: the fastest by step time alone")
    rank_by: str = Field("robust", description="what ``ranked`` is ordered by: robust (the step-time interval's "
                                               "high end) or point (the point estimate)")
    robust_exact: bool = Field(True, description="false when the robust order is among a shortlist of the "
                                                 "fastest by point estimate, not over every fitting layout")
    robust_shortlist: int = Field(0, description="under robust: how many layouts, fastest by point estimate, the "
                                                 "robust order is drawn from at most")
    ranked: list[EstimateOut]
    closest: EstimateOut | None = Field(description="the least-over-memory config when none fits")
    seconds: float = Field(description="planning wall time")
    precision_search: dict[str, float | None] | None = Field(
        None, description="with search_precision: each planned precision's best predicted step time (s; null "
                          "where nothing fits); ``training.precision`` is the one whose best layout ranks "
                          "first by rank_by")
    training_runs: list[TrainingRunOut] | None = Field(
        None, description="with tokens: the time (and with a price, the cost) to train them at each ranked "
                          "layout's predicted step time, in ranked order")
