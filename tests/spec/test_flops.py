"""FLOPs against hand-worked examples of Megatron's num_floating_point_operations conventions."""

import pytest

from spec import get_model
from spec.documents import attention_share
from spec.flops import flops_per_step, flops_per_token, mfu, tflops_per_gpu
from spec.model_spec import ModelSpec


def test_mixtral_8x7b_per_token_hand_worked():
    # h=4096, L=32, 32 heads / 8 KV groups, head 128, expert FFN 14336, top-2, SwiGLU (x1.5), vocab 32000.
    # MLP   : 12·L·h·(14336·2·1.5)          = 12·32·4096·43008      = 67,645,734,912
    # attn  : 12·L·h²·(1 + 8/32 + s/h/2)    = 12·32·4096²·1.75      = 11,274,289,152   (s = 4096)
    # logits: 6·h·V                          = 6·4096·32000          =    786,432,000
    assert flops_per_token(get_model("mixtral-8x7b"), 4096) == 79_706_456_064


def test_dense_mha_matches_closed_form_with_causal_core():
    # Non-gated 4h MLP, MHA: 72·L·h² + 6·L·h·s + 6·h·V per token (causal core counted at half).
    L, h, s, V = 24, 1024, 2048, 51200
    m = ModelSpec(name="gpt", num_layers=L, hidden_size=h, num_attention_heads=16, ffn_hidden_size=4 * h,
                  vocab_size=V, swiglu=False)
    assert flops_per_token(m, s) == 72 * L * h * h + 6 * L * h * s + 6 * h * V
    assert flops_per_step(m, s, 8) == 8 * s * flops_per_token(m, s)


def test_moe_pattern_first_k_dense_and_shared_experts():
    # 4 layers, first dense (ffn 128), 3 MoE (expert 32, top-2, shared 48); h=64, MHA 4 heads, V=256, s=16.
    m = ModelSpec(name="t", num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                  vocab_size=256, make_vocab_size_divisible_by=8, num_experts=8, moe_router_topk=2,
                  moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=48, moe_first_k_dense=1)
    s = 16
    mlp = 12 * 64 * (1 * 128 * 1.5 + 3 * (32 * 2 * 1.5 + 48 * 1.5))
    attn = 12 * 4 * 64 * 64 * (1 + 1 + s / 64 / 2)
    logits = 6 * 64 * 256
    assert flops_per_token(m, s) == pytest.approx(mlp + attn + logits, rel=1e-12)


def test_mla_and_mtp_terms_hand_worked():
    # MLA without q-LoRA: h=32, n=2 heads, nope 8, rope 4, v 8, kv_lora 16; 1 layer + 1 MTP layer, dense ffn 64.
    m = ModelSpec(name="mla", num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
                  vocab_size=64, make_vocab_size_divisible_by=8, multi_latent_attention=True, q_lora_rank=None,
                  kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, mtp_num_layers=1)
    s = 10
    q = 32 * 2 * (8 + 4)                           # 768
    kv = 16 * (32 + 2 * (8 + 8) + 1)               # 1040
    rope_k = 32 * 4                                # 128
    o = 2 * 8 * 32                                 # 512
    core = s * 2 * 12 / 2 + s * 2 * 8 / 2          # 200
    attn = 6 * 2 * (q + kv + rope_k + o + core)    # two layers (decoder + MTP)
    mlp = 12 * 2 * 32 * 64 * 1.5
    mtp = 6 * 1 * (3 * 32 + 2 * 32 * 32)
    logits = 6 * 32 * 64 * 2
    assert flops_per_token(m, s) == pytest.approx(attn + mlp + mtp + logits, rel=1e-12)


def test_mfu_and_tflops_helpers():
    assert tflops_per_gpu(8e15, 2.0, 8) == pytest.approx(500.0)
    assert mfu(8e15, 2.0, 8, 1e15) == pytest.approx(0.5)


def test_causal_core_counts_half_the_pairs_of_each_sequence_and_of_each_packed_document():
    # The dense model above: the core is 6·L·h·s FLOPs per token, i.e. per sequence of s tokens
    # 6·L·h·s² = 12·L·h · (s²/2): 12·L·h FLOPs per query-key pair (fwd + bwd, QKᵀ and PV at 2 FLOPs a multiply-add,
    # 3 passes), s²/2 pairs. Packed into documents of 3 and 5 tokens (s = 8), a sequence has 3²/2 + 5²/2 = 17
    # pairs instead of 32: 12·L·h·17 core FLOPs a sequence.
    L, h, s, V = 24, 1024, 8, 51200
    m = ModelSpec(name="gpt", num_layers=L, hidden_size=h, num_attention_heads=16, ffn_hidden_size=4 * h,
                  vocab_size=V, swiglu=False)
    rest = s * (72 * L * h * h + 6 * h * V)  # one sequence's FLOPs outside the core
    assert flops_per_step(m, s, 1) == rest + 12 * L * h * (s * s / 2)
    share = attention_share([3, 5], s)
    assert share == 34 / 64
    assert flops_per_step(m, s, 1, share) == pytest.approx(rest + 12 * L * h * (3 * 3 / 2 + 5 * 5 / 2), rel=1e-12)
    # two sequences of documents [3, 5] and [8]: 17 + 32 pairs, the sample's share priced per sequence
    assert flops_per_step(m, s, 2, attention_share([3, 5, 8], s)) == pytest.approx(
        2 * rest + 12 * L * h * (17 + 32), rel=1e-12)

