"""The vision encoder's cost and the placements' effect on the step (costmodel.multimodal), by hand-worked
formulas; the planner's joint search and `foldtune plan --images-per-sample` (planner.multimodal, the CLI)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from api.cli.main import main
from costmodel.estimate import estimate
from costmodel.multimodal import (ACTIVATION_BYTES_PER_TOKEN_HIDDEN, encoder_cost, encoder_flops_per_image,
                                  encoder_params, estimate_multimodal)
from planner.multimodal import plan_multimodal
from spec.catalog import get_hardware
from spec.hardware import ClusterSpec
from spec.multimodal import ImageInputs
from spec.multimodal_layout import MultimodalLayout
from spec.training_spec import TrainingSpec
from spec.vl_catalog import get_vl_model

VL = get_vl_model("qwen3-vl-30b-a3b")
TRAINING = TrainingSpec(seq_length=8192, global_batch_size=256)
IMAGES = ImageInputs(images_per_sample=4)  # 448x448: 784 patches, 196 tokens per image
CLUSTER = ClusterSpec(get_hardware("h100-sxm"), 64)


def test_encoder_params_equal_the_executor_module():
    torch = pytest.importorskip("torch")
    from executor.vlm.vision import VisionEncoder
    vision = get_vl_model("tiny-vl-moe").vision
    module = VisionEncoder(vision, device="cpu", dtype=torch.float32)
    assert encoder_params(vision) == sum(p.numel() for p in module.parameters())


def test_encoder_flops_by_hand():
    v = get_vl_model("tiny-vl-moe").vision  # h 32, f 64, 2 layers, patch_dim 96, merge 2 (m = 128), out 64
    patches = 16
    per_layer = 2 * 16 * (4 * 32 * 32 + 2 * 32 * 64) + 4 * 16 * 16 * 32
    projectors = 2 * 2 * 4 * (128 * 128 + 128 * 64)  # main + one deepstack, 4 tokens
    assert encoder_flops_per_image(v, patches) == 3.0 * (2 * per_layer + 2 * 16 * 96 * 32 + projectors)


def _layout(label: str, world: int | None = None) -> MultimodalLayout:
    return MultimodalLayout.parse(label, world)


def test_encoder_shares_and_memory_by_hand():
    layout = _layout("tp2 ep8 dp32 placement=colocated enc_tp2 enc_dp32")
    cost = encoder_cost(VL, TRAINING, IMAGES, layout, CLUSTER, in_flight=1)
    # 256 samples x 4 images over encoder dp 32 in 256 / (1 · 32) = 8 micro-batches: 4 images each
    assert cost.images_per_microbatch == 4
    tokens = 4 * 784
    assert cost.activation_bytes == pytest.approx(27 * ACTIVATION_BYTES_PER_TOKEN_HIDDEN * tokens * 1152 / 2)
    shard = encoder_params(VL.vision) / 2
    assert cost.memory_bytes == pytest.approx(shard * 6 + shard * 12 / 32 + cost.activation_bytes)
    # each LLM rank receives its sample's 784 image tokens from 4 projectors (main + 3 deepstack), split by tp 2
    assert cost.boundary_bytes == 784 * 2048 * 2 * 4 / 2
    # encoder tp 2 halves the GEMM work per rank against tp 1 at the same images per rank
    single = encoder_cost(VL, TRAINING, IMAGES, _layout("tp2 ep8 dp32 placement=colocated enc_tp1 enc_dp32"),
                          CLUSTER, in_flight=1)
    assert single.tp_comm_s == 0 and cost.tp_comm_s > 0
    assert cost.compute_s < single.compute_s


def _priced(layout: MultimodalLayout, llm_cluster: ClusterSpec = CLUSTER):
    llm = estimate(VL.llm, TRAINING, llm_cluster, layout.llm)
    return estimate_multimodal(VL, TRAINING, IMAGES, layout, CLUSTER, llm, llm_cluster)


def test_the_encoder_pays_its_memory_bound_kernels_with_the_head_and_mlp_parts_split_over_its_tp(monkeypatch):
    import costmodel.multimodal as mm

    seen = []
    monkeypatch.setattr(mm, "memory_time", lambda rates, nbytes, kernels: seen.append((nbytes, kernels)) or 0.0)
    for label in ("tp2 ep8 dp32 placement=colocated enc_tp1 enc_dp64", "tp2 ep8 dp32 placement=colocated enc_tp2 enc_dp32"):
        encoder_cost(VL, TRAINING, IMAGES, _layout(label), CLUSTER, in_flight=1)
    # 1,024 images a step in 8 micro-batches: 2 images of 784 patches per encoder rank at enc_dp 64, 4 at 32
    e, f = 784 * 1152 * 2, 784 * 4304 * 2
    assert seen == [(2 * (65 * e + 100 * e + 6 * f), 50), (4 * (65 * e + (100 * e + 6 * f) / 2), 50)]


def test_homogeneous_pipeline_waits_for_the_encoder_on_its_first_stage():
    e = _priced(_layout("tp2 pp2 ep8 dp16"))
    microbatches = 256 // 16
    assert dict(e.terms)["encoder"] == pytest.approx((microbatches + 1) * e.encoder.microbatch_s)
    assert e.step_time == pytest.approx(sum(t for _, t in e.terms))
    assert e.memory_bytes == pytest.approx(e.llm.memory.total + e.encoder.memory_bytes)
    assert "first of 2 pipeline stages" in dict(e.reasons)["encoder"]


def test_colocated_runs_in_turn_and_pays_the_boundary():
    e = _priced(_layout("tp2 pp2 ep8 dp16 placement=colocated enc_tp1 enc_dp64"))
    terms = dict(e.terms)
    assert terms["encoder"] == pytest.approx(16 * e.encoder.microbatch_s)
    assert terms["boundary"] > 0 and set(dict(e.reasons)) >= set(terms) | {"memory"}
    # the same LLM layout, homogeneous, pays 17 micro-batches of a 2x heavier encoding (tp2 over 32 GPUs)
    assert e.step_time < _priced(_layout("tp2 pp2 ep8 dp16")).step_time


def test_separate_step_is_the_slower_pipeline_plus_the_fill():
    llm_cluster = ClusterSpec(CLUSTER.hardware, 48)
    e = _priced(_layout("tp2 pp3 ep8 dp8 placement=separate enc_dp16", 64), llm_cluster)
    terms = dict(e.terms)
    assert terms["llm"] + terms["encoder_beyond_llm"] == pytest.approx(max(e.llm.time.step_time, e.encoder.step_s))
    assert terms["boundary_fill"] > e.encoder.microbatch_s
    # the LLM's GPUs hold no encoder
    assert e.memory_bytes == pytest.approx(max(e.llm.memory.total, e.encoder.memory_bytes))


def test_planner_lists_both_kinds_and_says_why():
    result = plan_multimodal(VL, TRAINING, IMAGES, CLUSTER, top=5, llm_top=2)
    placements = {e.layout.placement for e in result.ranked}
    assert "homogeneous" in placements and placements & {"colocated", "separate"}
    assert result.ranked == sorted(result.ranked, key=lambda e: e.step_time)
    assert result.why.startswith(("heterogeneous wins", "homogeneous wins"))


def test_cli_plan_json(capsys):
    code = main(["plan", "--model", "qwen3-vl-30b-a3b", "--gpus", "64", "--gpu", "h100-sxm", "--seq", "8192",
                 "--gbs", "256", "--images-per-sample", "4", "--json", "--top", "5"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["images"]["image_tokens_per_sample"] == 784
    kinds = {e["heterogeneous"] for e in out["ranked"]}
    assert kinds == {True, False}
    for e in out["ranked"]:
        assert e["placement"] in ("homogeneous", "colocated", "separate")
        assert set(e["reasons"]) == set(e["terms_s"]) | {"memory"}


def test_cli_refuses_images_without_a_vision_model(capsys):
    code = main(["plan", "--model", "mixtral-8x7b", "--gpus", "8", "--gpu", "h100-sxm", "--seq", "4096",
                 "--gbs", "64", "--images-per-sample", "2"])
    assert code != 0 and "vision-language model" in capsys.readouterr().err


def test_cli_explains_a_multimodal_layout(capsys):
    base = ["plan", "--model", "qwen3-vl-30b-a3b", "--gpus", "64", "--gpu", "h100-sxm", "--seq", "8192", "--gbs",
            "256", "--images-per-sample", "4", "--json", "--explain"]
    assert main(base + ["tp2 ep8 dp32 placement=colocated enc_tp1 enc_dp64"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["valid"] and out["estimate"]["placement"] == "colocated"
    assert main(base + ["tp2 ep8 dp32 placement=colocated enc_tp1 enc_dp32"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert [r["rule"] for r in out["rejections"]] == ["enc_world"] and out["estimate"] is None


def test_calibration_terms_are_the_step_in_the_llm_term_names():
    """A tuning search calibrates multimodal predictions through the LLM's term table: every placement's step,
    re-spelled, sums to the same seconds and names only table terms; the encoder's compute lands in gemm."""
    from costmodel.terms import TERMS
    result = plan_multimodal(VL, TRAINING, IMAGES, CLUSTER, top=1000)
    assert {e.layout.placement for e in result.ranked} == {"homogeneous", "colocated", "separate"}
    for e in result.ranked:
        terms = dict(e.calibration_terms())
        assert set(terms) <= set(TERMS)
        assert sum(terms.values()) == pytest.approx(e.step_time, rel=1e-12)
        if e.layout.placement != "separate":  # a separate encoder may hide behind the LLM entirely
            assert terms["gemm"] > dict(e.llm.time.terms)["gemm"]  # the encoder's GEMMs joined the LLM's
