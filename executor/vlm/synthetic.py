"""Synthetic image+text micro-batches for profiling: random patches, random text, the images' tokens placed
alike in every sample (evenly spread over the sequence, text between and after them)."""

from __future__ import annotations

import torch

from spec.multimodal import ImageInputs, VisionLanguageSpec
from executor.vlm.model import VLBatch


def image_token_layout(tokens_per_image: list[int], seq_length: int) -> list[bool]:
    """Per position, whether it is an image token: image i starts after an equal share of the text."""
    text = seq_length - sum(tokens_per_image)
    if text < 1:
        raise ValueError(f"{sum(tokens_per_image)} image tokens leave no text in {seq_length} positions")
    gap = text // (len(tokens_per_image) + 1)
    layout: list[bool] = []
    for count in tokens_per_image:
        layout += [False] * gap + [True] * count
    return layout + [False] * (seq_length - len(layout))


def synthetic_batch(spec: VisionLanguageSpec, images: ImageInputs, seq_length: int, micro_batch_size: int,
                    generator: torch.Generator | None = None, device="cpu") -> VLBatch:
    """A micro-batch of ``micro_batch_size`` samples of ``seq_length`` tokens, each with the images of
    ``images``: text ids uniform over the vocabulary but the image token, labels the next token (the last one
    wraps), patches standard normal."""
    vision, vocab = spec.vision, spec.llm.vocab_size
    images.check_fits(vision, seq_length)
    rows, cols = images.grid(vision)
    layout = torch.tensor(image_token_layout([images.tokens_per_image(vision)] * images.images_per_sample,
                                             seq_length))
    ids = torch.randint(0, vocab - 1, (micro_batch_size, seq_length), generator=generator)
    ids = torch.where(ids >= spec.image_token_id, ids + 1, ids)  # text never draws the image token
    ids[:, layout] = spec.image_token_id
    count = micro_batch_size * images.images_per_sample
    patches = torch.randn(count * rows * cols, vision.patch_dim, generator=generator)
    return VLBatch(ids.to(device), ids.roll(-1, dims=1).to(device), patches.to(device), ((rows, cols),) * count, ids)
