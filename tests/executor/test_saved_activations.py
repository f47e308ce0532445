"""The memory model's attention tensors against what the executor's autograd actually saves (CPU, fp32).

One attention block of a tiny model runs forward under ``saved_tensors_hooks``; the bytes of the distinct
storages it saves (parameters and the model's shared mask left out) are compared with the memory model's
``act.attn.*`` and ``act.mla.*`` entries for the same layout. RMSNorm and the causal kernel are replaced by
stand-ins that keep what their fused GPU kernels keep (the norm: its input and the fp32 reciprocal RMS; flash
attention: q, k, v, the output and the fp32 log-sum-exp): on CPU PyTorch's composite RMSNorm also keeps the
normalised input and SDPA falls back to the math kernel (which keeps the probabilities) for MLA's unequal
query and value widths, neither of which happens on the GPUs the model prices. The sink path runs as is.
The model does not count the norms' reciprocal RMS (4 bytes per token and norm) nor the sink path's inverted
boolean mask (one byte per (query, key) pair of the layer, whatever the micro-batch size: 1/(4·heads·mbs) of
the probabilities); the test adds those two exactly.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from spec import ParallelConfig, TrainingSpec, get_model
from costmodel.memory import layer_activation_bytes
from executor.model import MoEGPT
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from executor.saved_tensors import saved_storage_bytes

SEQ, MBS = 16, 2
SHARED = get_model("tiny-moe-shared")
MLA = dataclasses.replace(SHARED, name="tiny-mla", num_query_groups=None, multi_latent_attention=True,
                          q_lora_rank=24, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12)
MODELS = {
    "mla": MLA,
    "mla-q-proj": dataclasses.replace(MLA, name="tiny-mla-q-proj", q_lora_rank=None),
    "gptoss": dataclasses.replace(SHARED, name="tiny-gptoss", add_bias_linear=True, add_qkv_bias=True,
                                  swiglu=False, quick_geglu=True, activation_func_clamp_value=7.0,
                                  glu_linear_offset=1.0, softmax_type="learnable", window_size=(4, 0),
                                  window_attn_skip_freq=2),
    "qwen3": dataclasses.replace(SHARED, name="tiny-qwen3", qk_layernorm=True),
    "olmoe": dataclasses.replace(SHARED, name="tiny-olmoe", qk_layernorm=True, qk_layernorm_scope="all"),
}


class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x.float() * rstd * weight.float()).to(x.dtype)


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_attention_block_saves_what_the_memory_model_counts(name, monkeypatch):
    spec = MODELS[name]
    model = MoEGPT(spec, single_process_state(), ExecutorOptions(), seq_length=SEQ)
    monkeypatch.setattr(model.kernels, "rms_norm", lambda x, w, eps: _FusedRMSNorm.apply(x, w, eps))
    monkeypatch.setattr(model.kernels, "attention", _FlashAttention.apply)
    training = TrainingSpec(seq_length=SEQ, global_batch_size=MBS, precision="fp32")
    config = ParallelConfig(world_size=1, micro_batch_size=MBS)
    modelled = sum(v for n, v in layer_activation_bytes(spec, training, config, False)
                   if n.startswith(("act.attn.", "act.mla.")))
    rope = (model.rope_cos[:SEQ], model.rope_sin[:SEQ])
    for layer in model.layers[:2]:  # GPT-OSS: a windowed layer, then a full one (both with sinks)
        attention = layer.attention
        x = torch.randn(SEQ, MBS, spec.hidden_size, requires_grad=True)
        skip = [*model.parameters(), *model.buffers()] + ([attention.mask] if attention.mask is not None else [])
        measured = saved_storage_bytes(lambda: attention(x, rope), skip)
        norms = 3 if spec.multi_latent_attention and spec.q_lora_rank else 2 if spec.multi_latent_attention else 1
        if spec.qk_layernorm and spec.qk_layernorm_scope == "all":  # whole-width: one per token for q, one for k
            norms += 2
        elif spec.qk_layernorm:  # per-head norms of q and k: one reciprocal RMS per head and token
            norms += spec.num_attention_heads + spec.num_kv_heads
        unmodelled = norms * 4 * SEQ * MBS + (SEQ * SEQ if spec.softmax_type != "vanilla" else 0)
        assert measured - unmodelled == modelled, (name, measured, unmodelled, modelled)


def test_clamped_quick_geglu_mlp_and_experts_save_what_the_memory_model_counts():
    """GPT-OSS's activation runs as torch ops: the dense MLP and the routed experts keep the clamped gate, the
    sigmoid, the activated gate and the shifted up beside the fused path's tensors; biased experts keep each
    row's expert index. (Offsets [E] int32 of the grouped GEMM: not modelled, added here.)"""
    spec = MODELS["gptoss"]
    model = MoEGPT(spec, single_process_state(), ExecutorOptions(), seq_length=SEQ)
    training = TrainingSpec(seq_length=SEQ, global_batch_size=MBS, precision="fp32")
    config = ParallelConfig(world_size=1, micro_batch_size=MBS)
    tokens = SEQ * MBS
    params = list(model.parameters())
    dense = dict(layer_activation_bytes(spec, training, config, False))
    h = torch.randn(SEQ, MBS, spec.hidden_size, requires_grad=True)  # the pre-MLP norm's output
    measured = saved_storage_bytes(lambda: model.layers[0].mlp(h), params)
    assert measured == sum(v for n, v in dense.items() if n.startswith("act.mlp.") and n != "act.mlp.norm_input")
    moe = dict(layer_activation_bytes(spec, training, config, True))
    experts = model.layers[1].mlp.experts
    rows = torch.randn(tokens * spec.moe_router_topk, spec.hidden_size, requires_grad=True)  # ep1: every copy here
    counts = torch.full((spec.num_experts,), tokens * spec.moe_router_topk // spec.num_experts)
    measured = saved_storage_bytes(lambda: experts(rows, counts), params)
    names = ("act.moe.permuted_tokens", "act.moe.expert_fc1_output", "act.moe.expert_act_output",
             "act.moe.expert_glu_intermediates", "act.moe.expert_bias_rows")
    assert measured - 4 * spec.num_experts == sum(moe[n] for n in names)
