"""Real images into the encoder's input: a still image [C, H, W] (floats, already normalised) cut into patches.

Each patch stacks ``temporal_patch_size`` copies of its pixels (a still image is a clip of identical frames) and
is flattened as (channel, frame, row, column), the order the patch embedding's Conv3d reads; patches come in
merge-window order (the ``spatial_merge_size``² patches of one window consecutive, windows row-major), as
:mod:`executor.vlm.positions` expects.
"""

from __future__ import annotations

import torch

from spec.errors import SpecError
from spec.multimodal import VisionEncoderSpec


def patchify(image_CHW: torch.Tensor, vision: VisionEncoderSpec) -> tuple[torch.Tensor, tuple[int, int]]:
    """(patches [rows·cols, patch_dim], (rows, cols)) of one image; SpecError when its sides are not multiples of
    patch_size · spatial_merge_size or its channels are not the encoder's."""
    c, height, width = image_CHW.shape
    p, m, t = vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
    if c != vision.in_channels or height % (p * m) or width % (p * m):
        raise SpecError(f"image {tuple(image_CHW.shape)}: needs {vision.in_channels} channels and sides that are "
                        f"multiples of patch_size · spatial_merge_size = {p * m} px")
    rows, cols = height // p, width // p
    frames = image_CHW.unsqueeze(0).expand(t, c, height, width)
    x = frames.reshape(t, c, rows // m, m, p, cols // m, m, p)
    # -> (window row, window column, row in window, column in window | channel, frame, pixel row, pixel column)
    x = x.permute(2, 5, 3, 6, 1, 0, 4, 7)
    return x.reshape(rows * cols, c * t * p * p).contiguous(), (rows, cols)
