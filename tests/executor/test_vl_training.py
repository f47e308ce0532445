"""The real image path: images cut into patches as transformers' Qwen2-VL image processor cuts them, and a
vision-language MoE model that learns, in 50 CPU steps, to name the colour of the image it is shown (a small
image set made here: four colours with pixel noise)."""

from __future__ import annotations

import pytest
import torch

from spec.parallel_config import ParallelConfig
from spec.vl_catalog import get_vl_model
from executor.options import ExecutorOptions
from executor.parallel.groups import build_parallel_state
from executor.vlm.images import patchify
from executor.vlm.model import VisionLanguageMoE, VLBatch

SPEC = get_vl_model("tiny-vl-moe")
COLOURS = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
ANSWER = 10  # token of colour k: ANSWER + k
SEQ = 16


def test_patches_follow_the_qwen_image_processor():
    np = pytest.importorskip("numpy")
    processing = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    image = (np.random.default_rng(0).random((16, 32, 3)) * 255).astype(np.uint8)
    processor = processing.Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                                    do_resize=False, do_rescale=False, do_normalize=False)
    reference = processor(images=[image], return_tensors="pt")
    patches, grid = patchify(torch.from_numpy(image).permute(2, 0, 1).float(), SPEC.vision)
    assert [1, *grid] == reference["image_grid_thw"][0].tolist()
    torch.testing.assert_close(patches, reference["pixel_values"].float())


def _batch(colours: torch.Tensor, gen: torch.Generator) -> VLBatch:
    """Each sample: BOS, the image's 4 tokens, a question token, then the colour's answer token to the end (a
    caption naming the colour); labels are the next tokens (the answer is first predicted at the question)."""
    images = []
    for k in colours.tolist():
        pixels = COLOURS[k][:, None, None] + 0.3 * torch.randn(3, 16, 16, generator=gen)
        images.append(patchify(pixels, SPEC.vision))
    b = colours.numel()
    ids = (ANSWER + colours)[:, None].repeat(1, SEQ)
    ids[:, 0], ids[:, 1:5], ids[:, 5] = 1, SPEC.image_token_id, 2
    labels = ids.roll(-1, dims=1)
    return VLBatch(ids, labels, torch.cat([p for p, _ in images]), tuple(g for _, g in images))


def test_fifty_steps_learn_the_colour_of_the_image():
    torch.manual_seed(0)
    model = VisionLanguageMoE(SPEC, build_parallel_state(ParallelConfig(1), 0), ExecutorOptions(), seq_length=SEQ,
                              mrope_section=(4, 2, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(50):
        batch = _batch(torch.randint(0, 4, (8,), generator=gen), gen)
        optimizer.zero_grad()
        out = model(batch)
        out.loss.backward()
        optimizer.step()
        losses.append(float(out.ce))
    held_out = _batch(torch.arange(4).repeat(4), gen)  # fresh noise, every colour four times
    predicted = model.logits(held_out)[:, 5].argmax(-1)
    accuracy = float((predicted == ANSWER + torch.arange(4).repeat(4)).float().mean())
    assert losses[-1] < 0.5 * losses[0]
    assert accuracy == 1.0  # chance is 1/4: the answer depends on the image alone
