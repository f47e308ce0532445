"""MoE layer: router → dispatcher → grouped SwiGLU experts → combine, plus optional shared experts.

With ``add_bias_linear`` each expert has biases like its weights: ``b13`` [E_local, 2, F/etp] (ETP cuts the
FFN dimension with the weights) and ``b2`` [E_local, H/etp]: ETP cuts the down bias along H, so each ETP rank
adds its own columns to its partial product and the ETP sum carries every column exactly once. A model
whose activation is not plain SwiGLU (GPT-OSS's clamped quick-GeGLU) runs it with torch ops, not the fused
kernel.

Expert weights are stored per local expert in nn.Linear's [out, in] order: the gate and up projections
together as ``w13`` [E_local, 2, F/etp, H] (one grouped GEMM of width 2·F/etp, as Megatron's GroupedMLP
with gated_linear_unit), ``w2`` as [E_local, H, F/etp]. ETP splits the expert FFN dimension, EP the expert
dimension. The layer takes and returns this rank's token slice.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from spec.model_spec import ModelSpec
from executor import recompute
from executor.activation import fused_rows_activation, is_plain_swiglu, mlp_activation
from executor.dispatcher import make_dispatcher
from executor.grouped_swiglu import grouped_swiglu
from executor.kernels import triton_swiglu as fused_act
from executor.kernels.base import KernelBackend
from executor.kernels.fp8 import expert_pick, grouped_gemm as fp8_grouped
from executor.kernels.torch_backend import grouped_mm_works
from executor.mlp import SwiGLUMLP
from executor.options import FP8_EXPERT_GEMMS, ExecutorOptions
from executor.parallel.collectives import all_to_all_async
from executor.parallel.groups import ParallelState
from executor.parallel.sharding import ShardInfo, make_param
from executor.router import Router
from executor.timing import NULL_TIMER, PhaseTimer


def expert_swiglu(x_M2F: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up of the fused gate/up GEMM's output [rows, 2f] (gate = first half) → [rows, f]."""
    if fused_act.available(x_M2F) and fused_act.swiglu_checked(x_M2F.dtype, x_M2F.device):
        return fused_act.swiglu(x_M2F)  # one read of gate and up, gradient written as one [rows, 2f] buffer
    return fused_act.reference(x_M2F)  # F.silu(x[:, :f]) * x[:, f:] on views


class GroupedExperts(torch.nn.Module):
    """E_local SwiGLU experts run as two grouped GEMMs over rows sorted by expert: gate and up fused (N = 2·F/etp),
    then down.

    ``w13`` is [E_local, 2, F/etp, H] with ETP cutting dim 2, so every ETP rank holds its slice of both gate
    and up and one contiguous [E_local, 2·F/etp, H] view feeds the GEMM. The fused GEMM has twice the width
    forward and in both backward GEMMs (dgrad, wgrad), and the dgrad adds gate's and up's contributions to
    the rows' gradient inside the GEMM (no separate add). Measured, the width buys no speed: forward the fused
    GEMM takes as long as the two separate ones, backward about as long as they plus their add
    (docs/benchmarks.md, the fused gate/up GEMM in the 4 × H200 executor table). The layout is Megatron's
    GroupedMLP one and hands the fused SwiGLU a single [rows, 2·F/etp] tensor."""

    def __init__(self, spec: ModelSpec, options: ExecutorOptions, state: ParallelState, layer: int,
                 kernels: KernelBackend, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.kernels = kernels
        self._etp_rank = state.etp.rank
        self.recompute_act = recompute.selective(state.config, "moe_act")
        e, h, f = spec.num_experts, spec.hidden_size, spec.expert_ffn_hidden_size
        p = f"layers.{layer}.experts."

        def param(name, shape, etp_dim):
            info = ShardInfo(p + name, shape, etp_dim=etp_dim, ep_dim=0, expert=True)
            return make_param(info, state, "normal", options.init_method_std, options.seed, device, dtype)

        # Gate and up are drawn as the separate w1 and w3 were (each full-size from its own seed, then cut
        # over etp and ep) and stacked, which equals cutting the stacked full tensor along dim 2: every
        # layout holds its slice of one [E, 2, F, H] tensor, and models start from the pre-fusion weights.
        # (A fresh draw under the name w13 made a tiny test model's embedding gradient cancel to ~4e-8,
        # where Adam (eps 1e-6) turns fp32 reduction-order noise into parameter differences between layouts.)
        gate, up = param("w1", (e, f, h), 1), param("w3", (e, f, h), 1)
        self.w13 = torch.nn.Parameter(torch.stack([gate.detach(), up.detach()], 1))  # [:, 0] gate, [:, 1] up
        self.w13.shard_info = ShardInfo(p + "w13", (e, 2, f, h), etp_dim=2, ep_dim=0, expert=True)
        self.w2 = param("w2", (e, h, f), 2)
        self.act = expert_swiglu if is_plain_swiglu(spec) else fused_rows_activation(spec)
        # one autograd node for GEMM → SwiGLU → GEMM where the plain torch backend runs them (less host work
        # per layer; executor/grouped_swiglu.py); fp8 backends, other activations and biases keep the graph
        self._one_node = (getattr(kernels, "name", None) == "torch" and is_plain_swiglu(spec)
                          and not spec.add_bias_linear)
        # the experts' grouped GEMMs: the backend's, or, where the fp8 backend runs them, what
        # ExecutorOptions.fp8_expert_gemm asks for: foldtune's grouped fp8 kernels, or fp8 and bf16 per shape
        scaling = FP8_EXPERT_GEMMS[options.fp8_expert_gemm]
        fp8_backend = getattr(kernels, "name", None) == "torch-fp8"
        if fp8_backend and options.fp8_expert_gemm == "fastest":
            self._gmm = expert_pick.grouped_mm
        elif fp8_backend and scaling is not None:
            self._gmm = functools.partial(fp8_grouped.grouped_mm, scaling=scaling,
                                          torch_candidate=options.fp8_expert_gemm == "auto")
        else:
            self._gmm = kernels.grouped_mm
        self.b13 = self.b2 = None
        if spec.add_bias_linear:
            def bias(name, shape, etp_dim):
                info = ShardInfo(p + name, shape, etp_dim=etp_dim, ep_dim=0, expert=True)
                return make_param(info, state, "zeros", 0.0, options.seed, device, dtype)
            self.b13 = bias("b13", (e, 2, f), 2)
            self.b2 = bias("b2", (e, h), 1)

    def forward(self, x_MH: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
        if self._one_node and x_MH.shape[0] and grouped_mm_works(x_MH.device, x_MH.dtype):
            return grouped_swiglu(x_MH, self.w13, self.w2, offs, self.recompute_act and torch.is_grad_enabled())
        gmm = self._gmm
        gate_up = gmm(x_MH, self.w13.flatten(1, 2), offs)  # [rows, 2·f/etp]: gate | up
        expert_of_row = None
        if self.b13 is not None:
            expert_of_row = torch.repeat_interleave(
                torch.arange(tokens_per_expert.numel(), device=x_MH.device), tokens_per_expert,
                output_size=x_MH.shape[0])
            gate_up = gate_up + self.b13.flatten(1, 2).index_select(0, expert_of_row)
        act = recompute.run(self.recompute_act, self.act, gate_up)
        y = gmm(act, self.w2, offs)
        if self.b2 is not None:  # this ETP rank's columns of the bias; the ETP sum adds each once
            start = self._etp_rank * self.b2.shape[1]
            bias = self.b2.index_select(0, expert_of_row)
            y = y + F.pad(bias, (start, y.shape[1] - start - bias.shape[1]))
        return y


class MoELayer(torch.nn.Module):
    def __init__(self, spec: ModelSpec, options: ExecutorOptions, state: ParallelState, layer: int,
                 kernels: KernelBackend, device: torch.device, dtype: torch.dtype, timer: PhaseTimer = NULL_TIMER):
        super().__init__()
        self.timer = timer
        self.layer_number = layer  # the decoder layer's index in the whole model (head blocks count on from L)
        self.router = Router(spec, options, state, layer, device, dtype)
        self.experts = GroupedExperts(spec, options, state, layer, kernels, device, dtype)
        self.dispatcher = make_dispatcher(state.config.moe_token_dispatcher_type, state, spec.num_experts,
                                          spec.moe_router_topk, timer)
        self.shared = None
        if spec.shared_expert_ffn_hidden_size:
            self.shared = SwiGLUMLP(f"layers.{layer}.shared_experts.", spec.hidden_size,
                                    spec.shared_expert_ffn_hidden_size, options, state, device, dtype, timer,
                                    phase="shared_experts", bias=spec.add_bias_linear, act=mlp_activation(spec))
        self.shared_gate = None
        if spec.moe_shared_expert_gate:
            # replicated [1, h]; each TP rank sees its sequence slice, so its gradient is TP-partial
            info = ShardInfo(f"layers.{layer}.shared_experts.gate_weight", (1, spec.hidden_size), tp_partial=True)
            self.shared_gate = make_param(info, state, "normal", options.init_method_std, options.seed, device, dtype)
        self.last_tokens_per_expert: torch.Tensor | None = None
        self.recompute_shared = recompute.selective(state.config, "shared_experts")
        # Megatron's --moe-shared-expert-overlap: the shared experts run while the dispatch all-to-all is in flight
        self.shared_overlap = bool(state.config.moe_shared_expert_overlap) and self.shared is not None

    def forward(self, x_SBH: torch.Tensor, real=None, logits: torch.Tensor | None = None,
                shared: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(output slice [s/tp, b, h], this rank's share of the router losses). ``real``: a packed micro-batch's
        :class:`executor.router.RealTokens` (padding routed but left out of the routing statistics). ``logits``
        (the router's, [s·b/tp, experts]) and ``shared`` (the shared experts' output): already computed for
        ``x_SBH``, by the layer's CUDA graphs (executor.cuda_graphs)."""
        tokens, routing = self.route(x_SBH, real, logits)
        if shared is not None:
            dispatched = self.dispatcher.dispatch(tokens, routing)
        elif self.shared_overlap:
            dispatched, shared = self.dispatch_beside_shared(tokens, routing, x_SBH)
        else:
            dispatched, shared = self.dispatcher.dispatch(tokens, routing), None
        y = self.dispatcher.combine(self.run_experts(dispatched), dispatched)
        return self.finish(y, x_SBH, shared), routing.loss

    # forward's parts, which the overlapped schedule (executor/ep_overlap.py) runs around the all-to-alls

    def route(self, x_SBH: torch.Tensor, real=None, logits: torch.Tensor | None = None):
        """(this rank's tokens [s·b/tp, h], their Routing); ``real`` as :meth:`forward` takes it; ``logits``: the
        router's, already computed."""
        s, b, h = x_SBH.shape
        x = self.timer.mark(x_SBH, "other", "router")
        tokens = x.reshape(s * b, h)
        routing = self.router(tokens, b, real, logits)
        self.last_tokens_per_expert = routing.reported_tokens_per_expert
        return self.timer.mark(tokens, "router", "dispatch"), routing

    def run_experts(self, dispatched) -> torch.Tensor:
        """The local experts' output [M, h] for the dispatched rows (ETP: a partial sum)."""
        rows = self.timer.mark(dispatched.x_MH, "dispatch", "experts")
        rows = self.experts(rows, dispatched.tokens_per_expert)
        return self.timer.mark(rows, "experts", "combine")

    def dispatch_beside_shared(self, tokens: torch.Tensor, routing, x_SBH: torch.Tensor):
        """(the dispatched rows, the shared experts' output [s/tp, b, h]), the shared experts computed after
        the dispatch all-to-all was started and before it is waited for: on GPU their GEMMs run while the
        rows are on the wire (gloo: while its thread exchanges them). The same operations as the in-line
        dispatch followed by the shared experts, in another order; a dispatch without an all-to-all (ep 1,
        the allgather dispatcher) runs in line."""
        d = self.dispatcher
        rows, ctx = d.dispatch_preprocess(tokens, routing)
        if not d.has_exchange(ctx):
            return d.dispatch_postprocess(rows, ctx), self.shared_output(x_SBH)
        send, recv = d.exchange_sizes(ctx)  # the host waits for the split sizes before the exchange starts
        pending = all_to_all_async(rows, recv, send, d.exchange_group)
        shared = self.shared_output(x_SBH)
        return d.dispatch_postprocess(pending.wait(), ctx), shared

    def shared_output(self, x_SBH: torch.Tensor) -> torch.Tensor:
        """The shared experts' output for ``x_SBH`` (under their selective recompute when asked)."""
        return recompute.run(self.recompute_shared, self._shared_experts, x_SBH)

    def finish(self, y_NH: torch.Tensor, x_SBH: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
        """The combined tokens [n, h] as the layer's output [s/tp, b, h], plus the shared experts' of ``x_SBH``
        (``shared``: already computed, beside the dispatch)."""
        y = self.timer.mark(y_NH.view(x_SBH.shape), "combine", "other")
        if self.shared is not None:
            y = y + (self.shared_output(x_SBH) if shared is None else shared)
        return y

    def _shared_experts(self, x_SBH: torch.Tensor) -> torch.Tensor:
        """Shared experts' output for this rank's slice, scaled per token by sigmoid(x · w_gate) when gated
        (Megatron's moe_shared_expert_gate, Qwen2-MoE's shared_expert_gate)."""
        y = self.shared(x_SBH)
        if self.shared_gate is None:
            return y
        return y * torch.sigmoid(F.linear(x_SBH, self.shared_gate))
