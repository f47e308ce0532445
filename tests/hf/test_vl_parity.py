"""Qwen3-VL-MoE parity (issue 39, bar 4): a tiny random transformers model, saved with save_pretrained, mapped
by spec.hf_vl_config and loaded into foldtune's vision-language model (one process), gives the same logits on
an image+text batch (two samples, two images each of different sizes, deepstack on), fp32."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spec.hf_vl_config import load_hf_vl_model
from spec.multimodal import ImageInputs
from spec.parallel_config import ParallelConfig
from spec.vl_catalog import get_vl_model
from executor.options import ExecutorOptions
from executor.parallel.groups import build_parallel_state
from executor.vlm.model import VisionLanguageMoE, VLBatch
from executor.vlm.positions import patch_rows_cols, resampled_positions
from executor.vlm.synthetic import image_token_layout, synthetic_batch
from executor.vlm.weights import load_hf_vl_weights

transformers = pytest.importorskip("transformers")

IMAGE_TOKEN, VOCAB, SEQ = 255, 256, 24
GRIDS = [(4, 4), (2, 4)]  # patch grids of a sample's two images: 4 and 2 image tokens


def _hf_model(seed: int = 0):
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                max_position_embeddings=64,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2],
                                     mrope_interleaved=True))
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, out_hidden_size=64,
                  num_position_embeddings=9, deepstack_visual_indexes=[0])
    config = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN)
    torch.manual_seed(seed)
    model = transformers.Qwen3VLMoeForConditionalGeneration(config).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # every parameter random (norms around 1); routers scaled up against near-ties
        for name, p in model.named_parameters():
            std = 0.5 if name.endswith("mlp.gate.weight") else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * std + (1.0 if "norm" in name and "weight" in name else 0.0))
    return model


def _batch() -> tuple[VLBatch, torch.Tensor]:
    """Two samples alike in layout: text, image (4 tokens), text, image (2 tokens), text; and HF's grid_thw."""
    gen = torch.Generator().manual_seed(3)
    layout = torch.tensor(image_token_layout([4, 2], SEQ))
    ids = torch.randint(0, IMAGE_TOKEN, (2, SEQ), generator=gen)
    ids[:, layout] = IMAGE_TOKEN
    grids = tuple(GRIDS * 2)
    patches = torch.randn(sum(h * w for h, w in grids), 3 * 2 * 4 * 4, generator=gen)
    thw = torch.tensor([[1, h, w] for h, w in grids])
    return VLBatch(ids, ids.roll(-1, 1), patches, grids), thw


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = _hf_model()
    directory = tmp_path_factory.mktemp("qwen3_vl_moe")
    model.save_pretrained(directory)
    return directory, model


def _foldtune(directory, **change):
    hf = load_hf_vl_model(directory)
    spec = dataclasses.replace(hf.spec, **change) if change else hf.spec
    state = build_parallel_state(ParallelConfig(1), 0)
    model = VisionLanguageMoE(spec, state, ExecutorOptions(**hf.text.executor_options()), seq_length=SEQ,
                              mrope_section=hf.mrope_section, vision_rotary_base=hf.vision_rotary_base)
    load_hf_vl_weights(model, directory, hf)
    return model


def _hf_logits(model, batch: VLBatch, thw) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=batch.ids, pixel_values=batch.patches, image_grid_thw=thw,
                    mm_token_type_ids=(batch.ids == IMAGE_TOKEN).int())
    return out.logits.float()


def test_logits_equal_transformers_on_an_image_text_batch(saved):
    directory, hf_model = saved
    batch, thw = _batch()
    reference = _hf_logits(hf_model, batch, thw)
    logits = _foldtune(directory).logits(batch)
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)


def test_the_images_matter(saved):
    """Not vacuous: other patches change the text's logits after the first image (and not before it)."""
    directory, _ = saved
    model = _foldtune(directory)
    batch, _ = _batch()
    other = dataclasses.replace(batch, patches=batch.patches + 1.0)
    a, b = model.logits(batch), model.logits(other)
    first_image = int((batch.ids[0] == IMAGE_TOKEN).nonzero()[0])
    torch.testing.assert_close(a[:, :first_image], b[:, :first_image])
    assert (a[:, first_image:] - b[:, first_image:]).abs().max() > 1e-3


def test_resampled_positions_follow_the_merge_window_order():
    table = torch.arange(9.0).reshape(9, 1)  # a 3x3 grid holding its own flat index
    out = resampled_positions(table, 2, 2, 2)[:, 0]  # corners aligned: the grid's four corners
    assert out.tolist() == [0.0, 2.0, 6.0, 8.0]
    rows, cols = patch_rows_cols(2, 4, 2)
    assert list(zip(rows.tolist(), cols.tolist()))[:6] == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3)]


def test_synthetic_batch_trains_a_step():
    """A synthetic batch of the catalog's tiny-vl-moe runs forward and backward through encoder and LLM."""
    spec = get_vl_model("tiny-vl-moe")
    images = ImageInputs(images_per_sample=2, image_height=8, image_width=16)
    state = build_parallel_state(ParallelConfig(1), 0)
    torch.manual_seed(0)
    model = VisionLanguageMoE(spec, state, ExecutorOptions(), seq_length=32, mrope_section=(4, 2, 2))
    batch = synthetic_batch(spec, images, 32, 2, torch.Generator().manual_seed(0))
    assert int((batch.ids == spec.image_token_id).sum()) == 2 * images.image_tokens_per_sample(spec.vision)
    model(batch).loss.backward()
    assert model.encoder.patch_embed.weight.grad.abs().sum() > 0
    assert model.encoder.deepstack[0].fc2.weight.grad.abs().sum() > 0
