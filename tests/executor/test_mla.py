"""Multi-latent attention: the executor's block equals DeepSeek's formulas written out plainly (one process),
with and without a query LoRA; the folded layouts are tests/executor/test_equivalence.py's tiny-mla runs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from spec.catalog import get_model
from spec.parallel_config import ParallelConfig
from executor.attention import rope_tables
from executor.kernels import get_backend
from executor.mla import MLASelfAttention, apply_rope_interleaved
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import build_parallel_state

MLA = dataclasses.replace(get_model("tiny-moe-shared"), name="tiny-mla", num_query_groups=None,
                          multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=16,
                          qk_pos_emb_head_dim=8, v_head_dim=12)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_hf(x, pos, base):
    """HF DeepSeek-V2: rotate the pairs (2i, 2i+1) by pos·base^(−2i/d), written per pair."""
    d = x.shape[-1]
    theta = pos[:, None].float() * base ** (-torch.arange(0, d, 2).float() / d)  # [s, d/2]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * theta.cos() - odd * theta.sin(), odd * theta.cos() + even * theta.sin()], dim=-1)


def _plain_mla(block: MLASelfAttention, spec, x_SBH, eps, base):
    """The block's output from its weights, by DeepSeek's formulas, with an explicit causal softmax."""
    n, qk, rope, v_dim = spec.num_attention_heads, spec.qk_head_dim, spec.qk_pos_emb_head_dim, spec.v_head_dim
    s, b, _ = x_SBH.shape
    x = _rms(x_SBH, block.norm, eps)
    if spec.q_lora_rank is None:
        q = x @ block.linear_q_proj.T
    else:
        q = _rms(x @ block.linear_q_down_proj.T, block.q_layernorm, eps) @ block.linear_q_up_proj.T
    q = q.view(s, b, n, qk + rope)
    kv_latent, k_pe = (x @ block.linear_kv_down_proj.T).split([spec.kv_lora_rank, rope], dim=-1)
    kv = (_rms(kv_latent, block.kv_layernorm, eps) @ block.linear_kv_up_proj.T).view(s, b, n, qk + v_dim)
    pos = torch.arange(s)
    q_pe = _rope_hf(q[..., qk:].permute(1, 2, 0, 3), pos, base)  # [b, n, s, rope]
    k_pe = _rope_hf(k_pe.permute(1, 0, 2).unsqueeze(1), pos, base)  # [b, 1, s, rope]
    q_nope, k_nope, v = (t.permute(1, 2, 0, 3) for t in (q[..., :qk], kv[..., :qk], kv[..., qk:]))
    scores = (q_nope @ k_nope.transpose(-1, -2) + q_pe @ k_pe.transpose(-1, -2)) / math.sqrt(qk + rope)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    o = (scores.softmax(-1) @ v).permute(2, 0, 1, 3).reshape(s, b, n * v_dim)
    return o @ block.linear_proj.T


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_block_equals_deepseek_formulas(q_lora_rank):
    spec = dataclasses.replace(MLA, q_lora_rank=q_lora_rank)
    options = ExecutorOptions(init_method_std=0.2)  # larger weights: attention far from uniform
    state = build_parallel_state(ParallelConfig(world_size=1), 0)
    block = MLASelfAttention(spec, options, state, 0, get_backend("torch"), torch.device("cpu"), torch.float32)
    s = 16
    x = torch.randn(s, 2, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    got = block(x, rope_tables(s, spec.rotary_head_dim, options.rotary_base, torch.device("cpu")))
    want = _plain_mla(block, spec, x, options.norm_epsilon, options.rotary_base)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_interleaved_rope_scores_depend_on_relative_position_only():
    cos, sin = rope_tables(12, 8, 10000.0, torch.device("cpu"))
    q, k = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    rotated_q = apply_rope_interleaved(q.expand(12, 8), cos, sin)
    rotated_k = apply_rope_interleaved(k.expand(12, 8), cos, sin)
    assert torch.allclose(rotated_q[7] @ rotated_k[4], rotated_q[3] @ rotated_k[0], atol=1e-5)
    assert not torch.allclose(rotated_q[7] @ rotated_k[4], rotated_q[7] @ rotated_k[0], atol=1e-3)


def test_model_names_megatron_mla_parameters():
    state = build_parallel_state(ParallelConfig(world_size=1), 0)
    names = {p.shard_info.name for p in MoEGPT(MLA, state, seq_length=16).parameters()}
    prefix = "layers.0.attention."
    assert {prefix + n + ".weight" for n in ("norm", "linear_q_down_proj", "q_layernorm", "linear_q_up_proj",
                                             "linear_kv_down_proj", "kv_layernorm", "linear_kv_up_proj",
                                             "linear_proj")} <= names
    assert not any(n.startswith(prefix + "w") for n in names)  # no GQA projections
