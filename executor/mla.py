"""Multi-Latent Attention (DeepSeek-V2/V3), with Megatron-Core's MLASelfAttention semantics.

Per token, after the input RMSNorm:

- queries: ``linear_q_proj`` (no ``q_lora_rank``), or ``linear_q_down_proj`` to q_lora_rank → ``q_layernorm``
  → ``linear_q_up_proj``; each head gets qk_head_dim "nope" dims and qk_pos_emb_head_dim RoPE dims;
- keys and values: ``linear_kv_down_proj`` to kv_lora_rank + qk_pos_emb_head_dim; the last part is k_pe, ONE
  RoPE key head shared by every head; the latent goes through ``kv_layernorm`` and ``linear_kv_up_proj`` to
  qk_head_dim key dims and v_head_dim value dims per head;
- RoPE on the decoupled dims only, causal MHA with softmax scale 1/sqrt(qk_head_dim + qk_pos_emb_head_dim)
  (SDPA's default for that query width), ``linear_proj`` from heads·v_head_dim back to hidden.

RoPE convention: HF's DeepSeek-V2/V3 (``rope_interleave``): rotated pairs are adjacent dims (2i, 2i+1), and
the rotated vector comes out in half-split order. Megatron-Core's default (``rotary_interleaved=False``)
rotates (i, i + d/2) instead; the two differ by a fixed permutation of the RoPE output rows of
linear_q_(up_)proj and linear_kv_down_proj, which checkpoint converters apply. Here it costs one copy of
the small RoPE slice.

Parallelism, as Megatron lays it out: TP splits heads (the up projections are column-parallel over heads,
``linear_proj`` row-parallel). The down projections and both latent norms are replicated and run on this
rank's sequence slice under SP, so their gradients cover part of the sequence (``tp_partial``); the
latents — not the hidden states — are what is all-gathered over TP (q_lora_rank or hidden, plus kv_lora_rank
and qk_pos_emb_head_dim per token; one collective). CP runs as for GQA attention: per-head K and V are
exchanged as the layout's CP communication type says (executor/parallel/cp_exchange.py).
"""

from __future__ import annotations

import torch

from spec.model_spec import ModelSpec
from executor import recompute
from executor.offload import offloaded
from executor.attention import apply_rope
from executor.kernels.base import KernelBackend
from executor.kernels.triton_rms_norm import pick_rms_norm
from executor.options import ExecutorOptions
from executor.parallel.cp_exchange import cp_exchange, run_cp_attention
from executor.parallel.groups import ParallelState
from executor.parallel.sharding import ShardInfo, make_param
from executor.parallel.tensor_parallel import enter_tp, leave_tp, scattered, tp_overlap
from executor.timing import NULL_TIMER, PhaseTimer


def apply_rope_interleaved(x: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    """RoPE of pairs (2i, 2i+1) of the last dim, output in half-split order (HF DeepSeek's convention).

    ``x`` [..., s, d], ``cos_SD``/``sin_SD`` [s, d] from :func:`executor.attention.rope_tables`.
    """
    x = x.unflatten(-1, (x.shape[-1] // 2, 2)).transpose(-1, -2).flatten(-2)
    return apply_rope(x, cos_SD, sin_SD)


class MLASelfAttention(torch.nn.Module):
    """Multi-latent self-attention block: this rank's sequence slice [s/tp, b, h] in and out (no residual)."""

    def __init__(self, spec: ModelSpec, options: ExecutorOptions, state: ParallelState, layer: int,
                 kernels: KernelBackend, device: torch.device, dtype: torch.dtype, timer: PhaseTimer = NULL_TIMER):
        super().__init__()
        self.spec, self.options, self.state, self.kernels, self.timer = spec, options, state, kernels, timer
        self.rms_norm = pick_rms_norm(options.fused_rms_norm, kernels)
        h, n = spec.hidden_size, spec.num_attention_heads
        qk, rope, v = spec.qk_head_dim, spec.qk_pos_emb_head_dim, spec.v_head_dim
        self.recompute_core = recompute.selective(state.config, "core_attn")
        self.recompute_norm = recompute.selective(state.config, "layernorm")
        self.offload_core = offloaded(state.config, "core_attn")
        self.offload_norm = offloaded(state.config, "layernorm")
        # Megatron's mla_up_proj: the up projections (and RoPE) re-run in backward, so only the gathered
        # latents stay. Torch's checkpoint keeps a region's inputs, so the region is the up projections and
        # the attention core together (the executor rule asks core_attn beside mla_up_proj)
        self.recompute_up = recompute.selective(state.config, "mla_up_proj")
        self.cp = state["cp"]
        self.cp_exchange = cp_exchange(state.config.cp_comm_type)
        # plain causal attention (the executor rule rejects MLA with windows or sinks); under CP the model sets
        # ``mask`` [s/cp, s], the causal mask in global positions
        self.window, self.plain, self.mask = None, True, None
        self.heads = n // state.tp.size
        p = f"layers.{layer}.attention."

        def param(name, shape, init="normal", **kw):
            info = ShardInfo(p + name, shape, **kw)
            return make_param(info, state, init, options.init_method_std, options.seed, device, dtype)

        self.norm = param("norm.weight", (h,), "ones", tp_partial=True)
        if spec.q_lora_rank is None:
            self.linear_q_proj = param("linear_q_proj.weight", (n * (qk + rope), h), tp_dim=0)
        else:
            self.linear_q_down_proj = param("linear_q_down_proj.weight", (spec.q_lora_rank, h), tp_partial=True)
            self.q_layernorm = param("q_layernorm.weight", (spec.q_lora_rank,), "ones", tp_partial=True)
            self.linear_q_up_proj = param("linear_q_up_proj.weight", (n * (qk + rope), spec.q_lora_rank), tp_dim=0)
        self.linear_kv_down_proj = param("linear_kv_down_proj.weight", (spec.kv_lora_rank + rope, h), tp_partial=True)
        self.kv_layernorm = param("kv_layernorm.weight", (spec.kv_lora_rank,), "ones", tp_partial=True)
        self.linear_kv_up_proj = param("linear_kv_up_proj.weight", (n * (qk + v), spec.kv_lora_rank), tp_dim=0)
        self.linear_proj = param("linear_proj.weight", (h, n * v), tp_dim=1)

    def _latents(self, x_SBH: torch.Tensor) -> torch.Tensor:
        """Normalised input → [q latent (or the input itself) | normalised kv latent | k_pe] per token."""
        spec = self.spec
        if spec.q_lora_rank is None:
            q_latent = x_SBH
        else:
            q_latent = self._norm(self.kernels.linear(x_SBH, self.linear_q_down_proj), self.q_layernorm)
        kv = self.kernels.linear(x_SBH, self.linear_kv_down_proj)
        kv_latent, k_pe = kv.split([spec.kv_lora_rank, spec.qk_pos_emb_head_dim], dim=-1)
        return torch.cat([q_latent, self._norm(kv_latent, self.kv_layernorm), k_pe], dim=-1)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # selective "layernorm" recompute covers every norm of the block, the latent ones included
        return recompute.run(self.recompute_norm, self.rms_norm, x, weight, self.options.norm_epsilon,
                             offload=self.offload_norm)

    def _qkv(self, latents_SBL: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Full-sequence latents → q, k [b, heads, s, qk+rope] and v [b, heads, s, v_head_dim] (RoPE applied)."""
        spec = self.spec
        qk, rope, v_dim = spec.qk_head_dim, spec.qk_pos_emb_head_dim, spec.v_head_dim
        s, b, _ = latents_SBL.shape
        q_width = spec.hidden_size if spec.q_lora_rank is None else spec.q_lora_rank
        q_latent, kv_latent, k_pe = latents_SBL.split([q_width, spec.kv_lora_rank, rope], dim=-1)
        q_weight = self.linear_q_proj if spec.q_lora_rank is None else self.linear_q_up_proj
        q = self.kernels.linear(q_latent, q_weight).view(s, b, self.heads, qk + rope).permute(1, 2, 0, 3)
        kv = self.kernels.linear(kv_latent, self.linear_kv_up_proj).view(s, b, self.heads, qk + v_dim)
        k_nope, v = kv.permute(1, 2, 0, 3).split([qk, v_dim], dim=-1)
        q_nope, q_pe = q.split([qk, rope], dim=-1)
        q = torch.cat([q_nope, apply_rope_interleaved(q_pe, cos, sin)], dim=-1)
        k_pe = apply_rope_interleaved(k_pe.permute(1, 0, 2).unsqueeze(1), cos, sin)  # [b, 1, s, rope]: one head
        k = torch.cat([k_nope, k_pe.expand(-1, self.heads, -1, -1)], dim=-1)
        return q, k, v

    def forward(self, x_SBH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Attention output (without residual) for this rank's sequence slice [s/tp, b, h]."""
        x = self.timer.mark(x_SBH, "other", "attention")
        latents = self._latents(self._norm(x, self.norm))
        latents = self.timer.mark(latents, "attention", "tp_allgather")
        latents = enter_tp(latents, self.state)
        latents = self.timer.mark(latents, "tp_allgather", "attention")
        s, b, _ = latents.shape
        if self.recompute_up:
            o = recompute.run(True, self._up_and_core, latents, *rope)
        else:
            o = self._core(*self._qkv(latents, *rope))
        o = o.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.spec.v_head_dim)
        if tp_overlap(self.state):  # the output projection's reduce-scatter under its next piece's GEMM (the
            # latents' all-gather stays in line: the up projections after it apply RoPE by sequence position)
            o = scattered(o, lambda rows: self.kernels.linear(rows, self.linear_proj), self.state)
            return self.timer.mark(o, "attention", "other")
        o = self.kernels.linear(o, self.linear_proj)
        o = self.timer.mark(o, "attention", "tp_reduce_scatter")
        o = leave_tp(o, self.state)
        return self.timer.mark(o, "tp_reduce_scatter", "other")

    def _up_and_core(self, latents_SBL: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The up projections, RoPE and the attention core in one recomputed region (mla_up_proj)."""
        q, k, v = self._qkv(latents_SBL, cos, sin)
        return self._attend(q, k, v)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention core without its own checkpoint (inside the mla_up_proj region)."""
        if self.cp.size > 1:
            return run_cp_attention(self, q, k, v, False, False, timed=False)
        return self.core_attention(q, k, v)

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention core of this rank's queries against its keys and values: under CP its communication
        type's core (``cp_exchange``), else the backend's causal attention. What core_attn recomputation
        checkpoints."""
        if self.cp.size > 1:
            return self.cp_exchange.core(self, q, k, v, None)
        return self.kernels.attention(q, k, v)

    def local_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over whole sequences, as without CP (the a2a CP types run it on their heads)."""
        return self.kernels.attention(q, k, v)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention output [b, heads, s, v_head_dim]; under CP its communication type's; core_attn recompute."""
        if self.cp.size > 1:
            return run_cp_attention(self, q, k, v, self.recompute_core, self.offload_core)
        return recompute.run(self.recompute_core, self.core_attention, q, k, v, offload=self.offload_core)
