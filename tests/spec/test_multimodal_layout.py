"""Multimodal layouts: one label syntax (the LLM's label + placement + encoder tokens), JSON, and the rule book's
named reasons for encoder layouts and placements."""

from __future__ import annotations

import pytest

from spec.catalog import get_hardware
from spec.errors import InvalidConfigError, SpecError
from spec.hardware import ClusterSpec
from spec.multimodal import ImageInputs
from spec.multimodal_layout import MultimodalLayout
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec
from spec.validity import MULTIMODAL_RULES, check_multimodal
from spec.vl_catalog import get_vl_model

VL = get_vl_model("qwen3-vl-30b-a3b")
TRAINING = TrainingSpec(seq_length=8192, global_batch_size=256)
IMAGES = ImageInputs(images_per_sample=4, image_height=448, image_width=448)
CLUSTER = ClusterSpec(get_hardware("h100-sxm"), 64)


def _rules(layout: MultimodalLayout, images: ImageInputs = IMAGES) -> set[str]:
    return {r.rule for r in check_multimodal(VL, TRAINING, images, layout, CLUSTER)}


@pytest.mark.parametrize("label, world", [
    ("tp2 cp1 pp1 vpp1 ep8 etp1 dp32 edp8 mbs1 placement=colocated enc_tp1 enc_cp1 enc_pp1 enc_dp64", None),
    ("tp2 cp2 pp2 vpp1 ep8 etp1 dp8 edp4 mbs1 placement=homogeneous", None),
    ("tp2 cp1 pp1 vpp1 ep8 etp1 dp24 edp6 mbs1 placement=separate enc_tp2 enc_cp1 enc_pp1 enc_dp8", 64),
])
def test_label_round_trips(label, world):
    layout = MultimodalLayout.parse(label, world)
    assert layout.label() == label
    assert MultimodalLayout.parse(layout.label(), layout.world_size) == layout
    assert MultimodalLayout.from_dict(layout.to_dict()) == layout


def test_a_plain_llm_label_is_the_homogeneous_layout():
    layout = MultimodalLayout.parse("tp4 pp2 ep8 dp8")
    assert layout == MultimodalLayout.homogeneous(ParallelConfig(64, tp=4, pp=2, ep=8))
    assert layout.encoder_sizes == (4, 1, 1, 8) and not layout.is_heterogeneous
    # colocated without enc_dp: the encoder spans the LLM's world
    assert MultimodalLayout.parse("tp4 pp2 ep8 dp8 enc_tp2").encoder_dp == 32


def test_separate_placement_adds_the_encoder_gpus():
    layout = MultimodalLayout.parse("tp2 ep8 dp24 placement=separate enc_dp16", 64)
    assert layout.llm.world_size == 48 and layout.encoder_world == 16 and layout.world_size == 64


@pytest.mark.parametrize("label, message", [
    ("tp2 dp32 placement=sideways", "placement 'sideways'"),
    ("tp2 dp32 enc_tpx", "cannot parse encoder token 'enc_tpx'"),
    ("tp2 dp32 placement=homogeneous enc_tp1", "homogeneous layout's encoder inherits"),
    ("tp2 dp32 placement=separate enc_tp2", "separate encoder needs enc_dp"),
    ("tp2 dp32 enc_tp3", "does not divide the LLM's 64 GPUs"),
])
def test_malformed_labels_are_named(label, message):
    with pytest.raises(InvalidConfigError, match=message):
        MultimodalLayout.parse(label)


def test_homogeneous_sizes_must_be_inherited():
    with pytest.raises(SpecError, match="inherits"):
        MultimodalLayout(ParallelConfig(64, tp=2), "homogeneous", encoder_tp=1, encoder_dp=64)


def test_valid_layouts_break_no_rule():
    assert _rules(MultimodalLayout.parse("tp2 ep8 dp32 placement=colocated enc_tp1 enc_dp64")) == set()
    assert _rules(MultimodalLayout.parse("tp2 pp3 ep8 dp8 placement=separate enc_dp16", 64)) == set()
    assert _rules(MultimodalLayout.parse("tp2 ep8 dp32")) == set()


@pytest.mark.parametrize("label, world, rule", [
    # 16 vision heads over encoder tp 32 (a homogeneous encoder inherits the LLM's tp too)
    ("tp1 ep8 dp2 placement=colocated enc_tp32 enc_dp2", None, "enc_heads_tp"),
    ("tp2 ep8 dp32 placement=colocated enc_tp1 enc_dp32", None, "enc_world"),
    ("tp2 ep8 dp32 placement=colocated enc_tp1 enc_cp3 enc_dp21", None, "enc_world"),
    ("tp2 ep8 dp32 placement=colocated enc_pp32 enc_dp2", None, "enc_layers_pp"),
    ("tp2 ep8 dp32 placement=separate enc_dp16", None, "mm_world"),
    ("tp2 ep8 dp24 placement=separate enc_tp2 enc_dp5", 58, "enc_images_dp"),
    ("tp2 ep8 dp28 placement=separate enc_dp8", 64, "enc_separate_dp"),
])
def test_broken_rules_are_named(label, world, rule):
    layout = MultimodalLayout.parse(label, world)
    assert rule in _rules(layout) and rule in MULTIMODAL_RULES


def test_image_rules():
    layout = MultimodalLayout.parse("tp2 ep8 dp32 placement=colocated enc_cp3 enc_dp21 enc_tp1", None)
    # 784 patches per 448x448 image do not split over cp 3
    assert "enc_cp_patches" in _rules(layout)
    many = ImageInputs(images_per_sample=64, image_height=448, image_width=448)  # 64·196 tokens > 8192
    assert "image_tokens_seq" in _rules(MultimodalLayout.parse("tp2 ep8 dp32"), many)


def test_the_llm_rules_still_apply():
    # 32 LLM heads over tp 64: the LLM part answers to the LLM's rule book
    assert "heads_tp" in _rules(MultimodalLayout.parse("tp64 ep8 dp1 placement=colocated enc_dp64"))
