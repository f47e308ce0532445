"""Specs reject bad input with one message naming every offending value; catalog and text forms round-trip."""

import json

import pytest

from spec.layout_rules import layout_rejections
from spec.parallel_config import OPTUNA_PARAMS
from spec.validity import executor_model_rule
from spec import (CatalogError, ClusterSpec, InvalidConfigError, ModelSpec, ParallelConfig, SpecError,
                  TrainingSpec, get_hardware, get_model, load_catalog_file, model_names)

REQUIRED_MODELS = ["mixtral-8x7b", "mixtral-8x22b", "qwen2-57b-a14b", "qwen3-30b-a3b", "qwen3-235b-a22b",
                   "deepseek-v2-lite", "deepseek-v3", "olmoe-1b-7b", "gpt-oss-120b", "tiny-moe"]


def test_catalog_has_published_models_and_gpus():
    for name in REQUIRED_MODELS:
        assert name in model_names()
    for gpu in ("h100-sxm", "h200", "b200", "gb200", "gb300", "a100-80gb", "cpu"):
        assert get_hardware(gpu).gpu.name == gpu
    # GB300 NVL72 (datasheet): GB200's dense tensor-core peaks, 288 GB of HBM3e, one 800 Gb/s NIC per GPU
    gb200, gb300 = get_hardware("gb200"), get_hardware("gb300")
    assert gb300.gpu.peak("bf16") == gb200.gpu.peak("bf16") == 2.5e15 and gb300.gpu.peak("fp8") == 5e15
    assert (gb300.gpu.hbm_bytes, gb200.gpu.hbm_bytes) == (288 * 10**9, 186 * 10**9)
    assert gb300.gpus_per_node == 72 and gb300.inter_node_bandwidth == 2 * gb200.inter_node_bandwidth == 100e9
    v3 = get_model("DeepSeek-V3")
    assert (v3.num_layers, v3.num_moe_layers, v3.num_experts, v3.moe_router_topk) == (61, 58, 256, 8)
    assert get_model("mixtral-8x7b").num_kv_heads == 8


def test_unknown_names_list_the_known_ones():
    with pytest.raises(CatalogError, match="unknown model 'gpt-5'.*mixtral-8x7b"):
        get_model("gpt-5")
    with pytest.raises(CatalogError, match="unknown GPU 'tpu'"):
        get_hardware("tpu")


def test_model_spec_names_every_bad_field():
    with pytest.raises(SpecError) as err:
        ModelSpec(name="bad", num_layers=0, hidden_size=64, num_attention_heads=6, num_query_groups=4,
                  ffn_hidden_size=128, vocab_size=100, num_experts=4, moe_router_topk=5)
    msg = str(err.value)
    assert "num_layers must be a positive integer, got 0" in msg
    assert "num_attention_heads (6) must be divisible by num_query_groups (4)" in msg
    assert "moe_router_topk (5) must lie in [1, num_experts=4]" in msg


def test_qk_layernorm_scope_is_validated_and_serialised():
    olmoe = get_model("olmoe-1b-7b")
    assert olmoe.qk_layernorm_scope == "all" and get_model("qwen3-30b-a3b").qk_layernorm_scope == "head"
    assert ModelSpec.from_dict(json.loads(json.dumps(olmoe.to_dict()))) == olmoe
    with pytest.raises(SpecError, match="qk_layernorm_scope must be one of"):
        ModelSpec.from_dict({**olmoe.to_dict(), "qk_layernorm_scope": "group"})
    # whole-width q/k norms with MLA: a model the executor does not build (the rule book's executor_model)
    mla_all = ModelSpec.from_dict({**get_model("deepseek-v2-lite").to_dict(), "qk_layernorm_scope": "all"})
    assert "qk_layernorm_scope 'all'" in executor_model_rule(mla_all).reason


def test_training_spec_rules():
    with pytest.raises(SpecError, match="needs moe_expert_capacity_factor"):
        TrainingSpec(seq_length=4096, global_batch_size=8, routing_mode="capacity")
    with pytest.raises(SpecError, match="precision must be one of"):
        TrainingSpec(seq_length=4096, global_batch_size=8, precision="int4")


def test_parallel_config_derives_dp_edp_and_round_trips_text():
    c = ParallelConfig(world_size=64, tp=2, cp=2, pp=2, vpp=2, ep=8, etp=1, micro_batch_size=2,
                       recompute_granularity="selective", recompute_modules=("core_attn", "moe_act"))
    assert (c.dp, c.edp, c.sequence_parallel) == (8, 4, True)
    assert ParallelConfig.parse(c.label()) == c
    assert ParallelConfig.from_dict(c.to_dict()) == c
    # the constructor checks types and ranges; how the sizes fold the world is the rule book's
    assert [str(r) for r in layout_rejections(ParallelConfig(world_size=8, ep=3))] == [
        "[world_expert] etp·ep·pp = 1·3·1 = 3 does not divide the world size 8"]
    with pytest.raises(InvalidConfigError, match="contradicts world size"):
        ParallelConfig.parse("tp2 dp4 edp3 ep1", world_size=8)


def test_parallel_config_optuna_params_and_fields_round_trip():
    for c in (ParallelConfig(world_size=16, tp=2, pp=2, vpp=2, ep=4, micro_batch_size=2,
                             recompute_granularity="selective", recompute_modules=("core_attn", "moe_act")),
              ParallelConfig(world_size=8, ep=8, recompute_granularity="full", recompute_num_layers=2,
                             moe_token_dispatcher_type="allgather", use_distributed_optimizer=False,
                             overlap_param_gather=False),
              ParallelConfig(world_size=8, recompute_granularity="full")):
        params = c.to_optuna_params()
        assert set(params) == set(OPTUNA_PARAMS)
        assert params["recompute"] == c.recompute_text() and f"recompute={params['recompute']}" in c.label()
        assert ParallelConfig.from_optuna_params(params, c.world_size) == c
        assert ParallelConfig.trusted(c.field_values()) == c
    assert ParallelConfig.parse("dp8 recompute=full:0") == ParallelConfig(world_size=8, recompute_granularity="full")
    sizes, fields, _ = ParallelConfig.read_label("tp2, pp4 dispatcher=allgather")
    assert sizes == {"tp": 2, "pp": 4} and fields == {"moe_token_dispatcher_type": "allgather"}


def test_cluster_spans_whole_nodes():
    hw = get_hardware("h100-sxm")
    assert ClusterSpec(hw, 16).num_nodes == 2
    with pytest.raises(SpecError, match="multiple of gpus_per_node"):
        ClusterSpec(hw, 12)


def test_catalog_file_extends_and_reports_errors(tmp_path):
    good = tmp_path / "extra.json"
    good.write_text(json.dumps({"models": {"my-moe": {
        "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 64,
        "vocab_size": 128, "num_experts": 4, "moe_router_topk": 1}}}))
    assert load_catalog_file(good) == (["my-moe"], [])
    assert get_model("my-moe").num_experts == 4
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: {x: [1, 2\n")
    with pytest.raises(CatalogError, match="is not valid yaml"):
        load_catalog_file(bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("models:\n  y: {num_layers: 2}\n")
    with pytest.raises(CatalogError, match="missing"):
        load_catalog_file(wrong)
    with pytest.raises(CatalogError, match="cannot read catalog file"):
        load_catalog_file(tmp_path / "nope.yaml")


def test_has_hardware_follows_get_hardware_names_and_aliases():
    from spec.catalog import has_hardware

    assert has_hardware("h100") and has_hardware("H100_SXM") and has_hardware("cpu")
    assert not has_hardware("h100-calibrated")


def test_measured_expert_load_gives_the_busiest_ep_rank():
    """Shares (1, 1, 2, 0) of four experts: EP2 ranks hold 2 and 2 (balanced), EP4 ranks 1, 1, 2, 0 (the
    busiest carries twice the mean); EP1 is never imbalanced; lists from JSON become a hashable tuple."""
    from spec.errors import SpecError
    from spec.training_spec import TrainingSpec

    spec = TrainingSpec(seq_length=64, global_batch_size=4, moe_expert_load=[1, 1, 2, 0])
    assert spec.moe_expert_load == (1.0, 1.0, 2.0, 0.0) and hash(spec)
    assert spec.ep_imbalance(1) == 1.0 and spec.ep_imbalance(2) == 1.0 and spec.ep_imbalance(4) == 2.0
    assert TrainingSpec.from_dict(spec.to_dict()) == spec
    plain = TrainingSpec(seq_length=64, global_batch_size=4, moe_routing_imbalance=1.3)
    assert plain.ep_imbalance(1) == 1.0 and plain.ep_imbalance(8) == 1.3
    with pytest.raises(SpecError, match="moe_expert_load"):
        TrainingSpec(seq_length=64, global_batch_size=4, moe_expert_load=(1.0, -1.0))
