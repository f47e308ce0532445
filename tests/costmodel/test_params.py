"""Parameter counts against published totals and hand-worked per-GPU counts."""

import dataclasses

import pytest

from spec import ModelSpec, ParallelConfig, get_model
from spec.errors import InvalidConfigError
from spec.pipeline_layout import layer_chunks
from costmodel.params import (
    ParamCounts,
    attention_params,
    mlp_params,
    moe_params,
    stage_layers,
    stage_param_counts,
    total_param_counts,
)


def test_mixtral_8x7b_matches_published_46_7b_total_12_9b_active():
    total, active = total_param_counts(get_model("mixtral-8x7b"))
    assert total == pytest.approx(46.7e9, rel=0.01)
    assert active == pytest.approx(12.9e9, rel=0.01)


def test_deepseek_v3_matches_published_671b_total_37b_active():
    total, active = total_param_counts(get_model("deepseek-v3"))
    assert total == pytest.approx(671e9, rel=0.02)
    assert active == pytest.approx(37e9, rel=0.02)


def test_tiny_moe_hand_count_whole_model():
    # h=64, 4 heads of 16, 2 KV groups, SwiGLU, RMSNorm, 8 experts of FFN 32, top-2, V=256, untied, RoPE.
    # attention: QKV 64·(4+2·2)·16 = 8192, proj 64·64 = 4096, input norm 64
    # MoE: pre-MLP norm 64, router 8·64 = 512, experts 8·(64·64 + 32·64) = 49152
    layer = 8192 + 4096 + 64 + 64 + 512 + 49152
    edges = 256 * 64 + 256 * 64 + 64  # embedding, output, final norm
    total, active = total_param_counts(get_model("tiny-moe"))
    assert total == 2 * layer + edges == 156_992
    assert active == 2 * (layer - 6 * 6144) + edges == 83_264


def test_tiny_moe_per_gpu_counts_by_bucket():
    # tp2 pp2 ep8: one layer per stage, one expert per GPU; vocab 256 pads to a multiple of 8·2 (stays 256).
    cfg = ParallelConfig(world_size=16, tp=2, pp=2, ep=8)
    model = get_model("tiny-moe")
    attn_split = (8192 + 4096) // 2
    first = stage_param_counts(model, cfg, 0)
    last = stage_param_counts(model, cfg, 1)
    assert first == ParamCounts(attn_split + 256 * 64 // 2, 64 + 64 + 512, 6144)
    assert last == ParamCounts(attn_split + 256 * 64 // 2, 64 + 64 + 512 + 64, 6144)
    # ETP splits each expert's FFN dimension: ep4 etp2 -> 2 experts of half width each.
    folded = ParallelConfig(world_size=16, tp=2, pp=2, ep=4, etp=2)
    assert stage_param_counts(model, folded, 0).expert == 2 * (64 * 64 + 32 * 64) // 2


def test_first_dense_and_shared_experts_hand_count():
    # tiny-moe-shared: 4 layers, layer 0 dense (FFN 128), layers 1-3 MoE with a shared expert of 48.
    attention = 8192 + 4096 + 64
    dense_mlp = 64 * 256 + 128 * 64 + 64
    moe = 64 + 512 + (64 * 96 + 48 * 64) + 8 * (64 * 64 + 32 * 64)
    expected = attention * 4 + dense_mlp + 3 * moe + 2 * 256 * 64 + 64
    model = get_model("tiny-moe-shared")
    assert total_param_counts(model)[0] == expected == 283_712
    assert stage_param_counts(model, ParallelConfig(world_size=1), 0).total == expected


def _tiny_mla(**kw):
    base = dict(name="mla", num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64, vocab_size=64,
                make_vocab_size_divisible_by=8, multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=16,
                qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, mtp_num_layers=1)
    base.update(kw)
    return ModelSpec(**base)


def test_mla_and_mtp_hand_count_on_the_last_stage():
    # q_proj 32·2·12 = 768 and kv_up 16·2·16 = 512 and proj 16·32 = 512 are TP-split;
    # kv_down 32·(16+4) = 640, kv norm 16 and the input norm 32 are replicated (Megatron duplicates them).
    attn = ParamCounts(768 + 512 + 512, 640 + 16 + 32, 0)
    mlp = ParamCounts(32 * 128 + 64 * 32, 32, 0)
    layer = attn + mlp
    mtp = ParamCounts(2 * 32 * 32, 3 * 32, 0) + layer  # eh_proj, enorm/hnorm/final norm, one layer
    model = _tiny_mla()
    cfg = ParallelConfig(world_size=2, pp=2)
    assert stage_param_counts(model, cfg, 0) == layer + ParamCounts(64 * 32, 0, 0)
    # last: layer, final norm, output layer, MTP's own embedding, MTP block
    assert stage_param_counts(model, cfg, 1) == layer + ParamCounts(2 * 64 * 32, 32, 0) + mtp
    # published-style total leaves MTP out
    assert total_param_counts(model)[0] == 2 * layer.total + 2 * 64 * 32 + 32


def test_mla_with_q_lora_keeps_down_projections_replicated():
    model = _tiny_mla(q_lora_rank=8, mtp_num_layers=0, num_layers=1)
    one = stage_param_counts(model, ParallelConfig(world_size=1), 0)
    two = stage_param_counts(model, ParallelConfig(world_size=2, tp=2), 0)
    assert two.dense_replicated == one.dense_replicated
    assert two.dense_tp_sharded * 2 == one.dense_tp_sharded


def test_tied_embeddings_keep_a_copy_on_the_last_stage_only_with_pp():
    model = ModelSpec(name="tied", num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                      vocab_size=1024, untie_embeddings_and_output_weights=False)
    one = stage_param_counts(model, ParallelConfig(world_size=1), 0)
    untied = stage_param_counts(ModelSpec(**{**model.to_dict(), "untie_embeddings_and_output_weights": True}),
                                ParallelConfig(world_size=1), 0)
    assert untied.total - one.total == 1024 * 64
    last = stage_param_counts(model, ParallelConfig(world_size=2, pp=2), 1)
    # two layers of QKV 64·192, proj 64·64, SwiGLU fc1 64·512, fc2 256·64, plus the tied copy V·h
    assert last.dense_tp_sharded == 2 * (64 * 192 + 64 * 64 + 64 * 512 + 256 * 64) + 1024 * 64


def test_biases_and_layernorm_follow_megatron_sharding():
    model = ModelSpec(name="gpt", num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                      vocab_size=128, swiglu=False, normalization="layernorm", add_bias_linear=True,
                      position_embedding_type="learned_absolute", max_position_embeddings=32)
    one = stage_param_counts(model, ParallelConfig(world_size=1), 0)
    # 12h² + 13h per layer; embedding V·h, positions 32·h, final LayerNorm 2h, untied output V·h
    assert one.total == 12 * 64 * 64 + 13 * 64 + 2 * 128 * 64 + 32 * 64 + 2 * 64
    two = stage_param_counts(model, ParallelConfig(world_size=2, tp=2), 0)
    # replicated: two LayerNorms (4h), proj and fc2 biases (2h), positions, final norm
    assert two.dense_replicated == one.dense_replicated == 6 * 64 + 32 * 64 + 2 * 64


def test_uneven_layers_go_to_the_earliest_chunks():
    assert layer_chunks(10, 4, 1) == (((0, 1, 2),), ((3, 4, 5),), ((6, 7),), ((8, 9),))
    assert layer_chunks(10, 2, 2) == (((0, 1, 2), (6, 7)), ((3, 4, 5), (8, 9)))
    cfg = ParallelConfig(world_size=4, pp=4)
    model = get_model("deepseek-v3")  # 61 layers over 4 ranks: 16, 15, 15, 15
    assert [len(stage_layers(model, cfg, s)) for s in range(4)] == [16, 15, 15, 15]


def test_more_tp_ep_pp_shrink_the_right_buckets_exactly():
    model = get_model("mixtral-8x7b")
    base = stage_param_counts(model, ParallelConfig(world_size=8, pp=2, ep=1), 1)
    tp2 = stage_param_counts(model, ParallelConfig(world_size=8, tp=2, pp=2), 1)
    ep4 = stage_param_counts(model, ParallelConfig(world_size=8, pp=2, ep=4), 1)
    assert tp2.dense_tp_sharded * 2 == base.dense_tp_sharded
    assert tp2.expert == base.expert and tp2.dense_replicated == base.dense_replicated
    assert ep4.expert * 4 == base.expert
    pp4 = stage_param_counts(model, ParallelConfig(world_size=8, pp=4), 1)  # a middle rank: layers only
    pp2_layers = stage_param_counts(model, ParallelConfig(world_size=8, pp=2), 0).expert
    assert pp4.expert * 2 == pp2_layers


def test_stage_outside_pipeline_is_a_clear_error():
    with pytest.raises(InvalidConfigError, match="stage 2 is outside the pipeline"):
        stage_param_counts(get_model("tiny-moe"), ParallelConfig(world_size=2, pp=2), 2)


# ---- the modern architectures against their published totals ---------------------------------------------
# (model, published total, published active, one unit of the published figures' last digit). Tolerance: one
# unit of the last published digit, since a model card may truncate rather than round (DeepSeek-V2-Lite's
# "2.4B" active is 2.45B by its own configuration). Active is compared without the input embedding: a lookup,
# no GEMM, and the convention of OpenAI's exact 5.13B (with the embedding gpt-oss-120b has 5.71B active).
PUBLISHED = [
    ("deepseek-v2-lite", 15.7e9, 2.4e9, 0.1e9),
    ("deepseek-v3", 671e9, 37e9, 1e9),  # the 14B MTP module is left out of 671B, as here
    ("qwen2-57b-a14b", 57e9, 14e9, 1e9),
    ("gpt-oss-120b", 116.83e9, 5.13e9, 0.01e9),
]


@pytest.mark.parametrize("name,total,active,unit", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_modern_architectures_match_their_published_totals(name, total, active, unit):
    model = get_model(name)
    counted_total, counted_active = total_param_counts(model)
    input_embedding = model.padded_vocab_size() * model.hidden_size
    assert abs(counted_total - total) <= unit
    assert abs(counted_active - input_embedding - active) <= unit


def test_mla_attention_per_layer_hand_count_deepseek_v2_lite_and_v3():
    # V2-Lite (no query LoRA): q_proj 2048·16·(128+64), kv_down 2048·(512+64), kv norm 512,
    # kv_up 512·16·(128+128), proj 16·128·2048, input norm 2048
    lite = get_model("deepseek-v2-lite")
    assert attention_params(lite, 1).total == (2048 * 16 * 192 + 2048 * 576 + 512 + 512 * 16 * 256
                                               + 16 * 128 * 2048 + 2048) == 13_765_120
    # V3: q_down 7168·1536, q norm 1536, q_up 1536·128·192, kv_down 7168·576, kv norm 512,
    # kv_up 512·128·256, proj 128·128·7168, input norm 7168
    v3 = get_model("deepseek-v3")
    assert attention_params(v3, 1).total == (7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512
                                             + 512 * 128 * 256 + 128 * 128 * 7168 + 7168) == 187_114_496
    # TP splits the up projections and linear_proj; the down projections and latent norms stay whole
    tp8 = attention_params(v3, 8)
    assert tp8.dense_tp_sharded == (1536 * 128 * 192 + 512 * 128 * 256 + 128 * 128 * 7168) // 8
    assert tp8.dense_replicated == 7168 * 1536 + 1536 + 7168 * 576 + 512 + 7168


def test_deepseek_v3_dense_first_layers_and_shared_expert_per_layer():
    # layers 0-2 dense (SwiGLU FFN 18432); 58 MoE layers: router 256·h, one shared expert and 256 routed
    # experts of FFN 2048, top-8 active
    v3 = get_model("deepseek-v3")
    h = 7168
    assert mlp_params(v3, 1).total == 3 * h * 18432 + h
    moe = moe_params(v3, 1, 1, 1)
    assert moe.dense_tp_sharded == 3 * h * 2048 and moe.dense_replicated == 256 * h + h
    assert moe.expert == 256 * 3 * h * 2048
    assert (v3.num_dense_layers, v3.num_moe_layers) == (3, 58)


def test_gpt_oss_biases_sinks_and_router_bias_hand_count():
    # every linear biased: QKV rows (64 + 2·8)·64, proj bias h; one learned sink per head; router bias E;
    # expert biases 2·ffn (gate and up) + h (down) per expert
    model = get_model("gpt-oss-120b")
    h, n, g, d, e, f = 2880, 64, 8, 64, 128, 2880
    qkv = (n + 2 * g) * d
    assert attention_params(model, 1).total == h * qkv + qkv + n * d * h + h + n + h
    two = attention_params(model, 2)
    assert two.dense_tp_sharded == (h * qkv + qkv + n * d * h + n) // 2  # sinks split with their heads
    assert two.dense_replicated == h + h  # input norm and the row-parallel output bias
    moe = moe_params(model, 1, 1, 1)
    assert moe.dense_replicated == h + e * (h + 1)
    assert moe.expert == e * (3 * h * f + 2 * f + h)


def test_olmoe_whole_width_qk_norms_split_with_the_heads_hand_count():
    """OLMoE (qk_layernorm_scope 'all'): q_norm [16·128] and k_norm [16·128] are TP-sharded like wq/wk rows,
    where Qwen3's per-head [128] norms are whole on every rank. Its total is the published 6.92B."""
    olmoe = get_model("olmoe-1b-7b")
    h, width = 2048, 16 * 128
    tp2 = attention_params(olmoe, 2)
    assert tp2.dense_tp_sharded == 4 * h * width // 2 + (width + width) // 2 and tp2.dense_replicated == h
    per_head = attention_params(dataclasses.replace(olmoe, qk_layernorm_scope="head"), 2)
    assert per_head.dense_tp_sharded == 4 * h * width // 2 and per_head.dense_replicated == h + 2 * 128
    assert abs(total_param_counts(olmoe)[0] - 6.92e9) <= 0.01e9
