"""Published layouts that ran on 80 GB H100s fit under ``foldtune plan --explain`` with their recipes' knobs, and
each Megatron-Core accounting switch does what it names, against hand-worked bytes.

The runs and their sources are costmodel/published_runs.py. "Fits" is plan's own verdict: the predicted peak of
the most loaded GPU within the GPU's memory less the CUDA/NCCL reserve (1.5 GiB) and the default headroom kept
free (5 %, 4 GiB on an 80 GiB H100).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from api.cli.main import main
from costmodel.fp8_storage import TE_SAVED_INPUT_BYTES, TE_WEIGHT_BYTES
from costmodel.loss import loss_memory_terms
from costmodel.memory import estimate_memory, estimate_stage_memory, expert_weight_grad_bytes, layer_activation_bytes
from costmodel.published_runs import MEMORY_RUNS, closing_factors, implied_step_seconds, published_run
from spec.catalog import get_hardware, get_model
from spec.hardware import GIB, ClusterSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

QWEN3 = get_model("qwen3-30b-a3b")  # hidden 2048, 32 heads of 128, 4 KV groups, 128 experts of 768, top-8
DSV3 = get_model("deepseek-v3")
H100 = ClusterSpec(get_hardware("h100-sxm"), 16)
SEQ = 4096

# TrainingSpec field -> the `foldtune plan` flag that sets it (switches: the flag alone)
_FLAGS = {"precision": "--precision", "fp8_recipe": "--fp8-recipe",
          "cross_entropy_fusion_impl": "--cross-entropy-fusion-impl"}
_SWITCHES = {"transformer_engine_fp8": "--transformer-engine-fp8", "fp8_param_gather": "--fp8-param-gather",
             "megatron_memory": "--megatron-memory", "megatron_cross_entropy": "--megatron-cross-entropy",
             "gradient_accumulation_fusion": "--gradient-accumulation-fusion",
             "sequence_parallel_regather": "--sequence-parallel-regather"}


def plan_argv(run) -> list[str]:
    """``foldtune plan --explain`` of a published run with its recipe's flags (the optimizer state's dtypes are
    tokens of the layout's label)."""
    fields = dict(run.training)
    _, _, _, config = run.specs()
    argv = ["plan", "--model", run.model, "--gpus", str(run.gpus), "--gpu", run.gpu, "--seq",
            str(fields.pop("seq_length")), "--gbs", str(fields.pop("global_batch_size")), "--json",
            "--explain", config.label()]
    if not fields.pop("main_grads_fp32", True):
        argv.append("--grad-reduce-in-bf16")
    for name, value in fields.items():
        argv += [_SWITCHES[name]] if name in _SWITCHES else [_FLAGS[name], str(value)]
    return argv


@pytest.mark.parametrize("key", [run.key for run in MEMORY_RUNS])
def test_the_published_layout_fits_under_plan_explain(key, capsys):
    run = published_run(key)
    code = main(plan_argv(run))
    out = json.loads(capsys.readouterr().out)
    assert out["valid"] and out["rejections"] == [], out["rejections"]
    assert out["estimate"]["fits"] and code == 0
    usable = out["usable_hbm_bytes"]  # 80 GiB less the 1.5 GiB reserve and the 4 GiB kept free
    assert usable == pytest.approx(80 * GIB - 1.5 * GIB - 0.05 * 80 * GIB)
    total = out["estimate"]["memory_bytes"]["total"]
    assert 0.5 * usable < total < usable  # a real fit, not a term gone missing


def test_the_runs_did_not_fit_under_the_executors_accounting():
    """The switches are what makes them fit: priced as foldtune's executor keeps its tensors (no Megatron
    switches, fp32 main grads), each layout is over the 80 GiB."""
    for run in MEMORY_RUNS[:5]:
        model, training, cluster, config = run.specs()
        executor = TrainingSpec(seq_length=training.seq_length, global_batch_size=training.global_batch_size,
                                precision=training.precision)
        assert estimate_memory(model, executor, cluster, config).total > cluster.usable_hbm_bytes, run.key


def _tensors(training: TrainingSpec, model=QWEN3, is_moe=True, **layout) -> dict[str, float]:
    config = ParallelConfig(world_size=16, **{"ep": 8, **layout})
    return dict(layer_activation_bytes(model, training, config, is_moe))


def test_megatron_moe_dispatcher_keeps_row_maps_not_the_unpermute_input():
    """Qwen3-30B-A3B, tp1 ep8, one micro-batch of 4096 tokens: 8 routed copies per token."""
    executor = _tensors(TrainingSpec(SEQ, 64))
    megatron = _tensors(TrainingSpec(SEQ, 64, megatron_memory=True))
    assert executor["act.moe.unpermute_input"] == 8 * 2048 * 2 * SEQ  # k · h · 2 bytes per token
    assert executor["act.moe.dispatch_indices"] == 2 * 8 * 8 * SEQ
    assert executor["act.moe.reorder_indices"] == 2 * 8 * 8 * SEQ
    assert not {"act.moe.unpermute_input", "act.moe.dispatch_indices", "act.moe.reorder_indices"} & set(megatron)
    assert megatron["act.moe.permute_row_map"] == (2 * 128 + 1) * 4 * SEQ  # int32 [tokens, 2E + 1]
    assert megatron["act.moe.sort_chunks_row_map"] == 4 * 8 * SEQ  # int32 per received copy
    assert {k: v for k, v in megatron.items() if not k.endswith("row_map")} == {
        k: v for k, v in executor.items() if k not in ("act.moe.unpermute_input", "act.moe.dispatch_indices",
                                                       "act.moe.reorder_indices")}
    # without EP there is no chunk sort
    assert "act.moe.sort_chunks_row_map" not in _tensors(TrainingSpec(SEQ, 64, megatron_memory=True), ep=1)


def test_transformer_engine_fp8_saves_gemm_inputs_in_one_byte_per_recipe():
    bf16 = _tensors(TrainingSpec(SEQ, 64, precision="fp8"))  # the executor's fp8 keeps 16-bit inputs
    te = _tensors(TrainingSpec(SEQ, 64, precision="fp8", transformer_engine_fp8=True))
    mx = _tensors(TrainingSpec(SEQ, 64, precision="fp8", transformer_engine_fp8=True, fp8_recipe="mxfp8"))
    routed = 8 * SEQ
    assert bf16["act.moe.permuted_tokens"] == routed * 2048 * 2
    assert te["act.moe.permuted_tokens"] == routed * 2048 * 1
    assert mx["act.moe.permuted_tokens"] == routed * 2048 * (1 + 1 / 32)  # one E8M0 scale per 32 elements
    assert te["act.moe.expert_act_output"] == routed * 768 * 1
    assert te["act.moe.expert_fc1_output"] == bf16["act.moe.expert_fc1_output"] == routed * 2 * 768 * 2  # swiglu's
    assert te["act.attn.norm_output"] == 2048 * 1 * SEQ  # the fused LayerNormLinear's fp8 ln_out
    assert te["act.attn.proj_input"] == bf16["act.attn.proj_input"] == 32 * 128 * 2 * SEQ  # the core's output
    delayed = _tensors(TrainingSpec(SEQ, 64, precision="fp8", transformer_engine_fp8=True, fp8_recipe="delayed"))
    assert delayed["act.attn.proj_input_fp8"] == 32 * 128 * 1 * SEQ  # linear_proj's own copy under delayed scaling
    # layernorm / moe_act recompute drop the saved copies as they drop the 16-bit tensors
    dropped = _tensors(TrainingSpec(SEQ, 64, precision="fp8", transformer_engine_fp8=True),
                       recompute_granularity="selective", recompute_modules=("layernorm", "moe_act"))
    assert not {"act.attn.norm_output", "act.moe.expert_act_output"} & set(dropped)


def test_mla_keeps_two_fp8_norm_outputs_and_one_attention_output_in_megatron():
    fp8 = TrainingSpec(SEQ, 64, precision="fp8", transformer_engine_fp8=True, megatron_memory=True)
    executor = _tensors(TrainingSpec(SEQ, 64), model=DSV3, ep=1)
    megatron = _tensors(fp8, model=DSV3, ep=1)
    assert megatron["act.attn.norm_output"] == 2 * 7168 * 1 * SEQ  # q_down and kv_down each keep an fp8 copy
    assert "act.mla.core_output" in executor and "act.mla.core_output" not in megatron
    # q and k of 192 per head, v of 128 contiguous; the executor also keeps the kv up projection's key half
    assert megatron["act.attn.qkv"] == 128 * (2 * 192 + 128) * 2 * SEQ
    assert executor["act.attn.qkv"] == 128 * (2 * 192 + 128 + 128) * 2 * SEQ
    # the shared expert's fc1 keeps its own fp8 copy of the normed input beside the router's 16-bit one
    assert megatron["act.shared.fc1_input_fp8"] == 7168 * 1 * SEQ


def test_distributed_optimizer_shards_are_views_and_the_step_copies_16_bit_grads():
    """Qwen3-30B-A3B tp1 pp2 ep8 on 16 GPUs: DP 8 for the dense parameters, EDP 1 for the experts."""
    config = ParallelConfig(world_size=16, pp=2, ep=8)
    base = dict(seq_length=SEQ, global_batch_size=64)
    ours = estimate_stage_memory(QWEN3, TrainingSpec(**base), H100, config, 0)
    theirs = estimate_stage_memory(QWEN3, TrainingSpec(**base, megatron_memory=True), H100, config, 0)
    dense = ours.detail("grads.dense") / 4  # elements
    assert ours.detail("optimizer.reduced_grad_shards") == pytest.approx(4 * dense / 8)  # the executor keeps it
    assert theirs.detail("optimizer.reduced_grad_shards") == 0.0
    assert theirs.optimizer == pytest.approx(ours.optimizer - 4 * dense / 8)
    # bf16 grads: the step hands Adam fp32 copies of the shards (4 bytes per shard element). It comes after the
    # backward, so with short sequences (activations far below it) it is the peak: static + copies + workspaces
    short = dict(seq_length=128, global_batch_size=64, megatron_memory=True)
    fp32 = estimate_stage_memory(QWEN3, TrainingSpec(**short), H100, config, 0)
    bf16 = estimate_stage_memory(QWEN3, TrainingSpec(**short, main_grads_fp32=False), H100, config, 0)
    assert bf16.grads == pytest.approx(fp32.grads / 2)
    expert = ours.detail("grads.expert") / 4
    copies = 4 * (dense / 8 + expert / 1)
    static = bf16.weights + bf16.grads + bf16.optimizer
    assert bf16.total == pytest.approx(static + copies + bf16.detail("allocator.cublas_workspace"))
    assert fp32.detail("allocator.grad_reduce_peak_excess") == 0.0  # fp32 grads: the shards are views


def test_bf16_moments_and_fp8_primary_weights():
    config = ParallelConfig(world_size=16, pp=2, ep=8)
    fp8 = dict(seq_length=SEQ, global_batch_size=64, precision="fp8", transformer_engine_fp8=True,
               megatron_memory=True)
    plain = estimate_stage_memory(QWEN3, TrainingSpec(**fp8), H100, config, 0)
    lean = estimate_stage_memory(QWEN3, TrainingSpec(**fp8, fp8_param_gather=True), H100,
                                 replace(config, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"), 0)
    assert lean.optimizer == pytest.approx(plain.optimizer * (4 + 2 + 2) / (4 + 4 + 4))
    gemm = plain.detail("weights.fp8_copies") / TE_WEIGHT_BYTES["tensorwise"]
    assert gemm > 0 and lean.detail("weights.fp8_copies") == 0.0  # both fp8 forms replace the 16-bit copy
    assert lean.weights == pytest.approx(plain.weights - 2 * gemm)
    blockwise = estimate_stage_memory(QWEN3, TrainingSpec(**{**fp8, "fp8_recipe": "blockwise"},
                                                          fp8_param_gather=True), H100, config, 0)
    assert blockwise.detail("weights.fp8_copies") == pytest.approx(gemm * (TE_WEIGHT_BYTES["blockwise"] - 2))
    assert TE_SAVED_INPUT_BYTES["blockwise"] == 1 + 4 / 128  # an fp32 scale per 1x128 tile


def test_megatron_losses_and_fused_weight_gradient_accumulation():
    native = TrainingSpec(SEQ, 64, megatron_cross_entropy=True)
    te = replace(native, cross_entropy_fusion_impl="te")
    vocab = QWEN3.padded_vocab_size(1)
    assert loss_memory_terms(QWEN3, native, 1) == (vocab * (4 + 2), None)  # fp32 softmax + the 16-bit logits
    assert loss_memory_terms(QWEN3, te, 1) == (vocab * 2, None)  # TE's kernel writes the gradient over the logits
    mtp = loss_memory_terms(DSV3, te, 2)[0]
    assert mtp == DSV3.padded_vocab_size(2) // 2 * 2 * 2  # main head and the MTP head keep their logits
    assert expert_weight_grad_bytes(QWEN3, TrainingSpec(SEQ, 64), 8, 1) > 0
    assert expert_weight_grad_bytes(QWEN3, TrainingSpec(SEQ, 64, gradient_accumulation_fusion=True), 8, 1) == 0


def test_implied_step_and_closing_factors_hand_worked():
    """A run published at 500 TFLOP/s predicted at 600 in 10 s implies 12 s; closing the 2 s on a 4 s term takes
    ×1.5, on a 1 s term ×3; a prediction 3 s too slow cannot be closed on a 2 s term."""
    run = published_run("deepseek-v3-h100-fp8")
    assert run.figure("tflops_per_gpu") == 338.0
    assert implied_step_seconds(run, 338.0 * 1.2, 0.0, 10.0) == pytest.approx(12.0)
    mixtral = published_run("mixtral-8x22b-h100")
    assert implied_step_seconds(mixtral, 0.0, 0.493 / 2, 8.0) == pytest.approx(4.0)
    assert closing_factors((("gemm", 4.0), ("ep_a2a", 1.0), ("pp_bubble", 0.0)), 10.0, 12.0) == (
        ("gemm", 4.0, 1.5), ("ep_a2a", 1.0, 3.0))
    assert closing_factors((("gemm", 2.0), ("grouped_gemm", 5.0)), 10.0, 7.0) == (
        ("gemm", 2.0, None), ("grouped_gemm", 5.0, 0.4))
