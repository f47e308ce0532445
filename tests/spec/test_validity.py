"""Every validity rule has a case that trips it (checked against spec.validity.RULES), plus the helpers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.enumerate import distopt_options
from spec import validity
from spec.catalog import get_hardware, get_model
from spec.hardware import ClusterSpec
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec
from spec.validity import (EXECUTOR_RULES, RULES, Validator, batch_rule, check, check_config,
                           executor_layout_rules, executor_model_rule, is_executor_rule, pipeline_split)

H100 = get_hardware("h100-sxm")
TINY = get_model("tiny-moe")  # 2 layers, hidden 64, 4 heads / 2 KV groups, 8 experts of FFN 32
TRAIN = TrainingSpec(seq_length=64, global_batch_size=16)


def dense_model(**kw) -> ModelSpec:
    base = dict(name="dense", num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=128, vocab_size=256, make_vocab_size_divisible_by=8)
    return ModelSpec(**{**base, **kw})


def rules_of(model: ModelSpec, training: TrainingSpec, gpus: int, **cfg) -> set[str]:
    cluster = ClusterSpec(H100, gpus)
    return {r.rule for r in check_config(model, training, cluster, ParallelConfig(world_size=gpus, **cfg))}


# (rule, model, training, gpus, config fields): each case breaks exactly the named rule (and maybe others)
CASES = [
    ("fp8_hardware", TINY, TrainingSpec(64, 16, precision="fp8"), 8, {}),  # cluster overridden below (A100)
    ("heads_tp", TINY, TRAIN, 8, dict(tp=8)),
    ("kv_heads_tp", dense_model(num_attention_heads=6, num_query_groups=3, hidden_size=96), TRAIN, 8, dict(tp=2)),
    ("hidden_tp", dense_model(hidden_size=100, num_attention_heads=8, num_query_groups=8, kv_channels=16),
     TRAIN, 8, dict(tp=8)),
    ("ffn_tp", dense_model(ffn_hidden_size=102), TRAIN, 8, dict(tp=4)),
    ("seq_cp", TINY, TrainingSpec(seq_length=12, global_batch_size=16), 8, dict(cp=4)),
    ("layers_pp", TINY, TRAIN, 8, dict(pp=4)),
    ("vpp_needs_pp", TINY, TRAIN, 8, dict(vpp=2)),
    ("experts_ep", replace(TINY, num_experts=6), TRAIN, 8, dict(ep=4)),
    ("expert_ffn_etp", replace(TINY, moe_ffn_hidden_size=36), TRAIN, 8, dict(etp=8)),
    ("gbs_mbs_dp", TINY, TrainingSpec(seq_length=64, global_batch_size=12), 8, dict(micro_batch_size=1)),
    ("vpp_microbatches", dense_model(num_layers=8), TrainingSpec(64, 12), 8, dict(pp=4, vpp=2, micro_batch_size=1)),
    ("sp_with_tp", TINY, TRAIN, 8, dict(tp=2, sequence_parallel=False)),
    ("recompute_modules", dense_model(), TRAIN, 8,
     dict(recompute_granularity="selective", recompute_modules=("moe_act",))),
    ("param_gather_distopt", TINY, TRAIN, 8, dict(use_distributed_optimizer=False, overlap_param_gather=True)),
    ("ep_overlap", TINY, TRAIN, 8, dict(ep=1, overlap_moe_expert_parallel_comm=True)),
    ("tp_overlap_sp", TINY, TRAIN, 8, dict(tp=1, tp_comm_overlap=True)),
    # tiny-moe has no shared experts; tiny-moe-shared's with ep 1, the allgather dispatcher, or the EP overlap
    ("shared_overlap", TINY, TRAIN, 8, dict(ep=2, moe_shared_expert_overlap=True)),
    ("shared_overlap", get_model("tiny-moe-shared"), TRAIN, 8, dict(ep=1, moe_shared_expert_overlap=True)),
    ("shared_overlap", get_model("tiny-moe-shared"), TRAIN, 8,
     dict(ep=2, moe_token_dispatcher_type="allgather", moe_shared_expert_overlap=True)),
    ("shared_overlap", get_model("tiny-moe-shared"), TRAIN, 8,
     dict(ep=2, overlap_moe_expert_parallel_comm=True, moe_shared_expert_overlap=True)),
    ("cuda_graphs_device", TINY, TRAIN, 8, dict(cuda_graphs=True)),  # cluster overridden below (CPU ranks)
    ("cuda_graphs_recompute", TINY, TRAIN, 8, dict(cuda_graphs=True, recompute_granularity="full")),
    ("cuda_graphs_recompute", TINY, TRAIN, 8,
     dict(cuda_graphs=True, recompute_granularity="selective", recompute_modules=("layernorm", "moe_act"))),
    ("cuda_graphs_recompute", TINY, TRAIN, 8, dict(cuda_graphs=True, activation_offload_modules=("core_attn",))),
    ("cuda_graphs_ep_overlap", TINY, TRAIN, 8, dict(cuda_graphs=True, ep=2, overlap_moe_expert_parallel_comm=True)),
    # tiny-moe's 2 KV heads do not split over tp·cp = 4; a2a+p2p's all-to-all over 2 ranks at tp 2 neither
    ("cp_a2a_heads", TINY, TRAIN, 8, dict(cp=4, cp_comm_type="a2a")),
    ("cp_a2a_heads", TINY, TRAIN, 8,
     dict(tp=2, cp=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=(2, 2))),
    ("flex_dispatcher", TINY, TRAIN, 8, dict(ep=1, moe_token_dispatcher_type="flex_deepep")),
    ("distopt_choice", TINY, TrainingSpec(64, 16, distributed_optimizer=False), 8, dict(overlap_param_gather=False)),
    ("fp8_params_precision", TINY, TrainingSpec(64, 16, fp8_param_gather=True), 8, {}),
    ("optimizer_distopt", TINY, TrainingSpec(64, 16, precision="fp8", fp8_param_gather=True), 8,
     dict(use_distributed_optimizer=False, overlap_param_gather=False)),
    # the rules on a config alone (spec.layout_rules)
    ("sp_needs_tp", TINY, TRAIN, 8, dict(tp=1, sequence_parallel=True)),
    ("recompute_modules_selective", TINY, TRAIN, 8, dict(recompute_granularity="full", recompute_modules=("core_attn",))),
    ("pipeline_chunks", TINY, TRAIN, 8, dict(pp=2, pipeline_layout="Et|t|tL")),
    ("optimizer_offload_distopt", TINY, TRAIN, 8,
     dict(optimizer_cpu_offload_fraction=0.5, use_distributed_optimizer=False, overlap_param_gather=False)),
    ("activation_offload", TINY, TRAIN, 8, dict(recompute_granularity="full", activation_offload_modules=("moe",))),
    ("cp_comm_hierarchical", TINY, TRAIN, 8, dict(cp=4, cp_comm_type="a2a+p2p")),  # no sizes
    ("cp_comm_hierarchical", TINY, TRAIN, 8,
     dict(cp=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=(2, 4))),  # 2·4 is not cp
    ("cp_comm_hierarchical", TINY, TRAIN, 8,
     dict(cp=2, cp_comm_type="p2p", hierarchical_context_parallel_sizes=(1, 2))),  # sizes for another type
    ("precision_aware_distopt", TINY, TRAIN, 8,
     dict(exp_avg_dtype="bf16", use_distributed_optimizer=False, overlap_param_gather=False)),
    ("main_params_dtype", TINY, TRAIN, 8, dict(main_params_dtype="bf16")),
    # the precision-aware optimizer's rule on the whole case: fp32 weights have no master weights to narrow
    ("main_params_half_params", TINY, TrainingSpec(64, 16, precision="fp32"), 8, dict(main_params_dtype="fp16")),
    ("pad_to_capacity", TINY, TrainingSpec(64, 16, moe_pad_expert_input_to_capacity=True), 8, {}),
]


@pytest.mark.parametrize("rule,model,training,gpus,cfg", CASES, ids=[c[0] for c in CASES])
def test_each_rule_trips(rule, model, training, gpus, cfg):
    if rule == "fp8_hardware":
        cluster = ClusterSpec(get_hardware("a100-80gb"), gpus)
        found = check_config(model, training, cluster, ParallelConfig(world_size=gpus, **cfg))
        assert [r.rule for r in found] == ["fp8_hardware"]
        assert "a100-80gb" in found[0].reason
        return
    if rule == "cuda_graphs_device":
        cpu = ClusterSpec(get_hardware("cpu"), gpus)
        assert [r.rule for r in check_config(model, training, cpu, ParallelConfig(world_size=gpus, **cfg))] == [rule]
        assert rules_of(model, training, gpus, **cfg) == set()  # on GPUs the knob holds
        return
    found = rules_of(model, training, gpus, **cfg)
    # a layout string of the wrong chunk count cannot place the layers either
    assert found == {rule} | ({"layers_pp"} if rule == "pipeline_chunks" else set()), found


def test_megatron_optimizer_recipes_need_the_distributed_optimizer_and_are_not_the_executors():
    """fp8 primary weights trip optimizer_distopt (Megatron's arguments.py), and the planner only tries the
    distributed optimizer for them; the executor refuses the two recipe knobs it does not build, by name. bf16
    Adam moments are the layout's knob (precision_aware_distopt), and the executor builds them."""
    fp8_params = TrainingSpec(64, 16, precision="fp8", fp8_param_gather=True)
    assert rules_of(TINY, fp8_params, 8, use_distributed_optimizer=False, overlap_param_gather=False) == {
        "optimizer_distopt"}
    assert rules_of(TINY, fp8_params, 8) == set()
    assert distopt_options(fp8_params) == (True,) and distopt_options(TRAIN) == (True, False)
    cfg = ParallelConfig(world_size=8)
    assert [r.rule for r in check(TINY, TRAIN, cfg)] == []
    for knob in (dict(main_grads_fp32=False), dict(precision="fp8", fp8_param_gather=True)):
        found = check(TINY, replace(TRAIN, **knob), cfg)
        assert [r.rule for r in found] == ["executor_optimizer_recipe"] and is_executor_rule(found[0].rule), knob
    assert check(TINY, TRAIN, replace(cfg, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")) == []


def test_world_rules_trip():
    v = Validator(TINY, TRAIN, ClusterSpec(H100, 8))
    assert v.world_dense(2, 2, 4).rule == "world_dense"
    assert v.world_expert(4, 2, 2).rule == "world_expert"
    assert v.world_dense(2, 2, 2) is None


def test_every_rule_has_a_tripping_case():
    tripped = {c[0] for c in CASES} | {"world_dense", "world_expert"}
    assert tripped == set(RULES)


def test_more_trips_of_the_model_rules():
    v = Validator(dense_model(), TRAIN, ClusterSpec(H100, 8))
    assert v.ep(2).rule == "experts_ep" and "no experts" in v.ep(2).reason
    assert v.etp(2).rule == "expert_ffn_etp"
    shared = replace(TINY, moe_shared_expert_intermediate_size=34)
    assert Validator(shared, TRAIN, ClusterSpec(H100, 8)).tp(4).rule == "ffn_tp"
    gqa = dense_model()
    mla_only = ParallelConfig(8, recompute_granularity="selective", recompute_modules=("mla_up_proj",))
    assert [r.rule for r in check_config(gqa, TRAIN, ClusterSpec(H100, 8), mla_only)] == ["recompute_modules"]
    # KV heads: a divisor of tp is fine too (replicated KV heads), as Megatron allows
    assert Validator(TINY, TRAIN, ClusterSpec(H100, 8)).tp(4) is None


def test_valid_config_has_no_rejections():
    cluster = ClusterSpec(H100, 8)
    cfg = ParallelConfig(world_size=8, tp=2, pp=2, ep=4, etp=1, micro_batch_size=2,
                         recompute_granularity="selective", recompute_modules=("core_attn", "moe_act"))
    assert check_config(TINY, TRAIN, cluster, cfg) == []


def test_pipeline_split_even_uneven_and_impossible():
    assert pipeline_split(8, 2, 2) == (4, 4)
    assert pipeline_split(61, 16) == (4,) * 13 + (3,) * 3  # extra layers on the earliest chunks
    assert sum(pipeline_split(61, 8, 2)) == 61
    assert pipeline_split(2, 4) is None
    assert pipeline_split(3, 1) == (3,)


def test_batch_rule_is_the_validators():
    assert batch_rule(16, 2, 8) is None
    r = batch_rule(12, 1, 8)
    assert r.rule == "gbs_mbs_dp" and r.reason == "global_batch_size (12) is not divisible by micro_batch_size·dp = 1·8 = 8"
    v = Validator(TINY, TrainingSpec(seq_length=64, global_batch_size=12), ClusterSpec(H100, 8))
    assert v.batch(8, 1, 1, 1) == r


def test_executor_rules_name_what_the_executor_cannot_run():
    cluster = ClusterSpec(H100, 8)
    v = Validator(TINY, TRAIN, cluster)
    assert v.executor(ParallelConfig(world_size=8, tp=2, ep=4)) == []
    found = executor_layout_rules(TINY, ParallelConfig(world_size=16, ep=8, pp=2, vpp=2), seq_length=64)
    assert {r.rule for r in found} <= set(EXECUTOR_RULES) and found
    assert any("num_layers (2) is smaller than pp·vpp = 2·2 = 4" in r.reason for r in found)
    dropout = replace(TINY, hidden_dropout=0.1)
    assert executor_model_rule(dropout).rule == "executor_model" and "dropout" in executor_model_rule(dropout).reason
    mla = replace(TINY, num_query_groups=None, multi_latent_attention=True, q_lora_rank=24)
    assert executor_model_rule(mla) is None  # the executor builds multi-latent attention
    up_proj = ParallelConfig(world_size=1, recompute_granularity="selective", recompute_modules=("mla_up_proj",))
    assert [r.rule for r in executor_layout_rules(mla, up_proj, seq_length=64)] == ["executor_recompute"]
    # MTP and tied output weights under a pipeline: the last stage holds a copy of the embedding
    tied_mtp = replace(get_model("tiny-moe-shared"), mtp_num_layers=2,
                       untie_embeddings_and_output_weights=False)
    assert executor_model_rule(tied_mtp) is None
    assert executor_layout_rules(tied_mtp, ParallelConfig(world_size=4, pp=2, ep=2), seq_length=64) == []
    assert v.executor(ParallelConfig(world_size=8)) == []


def test_cp_comm_types_that_split_the_heads_or_keep_them():
    v = Validator(TINY, TRAIN, ClusterSpec(H100, 8))
    assert v.cp_comm(1, 2, "a2a") is None  # 4 heads, 2 KV heads over cp 2
    assert v.cp_comm(2, 4, "a2a+p2p", (1, 4)) is None  # an all-to-all over one rank splits nothing
    assert v.cp_comm(2, 4, "p2p") is None and v.cp_comm(8, 8, "allgather") is None
    rejection = v.cp_comm(1, 4, "a2a")
    assert rejection.rule == "cp_a2a_heads" and "kv heads (2)" in rejection.reason
    mla = replace(TINY, num_query_groups=None, multi_latent_attention=True, q_lora_rank=24)
    assert Validator(mla, TRAIN, ClusterSpec(H100, 8)).cp_comm(1, 4, "a2a") is None  # a KV head per query head


def test_the_ring_is_built_for_plain_causal_attention_only():
    windowed = replace(TINY, window_size=(4, 0), window_attn_skip_freq=2)
    sinks = replace(TINY, softmax_type="learnable")
    for model in (windowed, sinks):
        for comm, fields in (("p2p", {}), ("a2a+p2p", {"hierarchical_context_parallel_sizes": (2, 2)})):
            config = ParallelConfig(world_size=4, cp=4, cp_comm_type=comm, **fields)
            assert [r.rule for r in check(model, TRAIN, config)] == ["executor_cp_ring_attention"]
        assert check(model, TRAIN, ParallelConfig(world_size=2, cp=2, cp_comm_type="a2a")) == []
    assert check(TINY, TRAIN, ParallelConfig(world_size=4, cp=4, cp_comm_type="p2p")) == []


def test_check_returns_every_rule_megatrons_first_then_the_executors_tagged():
    # sp without tp (Megatron's), fp8 Adam moments (the executor's)
    config = ParallelConfig(world_size=8, tp=1, cp=2, sequence_parallel=True, exp_avg_dtype="fp8")
    found = check(TINY, TRAIN, config, ClusterSpec(H100, 8))
    assert [r.rule for r in found] == ["sp_needs_tp", "executor_optimizer_dtypes"]
    assert [is_executor_rule(r.rule) for r in found] == [False, True]
    assert all(r.rule in RULES or r.rule in EXECUTOR_RULES for r in found)
    # the planner's question (check_config) leaves the executor's rules out
    assert [r.rule for r in check_config(TINY, TRAIN, ClusterSpec(H100, 8), config)] == ["sp_needs_tp"]
    # without a cluster the layout's own world counts; with one, a layout for another world is one rejection
    assert check(TINY, TRAIN, ParallelConfig(world_size=8, ep=8)) == []
    assert [r.rule for r in check(TINY, TRAIN, ParallelConfig(world_size=8, ep=8), ClusterSpec(H100, 16))] == [
        "world_dense"]



def test_a_registered_rule_joins_the_rule_book(monkeypatch):
    monkeypatch.setattr(validity, "_REGISTERED", list(validity._REGISTERED))
    monkeypatch.setattr(validity, "RULES", dict(RULES))
    rule = validity.register(validity.Rule("odd_mbs", "micro_batch_size is even",
                                           lambda m, t, c: "odd" if c.micro_batch_size % 2 else None))
    assert validity.RULES["odd_mbs"] == "micro_batch_size is even" and not is_executor_rule("odd_mbs")
    assert [r.rule for r in check(TINY, TRAIN, ParallelConfig(world_size=1))] == ["odd_mbs"]
    assert check(TINY, TRAIN, ParallelConfig(world_size=1, micro_batch_size=2)) == []
    with pytest.raises(ValueError, match="registered twice"):
        validity.register(rule)


def test_cuda_graphs_executor_rule_names_each_limit():
    """What the executor's capture cannot hold is one executor rule naming every limit; Megatron's layout stays
    valid (the planner plans for Megatron, whose graphs capture TP collectives and pipelines)."""
    cfg = ParallelConfig(world_size=8, tp=2, pp=2, cuda_graphs=True)
    assert rules_of(TINY, TRAIN, 8, tp=2, pp=2, cuda_graphs=True) == set()
    found = [r for r in check(TINY, TRAIN, cfg) if r.rule == "executor_cuda_graphs"]
    assert len(found) == 1 and is_executor_rule("executor_cuda_graphs")
    for words in ("tp = cp = 1", "pp = 1", "overlap_param_gather"):
        assert words in found[0].reason
    fp8 = [r.rule for r in check(TINY, TrainingSpec(64, 16, precision="fp8"),
                                 ParallelConfig(world_size=1, cuda_graphs=True))]
    assert fp8 == ["executor_cuda_graphs"]
    assert check(TINY, TRAIN, ParallelConfig(world_size=1, cuda_graphs=True)) == []
    assert check(TINY, TRAIN, ParallelConfig(world_size=2, ep=2, cuda_graphs=True, use_distributed_optimizer=False,
                                             overlap_param_gather=False)) == []
