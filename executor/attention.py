"""Self-attention block: RMSNorm → column-parallel Q/K/V → RoPE → causal GQA SDPA → row-parallel output.

TP splits query and key/value heads (heads/tp and kv_heads/tp per rank); under SP the block takes and
returns this rank's sequence slice [s/tp, b, h]. Q/K/V biases (``add_qkv_bias`` or ``add_bias_linear``) and
learned sinks split with their heads; the output bias (``add_bias_linear``) is replicated and added once,
after the reduce-scatter, to this rank's sequence slice, so its gradient is a TP-partial sum. Layers with a
sliding window or sinks attend through :mod:`executor.attention_core` on the mask the model sets. q/k norms
are the module of the model's scope (:mod:`executor.qk_norms`): per head (Qwen3) or, with
``qk_layernorm_scope='all'`` (OLMoE), over a token's whole q and k before the head split, their weights
split with the heads.

Speed switches (ExecutorOptions): ``fused_qkv`` projects Q, K and V in one GEMM against the weights
concatenated per call and not kept for backward (the parameters stay wq/wk/wv: checkpoints and TP sharding
are unchanged; 'torch' kernels only, as the fp8 backend caches each weight's quantised form per parameter;
not with q/k norms, which keep their inputs); ``fused_rope`` rotates q and k in one Triton launch on CUDA
(:mod:`executor.kernels.triton_rope`); ``fused_rms_norm`` runs the input RMSNorm as one Triton kernel each
way on CUDA (:mod:`executor.kernels.triton_rms_norm`); ``attention_backend`` puts cuDNN or flash first among
SDPA's kernels on CUDA.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from spec.model_spec import ModelSpec
from executor import recompute
from executor.offload import offloaded
from executor.attention_core import special_attention
from executor.documents import Documents, document_attention
from executor.kernels import triton_rope
from executor.kernels.triton_rms_norm import pick_rms_norm
from executor.kernels.base import KernelBackend
from executor.options import ExecutorOptions
from executor.parallel.cp_exchange import check_ring_layer, cp_exchange, run_cp_attention
from executor.parallel.groups import ParallelState
from executor.parallel.sharding import ShardInfo, make_param
from executor.parallel.tensor_parallel import enter_tp, gathered, leave_tp, scattered, tp_overlap
from executor.timing import NULL_TIMER, PhaseTimer
from executor.qk_norms import make_qk_norm


def rope_tables(seq_length: int, head_dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [s, head_dim] of rotary embeddings (fp32)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_length, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x_BHSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    """``x`` rotated by cos/sin [s, d], or [b, s, d] per row (packed documents restart their positions)."""
    if cos_SD.dim() == 3:
        cos_SD, sin_SD = cos_SD.unsqueeze(1), sin_SD.unsqueeze(1)
    half = x_BHSD.shape[-1] // 2
    rotated = torch.cat([-x_BHSD[..., half:], x_BHSD[..., :half]], dim=-1)
    return (x_BHSD * cos_SD.to(x_BHSD.dtype) + rotated * sin_SD.to(x_BHSD.dtype))


#: ExecutorOptions.attention_backend -> SDPA kernels in priority order (None: torch's own choice).
_SDPA_ORDER = {
    "auto": None,
    "cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
              SDPBackend.MATH],
    "flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
}


class _QKVLinear(torch.autograd.Function):
    """x · [wq; wk; wv]ᵀ as one GEMM. Autograd keeps x and the three parameters, not their concatenation (a
    weight-sized copy per layer held until backward); backward concatenates again for the input gradient and
    hands each weight its rows of the one weight-gradient GEMM."""

    @staticmethod
    def forward(ctx, x, wq, wk, wv):
        ctx.save_for_backward(x, wq, wk, wv)
        return torch.nn.functional.linear(x, torch.cat([wq, wk, wv]))

    @staticmethod
    def backward(ctx, dy):
        x, wq, wk, wv = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch.matmul(dy, torch.cat([wq, wk, wv]))
        if any(ctx.needs_input_grad[1:]):
            dw = torch.matmul(dy.reshape(-1, dy.shape[-1]).t(), x.reshape(-1, x.shape[-1]))
            nq, nk = wq.shape[0], wk.shape[0]
            dw = (dw[:nq], dw[nq: nq + nk], dw[nq + nk:])
        return (dx, *(dw or (None, None, None)))


class _SplitQKV(torch.autograd.Function):
    """The fused projection's output [..., (hq + 2·hk)·d] cut into q, k (views) and v (its own storage: the
    attention's backward keeps it, and a view would keep the whole output alive). Backward writes the three
    gradients into one tensor with a single concatenation; autograd's slices would each fill a zero tensor of
    the full width and copy their part into it, and two full-width adds would sum the three (measured 0.38 ms of
    a 37 ms Mixtral two-layer step on an H200, bench/stack_profile.py)."""

    @staticmethod
    def forward(ctx, y, nq: int, nk: int):
        return y[..., :nq], y[..., nq: nq + nk], y[..., nq + nk:].contiguous()

    @staticmethod
    def backward(ctx, dq, dk, dv):
        # autograd materialises an unused output's gradient as zeros (set_materialize_grads' default)
        return torch.cat([dq, dk, dv], dim=-1), None, None


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
        self.cp_exchange = cp_exchange(state.config.cp_comm_type)
        self.window = spec.attention_window(layer)
        self.plain = self.window is None and spec.softmax_type == "vanilla"  # the causal kernels take it
        check_ring_layer(state.config, self.plain)
        # [s/cp, s] mask (True = attend) in global positions, set by the model under CP or when not plain
        self.mask = None
        self.heads = spec.num_attention_heads // state.tp.size
        # fp8 caches each weight's quantised form per parameter: a per-call concatenation would defeat it
        # (and q/k norms keep their inputs, which as views would keep the whole fused output alive)
        self.fuse_qkv = options.fused_qkv and kernels.name == "torch" and not spec.qk_layernorm
        self.input_norm = pick_rms_norm(options.fused_rms_norm, kernels)
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
        self.qk_norm = make_qk_norm(spec, param, kernels, state, options.norm_epsilon,
                                    options.fused_rms_norm)  # the scope's module

    def forward(self, x_SBH: torch.Tensor, rope: tuple) -> torch.Tensor:
        """Attention output (without residual) for this rank's sequence slice [s/tp, b, h]. ``rope``: (cos, sin)
        [s, d], or for a packed micro-batch (cos, sin [b, s, d] per document, its :class:`Documents`)."""
        eps, d = self.options.norm_epsilon, self.spec.head_dim
        x = self.timer.mark(x_SBH, "other", "attention")
        x = recompute.run(self.recompute_norm, self.input_norm, x, self.norm, eps, offload=self.offload_norm)
        overlap = tp_overlap(self.state)
        if overlap:  # the all-gather under the projections of this rank's slice
            q, k, v = gathered(x, self._project_all, self.state)
        else:
            x = self.timer.mark(x, "attention", "tp_allgather")
            x = enter_tp(x, self.state)
            x = self.timer.mark(x, "tp_allgather", "attention")
            q, k, v = self._project_all(x)
        s, b = q.shape[0], q.shape[1]
        if self.qk_norm is not None:
            q, k = self.qk_norm(q, k)
        q, k = q.view(s, b, self.heads, d), k.view(s, b, self.kv_heads, d)
        v = v.view(s, b, self.kv_heads, d).permute(1, 2, 0, 3)
        cos, sin, *packed = rope
        docs: Documents | None = packed[0] if packed else None
        if self.options.fused_rope and docs is None and triton_rope.available(q, k):
            q, k = triton_rope.fused_rope(q, k, cos, sin)
            q, k = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3)
        else:
            q = apply_rope(q.permute(1, 2, 0, 3), cos, sin)
            k = apply_rope(k.permute(1, 2, 0, 3), cos, sin)
        if self.cp.size > 1:  # the layout's CP communication type (executor.parallel.cp_exchange)
            o = run_cp_attention(self, q, k, v, self.recompute_core, self.offload_core, docs=docs)
        else:
            o = recompute.run(self.recompute_core, self.core_attention, q, k, v, docs,  # [b, heads, s, d]
                              offload=self.offload_core)
        o = o.permute(2, 0, 1, 3).reshape(s, b, self.heads * d)
        if overlap:  # the reduce-scatter of each piece of the output projection under the next piece's GEMM
            o = scattered(o, lambda rows: self.kernels.linear(rows, self.wo), self.state)
        else:
            o = self.kernels.linear(o, self.wo)
            o = self.timer.mark(o, "attention", "tp_reduce_scatter")
            o = self.timer.mark(leave_tp(o, self.state), "tp_reduce_scatter", "attention")
        if self.bo is not None:  # after the reduce-scatter: added once, not once per TP rank
            o = o + self.bo
        return self.timer.mark(o, "attention", "other")

    def _project_all(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K, V of the normalised input rows ``x`` [rows, b, h] (row-wise)."""
        if self.fuse_qkv:
            return self._project_qkv(x)
        return (self._project(x, self.wq, self.bq), self._project(x, self.wk, self.bk),
                self._project(x, self.wv, self.bv))

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       docs: Documents | None = None) -> torch.Tensor:
        """The attention core of this rank's queries [b, heads, s/cp, d] against its keys and values: under CP
        its communication type's core (``cp_exchange``: the gathered keys, the ring, or the all-to-all's whole
        sequences), else the masked path for a window or sinks (the causal kernels take neither) or the
        backend's causal attention; with ``docs`` (a packed micro-batch) within documents only. What core_attn
        recomputation checkpoints."""
        if self.cp.size > 1:
            return self.cp_exchange.core(self, q, k, v, self.sinks, docs)
        if docs is not None:
            if self.plain:  # on CUDA flex attention, skipping the blocks that pair no document
                return document_attention(q, k, v, docs)
            return special_attention(q, k, v, docs.whole(self.window), self.sinks)
        if not self.plain:
            return special_attention(q, k, v, self.mask, self.sinks)
        return self._attention(q, k, v)

    def local_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over whole sequences, as without CP (the a2a CP types run it on their heads)."""
        return self._attention(q, k, v)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The backend's causal attention, with SDPA's kernel order of ``options.attention_backend`` on CUDA."""
        order = _SDPA_ORDER[self.options.attention_backend]
        if order is None or not q.is_cuda:
            return self.kernels.attention(q, k, v)
        with sdpa_kernel(order, set_priority=True):
            return self.kernels.attention(q, k, v)

    def _project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K, V as column slices of one GEMM against [wq; wk; wv] (:class:`_QKVLinear`)."""
        y = _QKVLinear.apply(x, self.wq, self.wk, self.wv)
        if self.bq is not None:
            y = y + torch.cat([self.bq, self.bk, self.bv])
        # q and k are read once (RoPE writes new tensors, keeping nothing); v is kept for the attention's
        # backward and gets its own storage, or its view would keep the whole [tokens, (hq + 2·hk)·d] alive
        return _SplitQKV.apply(y, self.wq.shape[0], self.wk.shape[0])

    def _project(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.kernels.linear(x, w)
        return y if bias is None else y + bias
