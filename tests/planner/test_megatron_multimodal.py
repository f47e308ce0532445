"""Megatron-LM arguments of multimodal layouts: what Megatron Core's encoder parallelism expresses, and a
refusal naming what it lacks for the rest."""

from __future__ import annotations

import pytest

from planner.megatron_args import megatron_args
from planner.megatron_multimodal import megatron_multimodal_args, megatron_multimodal_refusal
from spec.errors import SpecError
from spec.multimodal import ImageInputs
from spec.multimodal_layout import MultimodalLayout
from spec.training_spec import TrainingSpec
from spec.vl_catalog import get_vl_model

VL = get_vl_model("qwen3-vl-30b-a3b")
TRAINING = TrainingSpec(seq_length=8192, global_batch_size=256)
IMAGES = ImageInputs(images_per_sample=4)


def _args(label: str, world: int) -> dict[str, list[str]]:
    layout = MultimodalLayout.parse(label, world)
    return {f[0]: f[1:] for f in megatron_multimodal_args(layout, VL, TRAINING, IMAGES)}


def test_homogeneous_is_the_llms_arguments_and_the_images():
    layout = MultimodalLayout.parse("tp2 ep8 dp32", 64)
    args = _args("tp2 ep8 dp32", 64)
    assert all(args[f[0]] == f[1:] for f in megatron_args(layout.llm, VL.llm, TRAINING))
    assert "--encoder-pipeline-model-parallel-size" not in args
    assert args["--img-h"] == ["448"] and args["--patch-dim"] == ["16"] and args["--num-channels"] == ["3"]


def test_separate_gives_the_encoder_its_stages_and_tensor_parallel_size():
    # 28 LLM GPUs (tp 4 · dp 7), 14 encoder GPUs (tp 2 · dp 7): Megatron's encoder dp is the LLM's
    args = _args("tp4 ep4 dp7 placement=separate enc_tp2 enc_pp1 enc_dp7", 42)
    assert args["--encoder-pipeline-model-parallel-size"] == ["1"]
    assert args["--encoder-tensor-model-parallel-size"] == ["2"]


@pytest.mark.parametrize("label, world, lacks", [
    ("tp2 ep8 dp32 placement=colocated enc_tp1", 64, "no colocated encoder"),
    ("tp2 pp2 ep8 dp16", 64, "shares a pipeline stage"),
    ("tp2 ep8 dp28 placement=separate enc_tp1 enc_dp8", 64, "one data-parallel size"),
    ("tp1 ep8 dp32 placement=separate enc_tp2 enc_dp16", 64, "may not exceed"),
])
def test_layouts_megatron_cannot_express_are_refused_by_name(label, world, lacks):
    layout = MultimodalLayout.parse(label, world)
    assert lacks in megatron_multimodal_refusal(layout)
    with pytest.raises(SpecError, match=lacks):
        megatron_multimodal_args(layout, VL, TRAINING, IMAGES)
