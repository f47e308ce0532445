"""The per-GPU memory model: published Korthikanti et al. rows, Megatron's MoE-layer peaks, behaviour."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from spec import ClusterSpec, ModelSpec, ParallelConfig, TrainingSpec, get_hardware, get_model
from spec.errors import InvalidConfigError
from costmodel.memory import (
    FRAGMENTATION,
    MemoryBreakdown,
    _comm_per_token,
    _gradient_peak,
    _shape,
    _tensor_split,
    estimate_memory,
    estimate_stage_memory,
    in_flight_micro_batches,
    layer_activation_bytes,
    peak_memory_bytes,
)
from costmodel.params import attention_params, mlp_params, moe_params, stage_param_counts

GIB = 2**30
REFERENCE = Path(__file__).resolve().parents[1] / "data" / "reference.json"  # copy of shared/validation
H100 = ClusterSpec(get_hardware("h100-sxm"), 64)


def _reference(name):
    if not REFERENCE.is_file():
        pytest.skip(f"validation data not found at {REFERENCE} (the shared/validation folder beside the repo)")
    return json.loads(REFERENCE.read_text())[name]


# ---- Korthikanti et al. 2022 (arXiv 2205.05198), GPT on A100 -----------------------------------------------
def _korthikanti_case(row, ref):
    model = ModelSpec(name=row["model"], num_layers=row["layers"], hidden_size=row["hidden"],
                      num_attention_heads=row["heads"], ffn_hidden_size=4 * row["hidden"], vocab_size=ref["vocab"],
                      swiglu=False, normalization="layernorm", add_bias_linear=True,
                      position_embedding_type="learned_absolute", max_position_embeddings=ref["seq"],
                      untie_embeddings_and_output_weights=False, hidden_dropout=0.1, attention_dropout=0.1)
    training = TrainingSpec(seq_length=ref["seq"], global_batch_size=row["gbs"], precision="fp16",
                            flash_attention=False, distributed_optimizer=False)
    baseline = ParallelConfig(world_size=row["gpus"], tp=row["tp"], pp=row["pp"], vpp=row["vpp"] or 1,
                              micro_batch_size=row["mbs"], sequence_parallel=False, use_distributed_optimizer=False)
    selective = baseline.replace(sequence_parallel=True, recompute_granularity="selective",
                                 recompute_modules=("core_attn",))
    return model, training, baseline, selective


def _korthikanti_rows():
    if not REFERENCE.is_file():
        return [pytest.param(None, id="reference-missing")]
    return [pytest.param(r, id=r["model"]) for r in json.loads(REFERENCE.read_text())["korthikanti2022"]["rows"]]


@pytest.mark.parametrize("row", _korthikanti_rows())
def test_korthikanti_weights_and_optimizer_within_3_percent(row):
    ref = _reference("korthikanti2022")
    model, training, baseline, _ = _korthikanti_case(row, ref)
    cluster = ClusterSpec(get_hardware("a100-80gb"), row["gpus"])
    # The paper's figure is 18 bytes/param of the transformer layers on one GPU; for PP > 1 a middle
    # rank holds exactly that, the first rank adds the embedding (reported in docs/memory-model.md).
    stage = 1 if row["pp"] > 1 else 0
    got = estimate_stage_memory(model, training, cluster, baseline, stage)
    predicted = (got.weights + got.grads + got.optimizer) / GIB
    assert predicted == pytest.approx(row["mem_gib"]["weights_optimizer"], rel=0.03)


@pytest.mark.parametrize("row", _korthikanti_rows())
def test_korthikanti_activations_within_10_percent(row):
    ref = _reference("korthikanti2022")
    model, training, baseline, selective = _korthikanti_case(row, ref)
    cluster = ClusterSpec(get_hardware("a100-80gb"), row["gpus"])
    base = estimate_memory(model, training, cluster, baseline)
    sel = estimate_memory(model, training, cluster, selective)
    assert base.stage == sel.stage == 0  # the first rank holds the most micro-batches
    assert base.activations / GIB == pytest.approx(row["mem_gib"]["activations_baseline"], rel=0.10)
    assert sel.activations / GIB == pytest.approx(row["mem_gib"]["activations_sp_selective"], rel=0.10)


def test_korthikanti_per_layer_formula_exactly():
    # sbh(10 + 24/t + 5as/(ht)) without SP, sbh·34/t with SP + selective, for one layer and micro-batch.
    s, b, h, a, t = 2048, 1, 1024, 16, 4
    model = ModelSpec(name="gpt", num_layers=1, hidden_size=h, num_attention_heads=a, ffn_hidden_size=4 * h,
                      vocab_size=1024, swiglu=False, normalization="layernorm", hidden_dropout=0.1,
                      attention_dropout=0.1)
    training = TrainingSpec(seq_length=s, global_batch_size=1, precision="fp16", flash_attention=False)
    cfg = ParallelConfig(world_size=t, tp=t, sequence_parallel=False)
    base = sum(v for _, v in layer_activation_bytes(model, training, cfg, False))
    assert base == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)
    sel = cfg.replace(sequence_parallel=True, recompute_granularity="selective", recompute_modules=("core_attn",))
    assert sum(v for _, v in layer_activation_bytes(model, training, sel, False)) == pytest.approx(
        s * b * h * 34 / t, rel=1e-12)


# ---- Megatron-LM single MoE layer on 8xH100 (TP1 EP8, seq 4096, MBS 1) ---------------------------------
def _moe_layer_peak(layer, dtype, ref):
    """Peak bytes of one bare MoELayer as Megatron's perf test measures it: bf16 weights and bf16 .grad (no
    DDP, no optimizer), with fp8 the cached fp8 weight copies, the input tensor and its gradient, the output,
    the stored MoE tensors, the one-layer backward working set and the dispatch buffers;
    max_memory_allocated, so no fragmentation."""
    dims = ref["layers"][layer]
    model = ModelSpec(name=layer, num_layers=1, hidden_size=dims["hidden"], num_attention_heads=8,
                      ffn_hidden_size=dims["moe_ffn"], vocab_size=32000, num_experts=dims["experts"],
                      moe_router_topk=dims["topk"], moe_ffn_hidden_size=dims["moe_ffn"],
                      moe_shared_expert_intermediate_size=dims.get("shared_ffn"))
    training = TrainingSpec(seq_length=ref["seq"], global_batch_size=8, precision=dtype, main_grads_fp32=False)
    cfg = ParallelConfig(world_size=ref["gpus"], ep=ref["ep"], micro_batch_size=ref["mbs"])
    counts = moe_params(model, 1, cfg.ep, 1)
    params = counts.total - model.hidden_size  # no pre-MLP norm in a bare MoELayer
    fp8_copies = 2 * (counts.dense_tp_sharded + counts.expert) if dtype == "fp8" else 0  # shared + routed GEMMs
    stored = sum(v for k, v in layer_activation_bytes(model, training, cfg, True)
                 if k.startswith(("act.moe.", "act.shared.")) and k != "act.moe.norm_input")
    tokens = ref["seq"] * ref["mbs"]
    shape = _shape(cfg)
    working = tokens * _gradient_peak(model, training, shape, True)
    dispatch = tokens * max(v for _, v in _comm_per_token(model, training, shape, True))
    return 2 * 2 * params + fp8_copies + stored + 2 * tokens * model.hidden_size * 2 + working + dispatch


def test_megatron_moe_layer_peaks_within_20_percent():
    # 20 %: the perf test's peak also holds Transformer Engine / cuBLAS workspaces and kernel-internal
    # temporaries, and frees saved tensors progressively during backward, none of which a per-tensor model
    # sees (measured: -14 %, -8 %, +20 %, +4 % with the executor-only MoE tensors counted, see docs/memory-model.md).
    ref = _reference("megatron_moe_layer_8xh100")
    assert len(ref["rows"]) == 4
    for row in ref["rows"]:
        predicted = _moe_layer_peak(row["layer"], row["dtype"], ref) / GIB
        assert predicted == pytest.approx(row["peak_gib"], rel=0.20), (row["layer"], row["dtype"])


# ---- behaviour ----------------------------------------------------------------------------------
def _moe_training(**kw):
    return TrainingSpec(seq_length=4096, global_batch_size=64, **kw)


def test_weights_shrink_with_tp_ep_pp_in_the_expected_ratios():
    model, training = get_model("mixtral-8x7b"), _moe_training()
    base = estimate_stage_memory(model, training, H100, ParallelConfig(world_size=64, pp=4, ep=2), 1)
    ep8 = estimate_stage_memory(model, training, H100, ParallelConfig(world_size=64, pp=4, ep=8), 1)
    tp4 = estimate_stage_memory(model, training, H100, ParallelConfig(world_size=64, tp=4, pp=4, ep=2), 1)
    pp8 = estimate_stage_memory(model, training, H100, ParallelConfig(world_size=64, pp=8, ep=2), 1)
    assert ep8.detail("weights.expert") * 4 == base.detail("weights.expert")
    assert tp4.detail("weights.dense_tp_sharded") * 4 == base.detail("weights.dense_tp_sharded")
    assert pp8.weights * 2 == base.weights  # a middle rank holds layers only: half the layers, half the bytes
    assert ep8.weights < base.weights and tp4.weights < base.weights


def test_distributed_optimizer_divides_by_dp_cp_and_edp_exactly():
    model, training = get_model("mixtral-8x7b"), _moe_training()
    on = ParallelConfig(world_size=64, tp=2, cp=2, pp=2, ep=4)  # dp 8 (dp·cp 16), edp 8
    off = on.replace(use_distributed_optimizer=False)
    a, b = estimate_stage_memory(model, training, H100, on, 0), estimate_stage_memory(model, training, H100, off, 0)
    assert (on.dp, on.edp) == (8, 8)
    for bucket in ("optimizer.dense_tp_sharded", "optimizer.dense_replicated"):
        assert a.detail(bucket) * 16 == pytest.approx(b.detail(bucket), rel=1e-12)
    assert a.detail("optimizer.expert") * 8 == pytest.approx(b.detail("optimizer.expert"), rel=1e-12)
    assert a.weights == b.weights and a.grads == b.grads and a.activations == b.activations


def test_eighteen_bytes_per_parameter_with_fp32_main_grads_sixteen_without():
    model = get_model("tiny-moe")
    cfg = ParallelConfig(world_size=1, use_distributed_optimizer=False)
    params = 156_992  # hand count, tests/costmodel/test_params.py
    fp32 = estimate_memory(model, TrainingSpec(seq_length=64, global_batch_size=1), H100, cfg)
    bf16 = estimate_memory(model, TrainingSpec(seq_length=64, global_batch_size=1, main_grads_fp32=False), H100, cfg)
    assert fp32.weights + fp32.grads + fp32.optimizer == 18 * params
    assert bf16.weights + bf16.grads + bf16.optimizer == 16 * params


def test_recompute_full_below_selective_below_none():
    model, training = get_model("mixtral-8x7b"), _moe_training()
    cfg = ParallelConfig(world_size=64, tp=2, pp=4, ep=8)
    none = estimate_memory(model, training, H100, cfg).activations
    sel = estimate_memory(model, training, H100, cfg.replace(recompute_granularity="selective",
                                                             recompute_modules=("core_attn", "moe_act"))).activations
    full = estimate_memory(model, training, H100, cfg.replace(recompute_granularity="full")).activations
    part = estimate_memory(model, training, H100, cfg.replace(recompute_granularity="full",
                                                              recompute_num_layers=4)).activations
    assert full < part < none and full < sel < none


def test_each_selective_module_removes_its_tensors():
    model, training = get_model("deepseek-v3"), _moe_training()
    cfg = ParallelConfig(world_size=256, tp=2, pp=8, ep=32)
    names = dict(layer_activation_bytes(model, training, cfg, True))
    for module, gone in (("mla_up_proj", "act.attn.qkv"), ("moe_act", "act.moe.expert_act_output"),
                         ("layernorm", "act.moe.router_input"), ("shared_experts", "act.shared.fc1_output"),
                         ("moe", "act.moe.permuted_tokens"), ("core_attn", "act.attn.softmax_lse")):
        sel = cfg.replace(recompute_granularity="selective", recompute_modules=(module,))
        kept = dict(layer_activation_bytes(model, training, sel, True))
        assert gone in names and gone not in kept, module
        assert sum(kept.values()) < sum(names.values())
    dense = dict(layer_activation_bytes(model, training, cfg.replace(recompute_granularity="selective",
                                                                     recompute_modules=("mlp",)), False))
    assert "act.mlp.fc1_output" not in dense and "act.mlp.fc1_input" in dense


def test_routing_imbalance_scales_only_the_expert_terms():
    model = get_model("mixtral-8x7b")
    cfg = ParallelConfig(world_size=64, tp=2, pp=4, ep=8)
    flat = dict(layer_activation_bytes(model, _moe_training(), cfg, True))
    skew = dict(layer_activation_bytes(model, _moe_training(moe_routing_imbalance=1.5), cfg, True))
    for name in flat:
        ratio = 1.5 if name in ("act.moe.permuted_tokens", "act.moe.permuted_probs", "act.moe.expert_fc1_output",
                                "act.moe.expert_act_output", "act.moe.reorder_indices") else 1.0
        assert skew[name] == pytest.approx(ratio * flat[name], rel=1e-12), name
    # with EP = 1 every expert is local: the GPU's total cannot be imbalanced
    local = ParallelConfig(world_size=64, tp=2, pp=4, ep=1)
    assert layer_activation_bytes(model, _moe_training(), local, True) == \
        layer_activation_bytes(model, _moe_training(moe_routing_imbalance=1.5), local, True)
    capped = TrainingSpec(seq_length=4096, global_batch_size=64, routing_mode="capacity",
                          moe_expert_capacity_factor=1.25, moe_routing_imbalance=2.0)
    assert dict(layer_activation_bytes(model, capped, cfg, True))["act.moe.permuted_tokens"] == \
        pytest.approx(1.25 * flat["act.moe.permuted_tokens"], rel=1e-12)


def test_interleaving_raises_first_stage_activations_by_exactly_the_factor():
    model = get_model("mixtral-8x7b")  # 32 layers, no dropout
    training = TrainingSpec(seq_length=4096, global_batch_size=1024)  # m ≥ pp·vpp: the warm-up is not capped
    for pp, vpp in ((4, 2), (4, 4), (8, 2)):
        plain = ParallelConfig(world_size=64, pp=pp, ep=8)
        inter = plain.replace(vpp=vpp)
        a = estimate_stage_memory(model, training, H100, plain, 0).activations
        b = estimate_stage_memory(model, training, H100, inter, 0).activations
        assert b / a == pytest.approx(1 + (pp - 1) / (pp * vpp), rel=1e-12)


def test_in_flight_micro_batches_follow_the_schedules():
    assert [in_flight_micro_batches(4, 1, i, 8) for i in range(4)] == [4, 3, 2, 1]
    assert in_flight_micro_batches(4, 1, 0, 2) == 2  # fewer micro-batches than stages
    assert in_flight_micro_batches(4, 2, 0, 8) == 2 * 3 + 4 + 1
    assert in_flight_micro_batches(4, 2, 3, 8) == 4 + 1
    assert in_flight_micro_batches(4, 2, 0, 2) == 4  # capped at m·vpp


def test_flash_attention_drops_the_score_matrix():
    model = get_model("mixtral-8x7b")
    cfg = ParallelConfig(world_size=8, tp=8, ep=8)
    flash = dict(layer_activation_bytes(model, _moe_training(), cfg, True))
    plain = dict(layer_activation_bytes(model, _moe_training(flash_attention=False), cfg, True))
    assert "act.attn.softmax" not in flash and "act.attn.softmax_lse" in flash
    # 32 heads / TP 8, seq 4096 keys, 2 bytes, per local token (mbs 1 · 4096 tokens)
    assert plain["act.attn.softmax"] == 4096 * (32 / 8) * 4096 * 2


def test_sequence_parallel_divides_by_tp_and_cp_divides_the_sequence():
    model, training = get_model("mixtral-8x7b"), _moe_training()
    tp4 = ParallelConfig(world_size=64, tp=4, ep=8, sequence_parallel=False)
    sp = dict(layer_activation_bytes(model, training, tp4.replace(sequence_parallel=True), True))
    nosp = dict(layer_activation_bytes(model, training, tp4, True))
    assert sp["act.moe.norm_input"] * 4 == nosp["act.moe.norm_input"]
    assert sp["act.attn.qkv"] == nosp["act.attn.qkv"]  # head-split either way
    cp1 = estimate_memory(model, training, H100, ParallelConfig(world_size=64, tp=2, ep=8))
    cp2 = estimate_memory(model, training, H100, ParallelConfig(world_size=64, tp=2, cp=2, ep=8))
    assert cp2.activations * 2 == pytest.approx(cp1.activations, rel=1e-12)


def test_gqa_shrinks_kv_activations():
    mha = ModelSpec(name="mha", num_layers=2, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096,
                    vocab_size=1024)
    gqa = ModelSpec(**{**mha.to_dict(), "name": "gqa", "num_query_groups": 2})
    cfg, training = ParallelConfig(world_size=1), TrainingSpec(seq_length=128, global_batch_size=1)
    a = dict(layer_activation_bytes(mha, training, cfg, False))["act.attn.qkv"]
    b = dict(layer_activation_bytes(gqa, training, cfg, False))["act.attn.qkv"]
    assert a / b == pytest.approx((16 + 32) / (16 + 4), rel=1e-12)


def test_logits_live_on_the_last_stage_split_by_tp():
    model, training = get_model("mixtral-8x7b"), _moe_training()
    cfg = ParallelConfig(world_size=64, tp=4, pp=4, ep=8)
    first = estimate_stage_memory(model, training, H100, cfg, 0)
    last = estimate_stage_memory(model, training, H100, cfg, 3)
    assert first.logits == 0
    # 32000 padded to a multiple of 128·TP: 8064 rows per TP rank, all of them real on rank 0
    assert model.padded_vocab_size(4) == 32256
    # the executor's loss over 4096 tokens: 2**26 // 4096 = 16384 rows per block >= 8064, so one block of
    # 4096·8064 logits in bf16 + its fp32 softmax (6 B each, the torch path's upper bound); the output weight's
    # bf16 gradient 8064·4096·2 B; per token the saved log-sum-exp 4 B. The whole bf16 logits, 4096·8064·2 B
    # (66 MB, within the keep budget), are kept from forward to backward, when no layer's backward working set
    # nor its communication buffers are allocated: they add only what exceeds those (here nothing)
    block, kept, weight_grad, per_token = 4096 * 8064 * 6, 4096 * 8064 * 2, 8064 * 4096 * 2, 4096 * 4
    layer_work = last.detail("allocator.backward_working_set") + last.detail("comm.sp.gather_scatter") + \
        last.detail("comm.pp.send_recv")
    assert kept < layer_work
    assert last.logits == block + weight_grad + per_token == 264_257_536
    assert last.detail("logits.loss_block") == block and last.detail("logits.output_weight_grad") == weight_grad
    assert last.detail("logits.kept_logits_beyond_layer_work") == 0 and last.detail("logits.lse") == per_token
    # Megatron's loss: the whole bf16 logits and one fp32 softmax, 4096 · 8064 · (4 + 2)
    megatron = estimate_stage_memory(model, replace(training, megatron_cross_entropy=True), H100, cfg, 3)
    assert megatron.logits == 4096 * 8064 * (4 + 2) == megatron.detail("logits.loss_and_output")


def test_kept_logits_add_what_exceeds_the_layer_work():
    """Qwen3-30B-A3B's 4-layer proxy on one H200 at micro-batch 8: its bf16 logits (32768 x 151936, 9.3 GiB)
    exceed the layers' backward working set and communication buffers, so the excess is priced; the peak of the
    planner's path equals the breakdown's total (measured on an H200: 80.66 GiB reserved, docs/benchmarks.md)."""
    from spec.proxy import proxy_model
    model, training = proxy_model(get_model("qwen3-30b-a3b"), 4), TrainingSpec(seq_length=4096, global_batch_size=8)
    cluster, cfg = ClusterSpec(get_hardware("h200"), 1), ParallelConfig.parse("dp1 mbs8", world_size=1)
    b = estimate_stage_memory(model, training, cluster, cfg, 0)
    kept = 32768 * 151936 * 2
    layer_work = b.detail("allocator.backward_working_set") + sum(v for n, v in b.details if n.startswith("comm."))
    assert 0 < kept - layer_work == pytest.approx(b.detail("logits.kept_logits_beyond_layer_work"), rel=1e-12)
    assert peak_memory_bytes(model, training, cluster, cfg) == pytest.approx(b.total, rel=1e-12)


def test_mtp_heads_keep_the_main_heads_logits_beside_their_layer():
    """DeepSeek-V3 (one MTP depth) on its last stage: the main head's kept logits are alive while the MTP
    depth's decoder layer runs its backward, so both heads' kept bf16 logits are held in full."""
    model, training = get_model("deepseek-v3"), TrainingSpec(seq_length=4096, global_batch_size=1024)
    cfg = ParallelConfig(world_size=1024, tp=2, pp=16, vpp=2, ep=32)
    b = estimate_stage_memory(model, training, ClusterSpec(get_hardware("h100-sxm"), 1024), cfg, 15)
    rows = model.padded_vocab_size(2) // 2  # all real on TP rank 0
    assert b.detail("logits.kept_logits") == 4096 * rows * 2 * 2
    assert b.detail("logits.kept_logits_beyond_layer_work") == 0


def test_most_loaded_stage_is_the_max_over_every_stage():
    training = _moe_training()
    for name, cfg in (("deepseek-v3", ParallelConfig(world_size=1024, tp=2, pp=16, vpp=2, ep=32)),
                      ("deepseek-v3", ParallelConfig(world_size=1024, pp=32, ep=32, recompute_granularity="full")),
                      ("mixtral-8x7b", ParallelConfig(world_size=64, pp=8, ep=8)),
                      ("qwen3-30b-a3b", ParallelConfig(world_size=64, pp=4, vpp=3, ep=16, micro_batch_size=2))):
        model = get_model(name)
        best = estimate_memory(model, training, H100, cfg)
        every = [estimate_stage_memory(model, training, H100, cfg, s) for s in range(cfg.pp)]
        assert best.total == pytest.approx(max(b.total for b in every), rel=1e-12), (name, cfg.label())
        assert peak_memory_bytes(model, training, H100, cfg) == pytest.approx(best.total, rel=1e-12)


def test_details_add_up_to_the_categories():
    model, training = get_model("deepseek-v3"), _moe_training(precision="fp8")
    cfg = ParallelConfig(world_size=1024, tp=2, pp=16, ep=64, recompute_granularity="full", recompute_num_layers=1)
    b = estimate_memory(model, training, H100, cfg)
    for field, prefix in (("weights", "weights."), ("grads", "grads."), ("optimizer", "optimizer."),
                          ("activations", "act."), ("logits", "logits."), ("comm_buffers", "comm."),
                          ("allocator_overhead", "allocator.")):
        assert b.detail(prefix) == pytest.approx(getattr(b, field), rel=1e-9, abs=1e-6), field
    assert b.detail("weights.fp8_copies") > 0
    assert b.total == pytest.approx(sum(v for _, v in b.details), rel=1e-12)


def test_deepseek_v3_known_layout_fits_an_h100():
    # DeepSeek-V3 on 1024 H100s: a pipelined, expert-parallel layout with MLA up-proj / MoE act / norm
    # recompute must fit 80 GB; all 61 layers on every GPU (PP1, 671B/64-way experts) must not.
    model, training = get_model("deepseek-v3"), TrainingSpec(seq_length=4096, global_batch_size=8192)
    cluster = ClusterSpec(get_hardware("h100-sxm"), 1024)
    fits = ParallelConfig(world_size=1024, tp=2, pp=16, ep=64, recompute_granularity="selective",
                          recompute_modules=("mla_up_proj", "moe_act", "layernorm"))
    assert estimate_memory(model, training, cluster, fits).total < cluster.usable_hbm_bytes
    assert estimate_memory(model, training, cluster, ParallelConfig(world_size=1024, ep=64)).total \
        > cluster.usable_hbm_bytes


def test_stage_outside_pipeline_is_a_clear_error():
    with pytest.raises(InvalidConfigError, match="stage 4 is outside the pipeline"):
        estimate_stage_memory(get_model("tiny-moe"), _moe_training(), H100, ParallelConfig(world_size=4, pp=4), 4)


def test_breakdown_details_are_a_real_field():
    import dataclasses
    import pickle

    b = estimate_memory(get_model("tiny-moe"), _moe_training(), H100, ParallelConfig(world_size=2, pp=2))
    assert "details" in [f.name for f in dataclasses.fields(b)]
    as_dict = dataclasses.asdict(b)
    assert as_dict["details"] and as_dict["weights"] == b.weights
    assert pickle.loads(pickle.dumps(b)) == b
    built = MemoryBreakdown(0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, (("x", 1.0),))
    assert built.total == 28.0 and built.details == (("x", 1.0),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.weights = 0.0  # type: ignore[misc]


def test_total_falls_along_the_recompute_ladder_and_rises_with_micro_batch_size():
    # The planner's staircase pruning relies on both monotonicities (planner/rank.py).
    ladder = (("none", ()), ("selective", ("core_attn",)), ("selective", ("core_attn", "moe_act", "layernorm")),
              ("full", ()))
    training = TrainingSpec(seq_length=4096, global_batch_size=256)
    for name, base in (("deepseek-v3", ParallelConfig(world_size=1024, tp=2, pp=16, vpp=2, ep=64)),
                       ("mixtral-8x7b", ParallelConfig(world_size=64, tp=2, pp=4, ep=8)),
                       ("qwen3-30b-a3b", ParallelConfig(world_size=64, pp=8, ep=8, etp=1)),
                       ("tiny-moe-shared", ParallelConfig(world_size=4, pp=4))):
        model = get_model(name)
        for mbs in (1, 2, 4):
            totals = [peak_memory_bytes(model, training, H100, base.replace(
                micro_batch_size=mbs, recompute_granularity=g, recompute_modules=m)) for g, m in ladder]
            assert totals == sorted(totals, reverse=True), (name, mbs, totals)
        for g, m in ladder:
            by_mbs = [peak_memory_bytes(model, training, H100, base.replace(
                micro_batch_size=mbs, recompute_granularity=g, recompute_modules=m)) for mbs in (1, 2, 4, 8)]
            assert by_mbs == sorted(by_mbs), (name, g, by_mbs)


def test_random_layouts_pick_the_largest_rank_and_details_add_up():
    # Every catalog model plus a dense LayerNorm/dropout GPT, random folded layouts and knobs (fixed seed):
    # the candidate-rank shortcut equals the max over all ranks, details sum to the total, nothing negative.
    import random

    from spec import model_names
    from spec.parallel_config import RECOMPUTE_MODULES

    rng = random.Random(0)
    dense = ModelSpec(name="dense", num_layers=12, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048,
                      vocab_size=5000, hidden_dropout=0.1, attention_dropout=0.1, normalization="layernorm")
    models = [get_model(n) for n in model_names()] + [dense]
    checked = 0
    while checked < 300:
        model = rng.choice(models)
        world = rng.choice([8, 16, 64, 128])
        tp, cp, pp = rng.choice([1, 2, 4]), rng.choice([1, 2]), rng.choice([1, 2, 4, 8])
        ep, etp = rng.choice([1, 2, 4, 8]), rng.choice([1, 2])
        if world % (tp * cp * pp) or world % (ep * etp * pp):
            continue
        granularity = rng.choice(["none", "selective", "full"])
        cfg = ParallelConfig(
            world_size=world, tp=tp, cp=cp, pp=pp, vpp=rng.choice([1, 2, 3]), ep=ep, etp=etp,
            micro_batch_size=rng.choice([1, 2]), recompute_granularity=granularity,
            recompute_modules=tuple(rng.sample(RECOMPUTE_MODULES, 2)) if granularity == "selective" else (),
            recompute_num_layers=rng.choice([0, 1]) if granularity == "full" else 0,
            moe_token_dispatcher_type=rng.choice(["alltoall", "allgather"]),
            use_distributed_optimizer=rng.random() < 0.5)
        routing = rng.choice([{}, {"routing_mode": "capacity", "moe_expert_capacity_factor": 1.25},
                              {"moe_routing_imbalance": 1.3}])
        training = TrainingSpec(seq_length=rng.choice([1024, 4096]), global_batch_size=rng.choice([64, 256]),
                                precision=rng.choice(["bf16", "fp8", "fp32"]), flash_attention=rng.random() < 0.7,
                                main_grads_fp32=rng.random() < 0.7, **routing)
        best = estimate_memory(model, training, H100, cfg)
        every = max(estimate_stage_memory(model, training, H100, cfg, s).total for s in range(cfg.pp))
        assert best.total == pytest.approx(every, rel=1e-9), (model.name, cfg.label())
        assert sum(v for _, v in best.details) == pytest.approx(best.total, rel=1e-9)
        assert min(v for _, v in best.details) >= 0
        checked += 1


def test_executor_terms_cublas_workspace_reduced_shards_and_gradient_flats():
    from costmodel.memory import CUBLAS_HANDLES, CUBLAS_WORKSPACE_HOPPER, library_workspace_bytes, peak_memory_bytes

    assert library_workspace_bytes("h100-sxm") == CUBLAS_HANDLES * CUBLAS_WORKSPACE_HOPPER == 64 * 2**20
    assert library_workspace_bytes("a100-80gb") == 8 * 2**20 and library_workspace_bytes("cpu") == 0
    model, training = get_model("small-moe"), TrainingSpec(seq_length=1024, global_batch_size=16)
    cfg = ParallelConfig(world_size=2)
    b = estimate_memory(model, training, H100, cfg)
    assert b.detail("allocator.cublas_workspace") == 64 * 2**20
    assert b.total == pytest.approx(peak_memory_bytes(model, training, H100, cfg))
    # distributed optimizer: the executor keeps each reduced fp32 gradient shard (4 B per parameter / DP)
    params = stage_param_counts(model, cfg, 0).total
    assert b.detail("optimizer.reduced_grad_shards") == pytest.approx(4 * params / 2)
    # tiny sequences: the Adam step, not the backward, sets the peak (16-bit weights' main grads are reduced
    # in their bucket buffers: no fp32 flat copies, only fp32 weights still flatten)
    short = TrainingSpec(seq_length=64, global_batch_size=2)
    one = ParallelConfig(world_size=2, ep=2)
    m = estimate_memory(model, short, H100, one)
    local = stage_param_counts(model, one, 0).total
    excess = m.detail("allocator.grad_reduce_peak_excess")
    dynamic = m.activations + m.logits + m.comm_buffers + m.allocator_overhead - excess - m.detail(
        "allocator.cublas_workspace")
    # The Adam step runs torch's fused kernel in place: its only temporary is the write-back's 16-bit copy of a
    # unit's master shard, 2 bytes per element. The expert unit is not sharded (EDP 1): one unit of all 9.2M
    # local elements; the dense units, sharded over DP 2 and gathered in place, copy half of theirs.
    assert excess > 0
    assert dynamic + excess == pytest.approx(local * 2, rel=1e-9)
    # Mixtral's experts: the one-node grouped SwiGLU's backward returns the w13 and w2 gradients of the 4 local
    # experts together, in bf16, before the main-grad hooks free them: 3 · 4 · 14336 · 4096 elements, 2 bytes
    # each; at seq 64 that, not the Adam step's write-back of w13 (2 bytes per element of 2/3 of it), sets the peak
    big = estimate_memory(get_model("mixtral-8x7b").with_layers(2), short, H100, one)
    wgrad = 3 * 4 * 14336 * 4096 * 2
    assert big.detail("allocator.grad_reduce_peak_excess") == 0
    held = big.logits * (1 + FRAGMENTATION)  # the loss's bytes, freed before the experts' backward
    assert big.detail("allocator.expert_weight_grads") == pytest.approx(wgrad - held, rel=1e-9)


def test_expert_weight_gradients_of_one_layer_alive_at_once_hand_worked():
    from costmodel.memory import expert_weight_grad_bytes
    # Qwen3-30B-A3B, 128 experts of 768 x 2048, EP 1: w13 (2·768·2048 each) and w2 (768·2048) together in bf16
    qwen = get_model("qwen3-30b-a3b").with_layers(2)
    bf16 = TrainingSpec(seq_length=4096, global_batch_size=8)
    assert expert_weight_grad_bytes(qwen, bf16, 1, 1) == 128 * 3 * 768 * 2048 * 2
    assert expert_weight_grad_bytes(qwen, bf16, 2, 1) == 64 * 3 * 768 * 2048 * 2  # EP 2: half the experts
    assert expert_weight_grad_bytes(qwen, bf16, 1, 2) == 128 * 3 * 384 * 2048 * 2  # ETP 2: half of each
    # fp8 runs the GEMMs as separate autograd nodes: one tensor (the larger, w13) at a time
    fp8 = TrainingSpec(seq_length=4096, global_batch_size=8, precision="fp8")
    assert expert_weight_grad_bytes(qwen, fp8, 1, 1) == 128 * 2 * 768 * 2048 * 2
    # biases (the experts' GEMMs and bias adds as separate nodes): w13 alone as well
    assert expert_weight_grad_bytes(replace(qwen, add_bias_linear=True), bf16, 1, 1) == 128 * 2 * 768 * 2048 * 2
    # the first of two pipeline stages holds no loss: the whole transient adds to its backward's peak
    pp2 = ParallelConfig(world_size=2, pp=2, micro_batch_size=2)
    first = estimate_stage_memory(qwen, bf16, H100, pp2, 0)
    assert first.detail("allocator.expert_weight_grads") == 128 * 3 * 768 * 2048 * 2
    # the last stage's loss bytes are freed before the experts' backward: only the excess over them counts
    last = estimate_stage_memory(qwen, bf16, H100, pp2, 1)
    assert last.detail("allocator.expert_weight_grads") == pytest.approx(
        max(0.0, 128 * 3 * 768 * 2048 * 2 - last.logits * (1 + FRAGMENTATION)), rel=1e-9)


# ---- modern attention: MLA, sinks and windows, qk-layernorm ------------------------------------------------
def test_mla_keeps_the_executors_latents_and_per_head_tensors_hand_worked():
    # DeepSeek-V3 at tp8 with SP, seq 4096, bf16, per local token (4096 tokens of one micro-batch):
    # q_down output 1536/8 and kv_down output (512+64)/8 on the SP slice; the gathered latents
    # 1536+512+64 whole; q and k 128·192/8 each, the kv up projection 128·256/8, the core output and
    # linear_proj's input 128·128/8 each, the fp32 log-sum-exp 128/8
    model, training = get_model("deepseek-v3"), _moe_training()
    cfg = ParallelConfig(world_size=64, tp=8, ep=8)
    got = dict(layer_activation_bytes(model, training, cfg, True))
    tokens, b = 4096, 2
    assert got["act.mla.q_down_output"] == tokens * 1536 / 8 * b
    assert got["act.mla.kv_down_output"] == tokens * 576 / 8 * b
    assert got["act.mla.latents"] == tokens * (1536 + 512 + 64) * b
    assert got["act.attn.qkv"] == tokens * 128 * (2 * 192 + 256) / 8 * b
    assert got["act.mla.core_output"] == got["act.attn.proj_input"] == tokens * 128 * 128 / 8 * b
    assert got["act.attn.softmax_lse"] == tokens * 128 / 8 * 4
    # without a query LoRA the normalised input itself is gathered with the kv latent
    lite = dict(layer_activation_bytes(get_model("deepseek-v2-lite"), training, cfg, True))
    assert "act.mla.q_down_output" not in lite
    assert lite["act.mla.latents"] == tokens * (2048 + 512 + 64) * b
    # Megatron's up projections keep their SP-sharded input and re-gather it in backward
    regather = dict(layer_activation_bytes(model, _moe_training(sequence_parallel_regather=True), cfg, True))
    assert regather["act.mla.latents"] == got["act.mla.latents"] / 8


def _sinks(**kw):
    return ModelSpec(name="sinks", num_layers=4, hidden_size=1024, num_attention_heads=16, num_query_groups=4,
                     ffn_hidden_size=1024, vocab_size=1024, softmax_type="learnable", window_size=(128, 0),
                     window_attn_skip_freq=2, swiglu=False, quick_geglu=True, **kw)


def test_executor_sink_layers_keep_the_fp32_score_matrix_megatrons_fused_kernel_does_not():
    model = _sinks()
    executor = TrainingSpec(seq_length=4096, global_batch_size=8)
    megatron = TrainingSpec(seq_length=4096, global_batch_size=8, fused_window_sink_attention=True)
    cfg = ParallelConfig(world_size=2, tp=2)
    ex = dict(layer_activation_bytes(model, executor, cfg, False))
    mg = dict(layer_activation_bytes(model, megatron, cfg, False))
    tokens, heads, d = 4096, 16 / 2, 64
    # every layer has sinks, windowed or not: fp32 probabilities over the 4096 keys plus the sink column
    assert ex["act.attn.sink_probs"] == tokens * heads * 4097 * 4
    # fp32 q, and k, v repeated to all 16 heads, in place of the 16-bit q and the 4 kv heads' k, v
    assert ex["act.attn.sink_fp32_qkv"] == tokens * ((heads * d * 3) * 4 - (16 + 8) / 2 * d * 2)
    assert "act.attn.softmax_lse" not in ex and "act.attn.softmax_lse" in mg
    assert not any(name.startswith("act.attn.sink") for name in mg)
    # core_attn recompute drops them all
    sel = dict(layer_activation_bytes(model, executor, cfg.replace(recompute_granularity="selective",
                                                                   recompute_modules=("core_attn",)), False))
    assert not any(name.startswith("act.attn.sink") for name in sel)
    # under CP the gathered keys and values are cp times the local rows; the probabilities do not change
    cp2 = dict(layer_activation_bytes(model, executor, ParallelConfig(world_size=4, tp=2, cp=2), False))
    assert cp2["act.attn.sink_probs"] == ex["act.attn.sink_probs"] / 2
    assert cp2["act.attn.sink_fp32_qkv"] == tokens / 2 * ((heads * d * 5) * 4 - (16 + 8) / 2 * d * 2)


def test_window_only_layers_keep_a_mask_bias_on_their_share_of_layers():
    model = ModelSpec(**{**_sinks().to_dict(), "softmax_type": "vanilla"})
    training = TrainingSpec(seq_length=1024, global_batch_size=8)
    got = dict(layer_activation_bytes(model, training, ParallelConfig(world_size=1), False))
    # layers 1 and 3 (1-based) windowed: half the layers, the [s, s] bias in bf16 and k, v repeated 4 -> 16 heads
    assert got["act.attn.window_mask_bias"] == 0.5 * 1024 * 1024 * 2
    assert got["act.attn.window_repeated_kv"] == 0.5 * 1024 * 2 * 16 * 64 * 2
    assert "act.attn.softmax_lse" in got


def test_qk_layernorm_keeps_q_and_k_before_the_norm():
    qwen = get_model("qwen3-30b-a3b")
    training, cfg = _moe_training(), ParallelConfig(world_size=8, tp=4, ep=8)
    got = dict(layer_activation_bytes(qwen, training, cfg, True))
    assert got["act.attn.qk_norm_input"] == 4096 * (32 + 4) * 128 / 4 * 2


def test_gpt_oss_executor_attention_does_not_fit_where_megatrons_does():
    model = get_model("gpt-oss-120b")
    cfg = ParallelConfig(world_size=64, tp=2, pp=2, ep=16)
    executor = TrainingSpec(seq_length=4096, global_batch_size=512)
    megatron = TrainingSpec(seq_length=4096, global_batch_size=512, fused_window_sink_attention=True)
    cluster = ClusterSpec(get_hardware("h100-sxm"), 64)
    ex, mg = estimate_memory(model, executor, cluster, cfg), estimate_memory(model, megatron, cluster, cfg)
    assert mg.total < cluster.usable_hbm_bytes < ex.total
    assert ex.weights == mg.weights and ex.optimizer == mg.optimizer


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2-lite", "gpt-oss-120b", "qwen3-30b-a3b", "olmoe-1b-7b"])
def test_executor_parameter_tensors_add_up_to_the_layer_counts(name):
    """_tensor_split lists the executor's parameter tensors (MLA's projections and latent norms, biases, sinks,
    q/k norms); with an unbounded bucket its per-layer sums are the parameter counts of a dense and an MoE layer."""
    model = get_model(name)
    tp, ep = 2, 4
    dense, moe, *_ = _tensor_split(model, tp, ep, 1, float("inf"))
    attention = attention_params(model, tp).total
    if model.num_dense_layers:
        assert dense == attention + mlp_params(model, tp).total
    assert moe == attention + moe_params(model, tp, ep, 1).total
