"""Proxies: a layers proxy keeps widths and at least one MoE layer; the tiny proxy keeps every feature flag
at widths that split over tp2·ep2·etp2 and layers over pp2; the names read back."""

from __future__ import annotations

import dataclasses

import pytest

from spec.catalog import get_model, model_names
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.proxy import ProxyError, proxy_model, proxy_of, tiny_proxy
from spec.validity import executor_layout_rules

SIZE_FIELDS = {"name", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
               "ffn_hidden_size", "vocab_size", "make_vocab_size_divisible_by", "max_position_embeddings",
               "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "num_experts",
               "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_layer_freq",
               "moe_first_k_dense", "moe_router_num_groups", "moe_router_group_topk"}


def test_layers_proxy_keeps_a_moe_layer_where_the_cut_would_leave_only_dense_ones():
    v3 = get_model("deepseek-v3")  # three dense first layers
    cut = v3.with_layers(2)
    assert cut.name == "deepseek-v3@2L" and cut.moe_layer_pattern() == (0, 1)
    assert (cut.hidden_size, cut.num_experts) == (v3.hidden_size, v3.num_experts)
    assert v3.with_layers(5).moe_layer_pattern() == (0, 0, 0, 1, 1)  # enough layers: the pattern as it was
    assert v3.with_layers(1).moe_layer_pattern() == (1,)
    sparse = dataclasses.replace(get_model("tiny-moe-shared"), num_layers=8, moe_layer_freq=4)  # MoE: layer 4 only
    assert sparse.with_layers(3).moe_layer_pattern() == (0, 0, 1)
    dense = ModelSpec("dense", 4, 64, 4, 128, 256)
    assert dense.with_layers(2).num_moe_layers == 0


@pytest.mark.parametrize("name", model_names())
def test_tiny_proxy_keeps_every_feature_and_splits_over_tp2_ep2_etp2_pp2(name):
    model = get_model(name)
    tiny = tiny_proxy(model)
    assert tiny.name == f"{name}@tiny" and tiny.hidden_size == 64 and tiny.vocab_size == 256
    for f in dataclasses.fields(ModelSpec):
        if f.name not in SIZE_FIELDS:  # every flag and every field this test does not know is the model's
            assert getattr(tiny, f.name) == getattr(model, f.name), f.name
    assert (tiny.num_query_groups is None) == (model.num_query_groups is None)
    assert (tiny.q_lora_rank is None) == (model.q_lora_rank is None)
    assert bool(tiny.moe_shared_expert_intermediate_size) == bool(model.moe_shared_expert_intermediate_size)
    assert (tiny.moe_router_num_groups is None) == (model.moe_router_num_groups is None)
    assert bool(tiny.num_dense_layers) == bool(model.num_dense_layers) and tiny.num_moe_layers >= 1
    assert 2 <= tiny.num_layers <= 4
    for label, world in (("tp2 ep2 etp1", 2), ("tp2 ep2 etp2", 4), ("pp2", 2)):
        config = ParallelConfig.parse(label, world_size=world)
        assert executor_layout_rules(tiny, config, 16) == [], label


def test_tiny_proxy_of_grouped_routing_stays_consistent():
    tiny = tiny_proxy(get_model("deepseek-v3"))
    groups, per_group = tiny.moe_router_num_groups, tiny.num_experts // tiny.moe_router_num_groups
    assert tiny.moe_router_topk <= tiny.moe_router_group_topk * per_group
    assert tiny.moe_layer_pattern() == (0, 0, 0, 1) and tiny.mtp_num_layers == 1 and groups >= 2


def test_proxy_model_bounds_and_names():
    mixtral = get_model("mixtral-8x7b")
    assert proxy_model(mixtral) is mixtral
    both = proxy_model(mixtral, 1, "tiny")
    assert both.name == "mixtral-8x7b@tiny@1L" and both.num_layers == 1 and both.hidden_size == 64
    info = proxy_of(both.name)
    assert (info.base, info.proxy, info.num_layers, info.is_proxy) == ("mixtral-8x7b", "tiny", 1, True)
    assert proxy_of(proxy_model(mixtral, 4).name).proxy is None and not proxy_of("mixtral-8x7b").is_proxy
    with pytest.raises(ProxyError, match=r"\[1, 32\]") as exc:
        proxy_model(mixtral, 33)
    assert exc.value.rule == "proxy_layers"
    with pytest.raises(ProxyError) as exc:
        proxy_model(mixtral, 0)
    assert exc.value.rule == "proxy_layers"
    with pytest.raises(ProxyError) as exc:
        proxy_model(mixtral, proxy="small")
    assert exc.value.rule == "proxy_kind"
