"""Fine-grained MoE on one rank, priced term by term: what ``bench/finegrained_moe.py`` measures it against.

A GPU holding many small experts (DeepSeek-V3: 256 experts of FFN 2048 at hidden 7168; Qwen3-30B-A3B: 128 of FFN
768 at hidden 2048; both top-8) pays per MoE layer and micro-batch: the router over all experts (its GEMM, the
scores, top-k and aux loss), the permutation of the top-8 copies (permute, sort by local expert, unpermute), the
local experts' grouped GEMMs, the host's launches (per layer and per local expert) and the token exchange. This
module gives the cost model's figures for those pieces at one point (model, local experts, tokens per rank):

* :func:`routed_proxy`: the one-layer proxy the GPU runs, the model's routed experts without its shared expert;
* :func:`point_layout`: the layout of a rank holding ``local_experts`` experts (EP = experts / local, one rank
  per EP member, TP = CP = ETP = 1, the alltoall dispatcher);
* :func:`priced_point`: the priced pieces (:func:`costmodel.step_time.moe_piece_times`) of that rank, in
  seconds per micro-batch, forward + backward; :func:`priced_host_probe`: the host seconds (:mod:`costmodel.host`)
  of the host probe's layer (all its local experts on one rank) and what each local expert adds;
* :func:`exchange_messages`: the top-8 exchange's message sizes per peer at EP 8..64 under uniform routing,
  for the alltoall dispatcher (one row per (token, chosen expert) on the peer) and the flex dispatcher (one row
  per (token, peer its choices reach)), with the seconds the cost model prices for them. One GPU cannot
  measure an exchange between GPUs: these are priced, never measured here.

Units: seconds, bytes, tokens. Pure Python (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from costmodel.comm import Call, GroupPlacements, call_time, link_rates
from costmodel.dispatch import FlexPricing, alltoall_dispatch_bytes, dispatcher_pricing
from costmodel.host import layer_host_ops, local_expert_host_ops, seconds_per_op
from costmodel.step_time import moe_piece_times
from spec.catalog import get_model
from spec.hardware import ClusterSpec, HardwareProfile
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.proxy import tiny_proxy
from spec.rank_groups import GridSizes
from spec.training_spec import TrainingSpec

#: the fine-grained models measured by default, and the local expert counts and EP sizes of the tables
MODELS = ("deepseek-v3", "qwen3-30b-a3b")
LOCAL_EXPERTS = (4, 8, 16, 32, 64)
EXCHANGE_EPS = (8, 16, 32, 64)
DISPATCHER = "alltoall"


def routed_proxy(name: str) -> ModelSpec:
    """One MoE layer of catalog model ``name`` at its real widths and routing rule, without its shared expert
    (priced and run alike; the shared expert is a dense MLP that no per-expert term touches), named
    '<name>@1L'. ``name`` may carry '@tiny' (``spec.proxy.tiny_proxy``: test widths, for CPU runs) and the
    '@1L' of a stored record's name."""
    parts = name.split("@")
    model = get_model(parts[0])
    if "tiny" in parts[1:]:
        model = tiny_proxy(model)
    model = model.with_layers(1)
    return replace(model, moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False)


def point_layout(model: ModelSpec, local_experts: int) -> ParallelConfig:
    """The layout whose EP ranks hold ``local_experts`` of ``model``'s experts each (one rank per EP member;
    ValueError when they do not divide the experts)."""
    experts = model.num_experts or 1
    if local_experts < 1 or experts % local_experts:
        raise ValueError(f"{local_experts} local experts do not divide {model.name}'s {experts} experts")
    ep = experts // local_experts
    return ParallelConfig(world_size=ep, ep=ep, micro_batch_size=1, moe_token_dispatcher_type=DISPATCHER)


def point_training(tokens: int, ep: int) -> TrainingSpec:
    """``tokens`` per rank per micro-batch (seq ``tokens``, micro-batch 1), bf16; the weight gradients written by
    autograd, not accumulated into fp32 main gradients (the measured layer attaches none)."""
    return TrainingSpec(seq_length=tokens, global_batch_size=ep, precision="bf16", gradient_accumulation_fusion=True)


@dataclass(frozen=True)
class PricedPoint:
    """The cost model's device seconds (forward + backward, one micro-batch) of one rank holding
    ``local_experts``, per piece (:func:`costmodel.step_time.moe_piece_times`)."""

    model: str
    local_experts: int
    ep: int
    tokens: int
    pieces: dict[str, float]

    @property
    def permutation_s(self) -> float:
        """Permute, sort by local expert and back, unpermute."""
        return self.pieces["permute"] + self.pieces["sort"] + self.pieces["unpermute"]

    @property
    def experts_s(self) -> float:
        """The local experts: grouped GEMMs and what runs beside them."""
        return self.pieces["grouped_gemm"] + self.pieces["experts_other"]


def priced_point(name: str, local_experts: int, tokens: int, hardware: HardwareProfile) -> PricedPoint:
    """:class:`PricedPoint` of model ``name`` on ``hardware`` (its factors and measured host seconds applied)."""
    model = routed_proxy(name)
    config = point_layout(model, local_experts)
    cluster = ClusterSpec(hardware, config.world_size)
    pieces = moe_piece_times(model, point_training(tokens, config.ep), cluster, config)
    return PricedPoint(name, local_experts, config.ep, tokens, pieces)


def host_probe_model(name: str, local_experts: int) -> ModelSpec:
    """The layer the host probe issues (``executor.microbench.finegrained.measure_host``): model ``name``'s widths
    with ``local_experts`` experts all on one rank, top-min(k, local_experts) plain softmax routing."""
    model = routed_proxy(name)
    return replace(model, num_experts=local_experts, moe_router_topk=min(model.moe_router_topk, local_experts),
                   moe_router_score_function="softmax", moe_router_num_groups=None, moe_router_group_topk=None,
                   moe_router_topk_scaling_factor=None, moe_router_pre_softmax=False)


def priced_host_probe(name: str, local_experts: int, hardware: HardwareProfile) -> tuple[float, float]:
    """(host seconds the time model prices the host probe's layer at, forward + backward of one micro-batch on one
    rank; what its local experts add to them per expert)."""
    model = host_probe_model(name, local_experts)
    config = ParallelConfig(world_size=1, micro_batch_size=1)
    per_op = seconds_per_op(hardware)
    layer = layer_host_ops(model, config, True, hardware).seconds(per_op, hardware.collective_launch_seconds)
    return layer, local_expert_host_ops(model, config, hardware).ops * per_op / local_experts


@dataclass(frozen=True)
class ExchangeRow:
    """One EP size's top-k exchange for ``tokens`` tokens per rank: per-peer message bytes of one dispatch
    (alltoall: the copies routed to that peer's experts; flex: one row per token reaching the peer), and the
    seconds the cost model prices one dispatch at, within a node of ``gpus_per_node`` or across nodes."""

    model: str
    ep: int
    tokens: int
    nodes: int
    alltoall_peer_bytes: float
    alltoall_send_bytes: float  # what leaves the rank (its own experts' share stays)
    alltoall_dispatch_s: float  # one all-to-all of the dispatch (a layer has four: dispatch and combine, each way)
    flex_peer_bytes: float
    flex_dispatch_s: float  # one flex dispatch pass (DeepEP kernels)


def exchange_messages(name: str, tokens: int, hardware: HardwareProfile, eps: tuple[int, ...] = EXCHANGE_EPS,
                      act_bytes: int = 2) -> list[ExchangeRow]:
    """:class:`ExchangeRow` per EP size in ``eps`` that divides model ``name``'s experts (uniform routing, bf16
    rows)."""
    model = routed_proxy(name)
    h, topk = model.hidden_size, model.moe_router_topk
    link = link_rates(hardware)
    flex = dispatcher_pricing("flex_deepep")
    assert isinstance(flex, FlexPricing)
    rows = []
    for ep in (e for e in eps if e > 1 and (model.num_experts or 1) % e == 0):
        place = GroupPlacements(GridSizes(ep=ep), hardware.gpus_per_node).of("ep")
        buffer = alltoall_dispatch_bytes(tokens, topk, h, act_bytes)
        dispatch_s = call_time(link, Call("all_to_all", "ep", buffer, "forward"), place)
        flex_rows = flex.rows_to_peers(model, tokens, ep, 1)
        flex_s, _ = flex.pass_seconds(link, model, act_bytes, tokens, place, 1)
        rows.append(ExchangeRow(name, ep, tokens, place.nodes, buffer / ep, buffer * (ep - 1) / ep, dispatch_s,
                                flex_rows / (ep - 1) * h * act_bytes, flex_s))
    return rows
