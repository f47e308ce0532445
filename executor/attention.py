"""Self-attention block: RMSNorm → column-parallel Q/K/V → RoPE → causal GQA SDPA → row-parallel output.

TP splits query and key/value heads (heads/tp and kv_heads/tp per rank); under SP the block takes and
returns this rank's sequence slice [s/tp, b, h]. Q/K/V biases (``add_qkv_bias`` or ``add_bias_linear``) and
learned sinks split with their heads; the output bias (``add_bias_linear``) is replicated and added once,
after the reduce-scatter, to this rank's sequence slice, so its gradient is a TP-partial sum. Layers with a
sliding window or sinks attend through :mod:`executor.attention_core` on the mask the model sets. q/k norms
are per head (Qwen3) or, with ``qk_layernorm_scope='all'`` (OLMoE), over a token's whole q and k before the
head split, their weights split with the heads (:mod:`executor.tp_rms_norm`).
"""

from __future__ import annotations

import torch

from spec.model_spec import ModelSpec
from executor import recompute
from executor.offload import offloaded
from executor.attention_core import special_attention
from executor.kernels.base import KernelBackend
from executor.options import ExecutorOptions
from executor.parallel.context_parallel import cp_attention, gather_kv
from executor.parallel.groups import ParallelState
from executor.parallel.sharding import ShardInfo, make_param
from executor.parallel.tensor_parallel import enter_tp, leave_tp
from executor.timing import NULL_TIMER, PhaseTimer
from executor.tp_rms_norm import tp_rms_norm


def rope_tables(seq_length: int, head_dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [s, head_dim] of rotary embeddings (fp32)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_length, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x_BHSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    half = x_BHSD.shape[-1] // 2
    rotated = torch.cat([-x_BHSD[..., half:], x_BHSD[..., :half]], dim=-1)
    return (x_BHSD * cos_SD.to(x_BHSD.dtype) + rotated * sin_SD.to(x_BHSD.dtype))


class Attention(torch.nn.Module):
    def __init__(self, spec: ModelSpec, options: ExecutorOptions, state: ParallelState, layer: int,
                 kernels: KernelBackend, device: torch.device, dtype: torch.dtype, timer: PhaseTimer = NULL_TIMER):
        super().__init__()
        self.spec, self.options, self.state, self.kernels, self.timer = spec, options, state, kernels, timer
        h, d = spec.hidden_size, spec.head_dim
        self.recompute_core = recompute.selective(state.config, "core_attn")
        self.recompute_norm = recompute.selective(state.config, "layernorm")
        self.offload_core = offloaded(state.config, "core_attn")
        self.offload_norm = offloaded(state.config, "layernorm")
        self.cp = state["cp"]
        self.window = spec.attention_window(layer)
        self.plain = self.window is None and spec.softmax_type == "vanilla"  # the causal kernels take it
        # [s/cp, s] mask (True = attend) in global positions, set by the model under CP or when not plain
        self.mask = None
        self.heads = spec.num_attention_heads // state.tp.size
        self.kv_heads = spec.num_kv_heads // state.tp.size
        p = f"layers.{layer}.attention."

        def param(name, shape, init="normal", **kw):
            info = ShardInfo(p + name, shape, **kw)
            return make_param(info, state, init, options.init_method_std, options.seed, device, dtype)

        self.norm = param("norm.weight", (h,), "ones", tp_partial=True)
        self.wq = param("wq.weight", (spec.num_attention_heads * d, h), tp_dim=0)
        self.wk = param("wk.weight", (spec.num_kv_heads * d, h), tp_dim=0)
        self.wv = param("wv.weight", (spec.num_kv_heads * d, h), tp_dim=0)
        self.wo = param("wo.weight", (h, spec.num_attention_heads * d), tp_dim=1)
        self.bq = self.bk = self.bv = self.bo = self.sinks = None
        if spec.add_qkv_bias or spec.add_bias_linear:
            self.bq = param("wq.bias", (spec.num_attention_heads * d,), "zeros", tp_dim=0)
            self.bk = param("wk.bias", (spec.num_kv_heads * d,), "zeros", tp_dim=0)
            self.bv = param("wv.bias", (spec.num_kv_heads * d,), "zeros", tp_dim=0)
        if spec.add_bias_linear:
            self.bo = param("wo.bias", (h,), "zeros", tp_partial=True)
        if spec.softmax_type == "learnable":
            self.sinks = param("sinks", (spec.num_attention_heads,), "zeros", tp_dim=0)
        elif spec.softmax_type == "off-by-one":
            self.register_buffer("sinks", torch.zeros(self.heads, device=device, dtype=dtype), persistent=False)
        self.qk_norm_all = spec.qk_layernorm and spec.qk_layernorm_scope == "all"
        if self.qk_norm_all:  # OLMoE: one norm over a token's whole q (k), split over TP with the heads
            self.q_norm = param("q_norm.weight", (spec.num_attention_heads * d,), "ones", tp_dim=0)
            self.k_norm = param("k_norm.weight", (spec.num_kv_heads * d,), "ones", tp_dim=0)
        elif spec.qk_layernorm:
            self.q_norm = param("q_norm.weight", (d,), "ones", tp_partial=True)
            self.k_norm = param("k_norm.weight", (d,), "ones", tp_partial=True)

    def forward(self, x_SBH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Attention output (without residual) for this rank's sequence slice [s/tp, b, h]."""
        eps, d = self.options.norm_epsilon, self.spec.head_dim
        x = self.timer.mark(x_SBH, "other", "attention")
        x = recompute.run(self.recompute_norm, self.kernels.rms_norm, x, self.norm, eps,
                          offload=self.offload_norm)
        x = self.timer.mark(x, "attention", "tp_allgather")
        x = enter_tp(x, self.state)
        x = self.timer.mark(x, "tp_allgather", "attention")
        s, b, _ = x.shape
        q, k = self._project(x, self.wq, self.bq), self._project(x, self.wk, self.bk)
        if self.qk_norm_all:
            q = tp_rms_norm(q, self.q_norm, self.spec.num_attention_heads * d, eps, self.state.tp)
            k = tp_rms_norm(k, self.k_norm, self.spec.num_kv_heads * d, eps, self.state.tp)
        q = q.view(s, b, self.heads, d).permute(1, 2, 0, 3)
        k = k.view(s, b, self.kv_heads, d).permute(1, 2, 0, 3)
        v = self._project(x, self.wv, self.bv).view(s, b, self.kv_heads, d).permute(1, 2, 0, 3)
        if self.spec.qk_layernorm and not self.qk_norm_all:
            q = self.kernels.rms_norm(q, self.q_norm, eps)
            k = self.kernels.rms_norm(k, self.k_norm, eps)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.cp.size > 1:
            q = self.timer.mark(q, "attention", "cp_allgather")
            k, v = gather_kv(k, self.cp), gather_kv(v, self.cp)
            k = self.timer.mark(k, "cp_allgather", "attention")
        if not self.plain:  # a window or sinks: the masked path (the CP flash kernel takes neither)
            o = recompute.run(self.recompute_core, special_attention, q, k, v, self.mask, self.sinks,
                              offload=self.offload_core)
        elif self.cp.size > 1:
            o = recompute.run(self.recompute_core, cp_attention, q, k, v, self.mask, self.cp.size, self.cp.rank,
                              offload=self.offload_core)
        else:
            o = recompute.run(self.recompute_core, self.kernels.attention, q, k, v,  # [b, heads, s, d]
                              offload=self.offload_core)
        o = o.permute(2, 0, 1, 3).reshape(s, b, self.heads * d)
        o = self.kernels.linear(o, self.wo)
        o = self.timer.mark(o, "attention", "tp_reduce_scatter")
        o = leave_tp(o, self.state)
        if self.bo is not None:  # after the reduce-scatter: added once, not once per TP rank
            o = o + self.bo
        return self.timer.mark(o, "tp_reduce_scatter", "other")

    def _project(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.kernels.linear(x, w)
        return y if bias is None else y + bias
