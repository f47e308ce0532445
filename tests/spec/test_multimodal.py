"""Vision-language MoE models: the encoder spec, image inputs, the catalog, and the Qwen3-VL-MoE config mapping."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest

from spec.errors import CatalogError, SpecError
from spec.hf_vl_config import load_hf_vl_model, vl_model_from_hf_config
from spec.multimodal import ImageInputs, VisionEncoderSpec, VisionLanguageSpec
from spec.vl_catalog import get_vl_model, is_vl_model, vl_model_names

CONFIG = Path(__file__).parent / "hf_vl_configs" / "qwen3-vl-30b-a3b"


def _published() -> dict:
    """Qwen3-VL-30B-A3B's config.json as transcribed into the repository (this machine cannot reach the Hub, so it
    was not downloaded and is not checked against the Hub's file): its text_config has the dimensions of the
    catalog's qwen3-30b-a3b; transformers' own Qwen3VLMoeConfig defaults describe another size."""
    return json.loads((CONFIG / "config.json").read_text())


def test_image_tokens_follow_the_patch_grid_and_the_merge():
    vision = get_vl_model("qwen3-vl-30b-a3b").vision
    images = ImageInputs(images_per_sample=4, image_height=448, image_width=640)
    # 448/16 = 28 rows, 640/16 = 40 columns: 1120 patches, merged 2x2 into 280 tokens per image
    assert images.grid(vision) == (28, 40)
    assert images.patches_per_image(vision) == 1120
    assert images.tokens_per_image(vision) == 280
    assert images.image_tokens_per_sample(vision) == 1120
    assert vision.patch_dim == 3 * 2 * 16 * 16
    assert vision.merged_hidden_size == 1152 * 4
    images.check_fits(vision, 8192)
    with pytest.raises(SpecError, match="not fewer than the sequence length 1120"):
        images.check_fits(vision, 1120)


def test_image_sides_must_hold_whole_merge_windows():
    vision = get_vl_model("qwen3-vl-30b-a3b").vision
    with pytest.raises(SpecError, match="multiple of patch_size · spatial_merge_size = 32 px"):
        ImageInputs(1, 448, 450).grid(vision)
    with pytest.raises(SpecError, match="images_per_sample must be a positive integer"):
        ImageInputs(0)


def test_encoder_rules_name_the_field():
    with pytest.raises(SpecError, match="divisible by num_attention_heads"):
        VisionEncoderSpec(num_layers=2, hidden_size=30, num_attention_heads=4, ffn_hidden_size=8, out_hidden_size=8)
    with pytest.raises(SpecError, match="must be a square"):
        VisionEncoderSpec(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=8, out_hidden_size=8,
                          num_position_embeddings=10)
    with pytest.raises(SpecError, match=r"deepstack_layers \(2,\) must be encoder layers in \[0, 2\)"):
        VisionEncoderSpec(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=8, out_hidden_size=8,
                          deepstack_layers=(2,))


def test_projector_width_must_be_the_llm_hidden_size():
    vl = get_vl_model("tiny-vl-moe")
    with pytest.raises(SpecError, match=r"out_hidden_size \(32\) must equal the LLM's hidden_size \(64\)"):
        VisionLanguageSpec("x", replace(vl.vision, out_hidden_size=32), vl.llm)


def test_composition_with_any_catalog_moe_llm():
    vl = get_vl_model("qwen3-vit+mixtral-8x7b")
    assert vl.llm.name == "mixtral-8x7b" and vl.vision.out_hidden_size == 4096
    assert vl.vision.num_layers == 27 and is_vl_model("qwen3-vit+mixtral-8x7b")
    assert {"qwen3-vl-30b-a3b", "qwen3-vl-235b-a22b", "tiny-vl-moe"} <= set(vl_model_names())
    with pytest.raises(CatalogError, match="unknown vision encoder 'qwen3-vt'"):
        get_vl_model("qwen3-vt+mixtral-8x7b")
    with pytest.raises(CatalogError, match="unknown vision-language model"):
        get_vl_model("qwen3-vl-30b")


def test_round_trip_through_dicts():
    vl = get_vl_model("qwen3-vl-235b-a22b")
    assert VisionLanguageSpec.from_dict(json.loads(json.dumps(vl.to_dict()))) == vl
    with pytest.raises(SpecError, match="unknown vision encoder field"):
        VisionEncoderSpec.from_dict({**vl.vision.to_dict(), "depth": 3})


def test_published_config_maps_to_the_catalog_entry():
    mapped = load_hf_vl_model(CONFIG)
    catalog = get_vl_model("qwen3-vl-30b-a3b")
    assert mapped.spec.vision == catalog.vision
    assert replace(mapped.spec.llm, name=catalog.llm.name) == catalog.llm
    assert mapped.spec.image_token_id == 151655
    assert mapped.mrope_section == (24, 20, 20)
    assert mapped.text.rotary_base == 5_000_000 and mapped.executor_issues == ()
    # the router renormalises its top-k: the executor's default, not pre-softmax
    assert not mapped.spec.llm.moe_router_pre_softmax


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["vision_config"].update(window_size=112), "vision_config.window_size"),
    (lambda c: c.update(fancy=1), "not understood by the qwen3_vl_moe mapping: fancy"),
    (lambda c: c["vision_config"].update(hidden_act="relu"), "vision_config.hidden_act"),
    (lambda c: c["text_config"]["rope_scaling"].update(mrope_interleaved=False), "mrope_interleaved"),
    (lambda c: c["text_config"].update(norm_topk_prob=False), "norm_topk_prob"),
    (lambda c: c["vision_config"].update(out_hidden_size=1024), "must equal the LLM's hidden_size"),
    (lambda c: c["text_config"].update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c.update(model_type="qwen2_vl"), "not a vision-language family"),
])
def test_unsupported_fields_are_named(edit, message):
    config = copy.deepcopy(_published())
    edit(config)
    with pytest.raises(SpecError, match=message):
        vl_model_from_hf_config(config, "x")
