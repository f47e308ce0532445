"""MoE layer: router → dispatcher → grouped SwiGLU experts → combine, plus optional shared experts.

Expert weights are stored per local expert as [E_local, out, in] (nn.Linear's order); ETP splits the
expert FFN dimension, EP the expert dimension. The layer takes and returns this rank's token slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from costmodel.model_spec import ModelSpec
from executor import recompute
from executor.dispatcher import make_dispatcher
from executor.kernels import triton_swiglu as fused_act
from executor.kernels.base import KernelBackend
from executor.mlp import SwiGLUMLP
from executor.options import ExecutorOptions
from executor.parallel.groups import ParallelState
from executor.parallel.sharding import ShardInfo, make_param
from executor.router import Router
from executor.timing import NULL_TIMER, PhaseTimer


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if fused_act.available(gate) and fused_act.swiglu_checked(gate.dtype, gate.device):
        return fused_act.swiglu(gate, up)  # one read of gate and up, no [rows, ffn] temporary
    return F.silu(gate) * up


class GroupedExperts(torch.nn.Module):
    """E_local SwiGLU experts run as three grouped GEMMs over rows sorted by expert."""

    def __init__(self, spec: ModelSpec, options: ExecutorOptions, state: ParallelState, layer: int,
                 kernels: KernelBackend, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.kernels = kernels
        self.recompute_act = recompute.selective(state.config, "moe_act")
        e, h, f = spec.num_experts, spec.hidden_size, spec.expert_ffn_hidden_size
        p = f"layers.{layer}.experts."

        def param(name, shape, etp_dim):
            info = ShardInfo(p + name, shape, etp_dim=etp_dim, ep_dim=0, expert=True)
            return make_param(info, state, "normal", options.init_method_std, options.seed, device, dtype)

        self.w1 = param("w1", (e, f, h), 1)
        self.w3 = param("w3", (e, f, h), 1)
        self.w2 = param("w2", (e, h, f), 2)

    def forward(self, x_MH: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
        gmm = self.kernels.grouped_mm
        act = recompute.run(self.recompute_act, _swiglu, gmm(x_MH, self.w1, offs), gmm(x_MH, self.w3, offs))
        return gmm(act, self.w2, offs)


class MoELayer(torch.nn.Module):
    def __init__(self, spec: ModelSpec, options: ExecutorOptions, state: ParallelState, layer: int,
                 kernels: KernelBackend, device: torch.device, dtype: torch.dtype, timer: PhaseTimer = NULL_TIMER):
        super().__init__()
        self.timer = timer
        self.router = Router(spec, options, state, layer, device, dtype)
        self.experts = GroupedExperts(spec, options, state, layer, kernels, device, dtype)
        self.dispatcher = make_dispatcher(state.config.moe_token_dispatcher_type, state, spec.num_experts,
                                          spec.moe_router_topk, timer)
        self.shared = None
        if spec.shared_expert_ffn_hidden_size:
            self.shared = SwiGLUMLP(f"layers.{layer}.shared_experts.", spec.hidden_size,
                                    spec.shared_expert_ffn_hidden_size, options, state, device, dtype, timer,
                                    phase="shared_experts")
        self.last_tokens_per_expert: torch.Tensor | None = None
        self.recompute_shared = recompute.selective(state.config, "shared_experts")

    def forward(self, x_SBH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output slice [s/tp, b, h], this rank's share of the router losses)."""
        s, b, h = x_SBH.shape
        x = self.timer.mark(x_SBH, "other", "router")
        tokens = x.reshape(s * b, h)
        routing = self.router(tokens)
        self.last_tokens_per_expert = routing.tokens_per_expert
        tokens = self.timer.mark(tokens, "router", "dispatch")
        dispatched = self.dispatcher.dispatch(tokens, routing)
        rows = self.timer.mark(dispatched.x_MH, "dispatch", "experts")
        rows = self.experts(rows, dispatched.tokens_per_expert)
        rows = self.timer.mark(rows, "experts", "combine")
        y = self.dispatcher.combine(rows, dispatched).view(s, b, h)
        y = self.timer.mark(y, "combine", "other")
        if self.shared is not None:
            y = y + recompute.run(self.recompute_shared, self.shared, x_SBH)
        return y, routing.loss
