"""Bodies of the catalog endpoints: models and hardware profiles."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from pydantic import AfterValidator

from api.schemas.common import BodyIn, Name, valid_text
from spec.limits import MAX_GPUS


class ModelOut(BaseModel):
    name: str
    spec: dict[str, Any] = Field(description="ModelSpec in Megatron argument names")
    num_experts: int | None
    num_layers: int


class ModelList(BaseModel):
    items: list[ModelOut]


class GPUIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name
    peak_flops: dict[Name, Annotated[float, Field(gt=0, le=1e30)]] = Field(
        min_length=1, description="dtype (bf16, fp8, ...) -> dense FLOP/s")
    hbm_bytes: int = Field(gt=0, le=2**60)
    hbm_bandwidth: float = Field(gt=0, le=1e30, description="bytes/s")


Curve = Annotated[list[tuple[float, float]], Field(min_length=1, max_length=10_000)]


class HardwareProfileIn(BodyIn):
    """A HardwareProfile: bandwidths in bytes/s per GPU per direction, latencies in seconds; optional
    measured efficiency curves as [x, efficiency] points (see spec.hardware)."""

    model_config = ConfigDict(extra="forbid")

    name: Name = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$")
    gpu: GPUIn
    gpus_per_node: int = Field(ge=1, le=MAX_GPUS)
    intra_node_bandwidth: float = Field(gt=0, le=1e30)
    intra_node_latency: float = Field(ge=0, le=1e6)
    inter_node_bandwidth: float = Field(gt=0, le=1e30)
    inter_node_latency: float = Field(ge=0, le=1e6)
    gemm_efficiency: Curve | None = None
    gemm_bwd_efficiency: Curve | None = Field(None, description="a linear's forward FLOPs -> achieved / peak of its "
                                              "input- and weight-gradient GEMMs")
    grouped_gemm_efficiency: Curve | None = None
    grouped_gemm_shape_efficiency: dict[Name, Curve] = Field(
        default_factory=dict, description="'<hidden>x<expert ffn>' -> curve of tokens per expert -> achieved / peak")
    dense_fp8_over_bf16: Curve | None = Field(None, description="a dense linear's forward FLOPs -> bf16 seconds / "
                                              "fp8 seconds of its forward + backward, quantisation included")
    grouped_gemm_fp8_over_bf16: dict[Name, Curve] = Field(
        default_factory=dict, description="'<hidden>x<expert ffn>' -> curve of tokens per expert -> the fp8 grouped "
        "GEMM's speed over bf16's")
    attention_fwd_efficiency: Curve | None = Field(None, description="key length -> achieved / bf16 peak, causal")
    attention_bwd_efficiency: Curve | None = Field(None, description="key length -> achieved / bf16 peak, causal")
    collective_efficiency: dict[Name, Curve] = Field(default_factory=dict,
                                                    description="'<collective>:<intra|inter>[:<group size>]' -> curve")
    hbm_efficiency: float | None = Field(None, gt=0, le=10)
    op_launch_s: float | None = Field(None, gt=0, le=1, description="seconds the host needs per eager op")
    collective_launch_s: float | None = Field(None, gt=0, le=1, description="seconds per near-empty collective")
    moe_layer_host_s: float | None = Field(None, gt=0, le=10,
                                           description="seconds of one executor MoE layer fwd+bwd on tiny shapes")
    recompute_region_s: float | None = Field(None, ge=0, le=1, description="host seconds one activation-checkpoint "
                                             "region adds per micro-batch beyond re-running its forward")
    overlap_slowdown: float | None = Field(None, ge=0, le=1, description="fraction of an overlapped gradient "
                                           "collective's seconds the compute beside it still pays")
    sustained_clock_factor: float | None = Field(None, gt=0, le=1, description="tensor-core throughput under "
                                                 "seconds of load / in a short burst (power-limited clock)")
    cp_exchange_fixed_s: float | None = Field(None, ge=0, le=1, description="seconds per CP K/V exchange "
                                              "(fwd+bwd) beyond its bandwidth price, measured")
    cp_chunk_floor_s: float | None = Field(None, ge=0, le=1, description="least seconds of one CP chunk attention "
                                           "call (fwd+bwd) however few its FLOPs, measured")
    optimizer_seconds_per_param: float | None = Field(None, gt=0, le=1e-6, description="seconds per parameter "
                                                      "of the executor's optimizer step on one GPU, measured")
    local_expert_host_s: float | None = Field(None, ge=0, le=1, description="host seconds an executor MoE layer "
                                              "adds per local expert (fwd+bwd), measured (bench/finegrained_moe.py)")
    expert_loop_host_s: float | None = Field(None, ge=0, le=1, description="host seconds per local expert of one GEMM "
                                             "launch per expert and pass (fwd+bwd), measured")
    moe_router_factor: float | None = Field(None, gt=0, le=1000, description="measured / priced seconds of the "
                                            "MoE router")
    moe_permute_factor: float | None = Field(None, gt=0, le=1000, description="measured / priced seconds of the "
                                             "MoE permutation")
    dispatcher_fixed_s: dict[Name, Annotated[float, Field(ge=0, le=1)]] = Field(
        default_factory=dict, description="dispatcher -> seconds per MoE layer's dispatch + combine (fwd+bwd) "
        "beyond its bandwidth price, measured")
    memory_bound_efficiency: dict[Name, Curve] = Field(
        default_factory=dict, description="memory-bound op class (elementwise, norm, activation, permute) -> curve "
        "of bytes per kernel (as the cost model counts them) -> achieved / datasheet bandwidth, measured")
    component_factors: dict[Name, dict[Name, Annotated[float, Field(gt=0, le=1000)]]] = Field(
        default_factory=dict, description="'MODEL@seqS[@mbsM]' -> {cost-model term: measured/predicted}")
    source: Annotated[str, Field(min_length=1, max_length=2000), AfterValidator(valid_text)] = "api"


class HardwareProfileOut(BaseModel):
    name: str
    source: str
    builtin: bool = Field(description="true for the built-in (datasheet) catalog")
    created_at: datetime | None
    profile: dict[str, Any]

