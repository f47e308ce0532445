"""Where each patch and each token sits: the encoder's patch grid order, its 2-D rotary tables and learned
position resampling, and the LLM's multimodal (temporal, height, width) rotary positions.

Patch order (what an image processor emits and :mod:`executor.vlm.synthetic` makes): per image, the
``spatial_merge_size``² patches of one merge window are consecutive, windows in row-major order, so that the
projector merges ``m²`` consecutive patch vectors into one LLM token. Images are still (one temporal patch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spec.multimodal import VisionEncoderSpec


def patch_rows_cols(rows: int, cols: int, merge: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) [rows·cols] of each patch of a ``rows`` × ``cols`` patch grid in merge-window order."""
    r, c = torch.meshgrid(torch.arange(rows, device=device), torch.arange(cols, device=device), indexing="ij")
    shape = (rows // merge, merge, cols // merge, merge)
    return r.reshape(shape).transpose(1, 2).flatten(), c.reshape(shape).transpose(1, 2).flatten()


def vision_rope(vision: VisionEncoderSpec, grids: list[tuple[int, int]], base: float,
                device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [patches of all images, head_dim] (fp32) of the encoder's 2-D RoPE: the first half of each
    rotated half carries the patch's row, the second its column (frequencies over head_dim / 2)."""
    spatial = vision.head_dim // 2
    inv_freq = 1.0 / (base ** (torch.arange(0, spatial, 2, device=device, dtype=torch.float32) / spatial))
    rows, cols = zip(*(patch_rows_cols(h, w, vision.spatial_merge_size, device) for h, w in grids))
    angles = torch.cat([torch.cat(rows)[:, None].float() * inv_freq, torch.cat(cols)[:, None].float() * inv_freq], -1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def resampled_positions(table: torch.Tensor, rows: int, cols: int, merge: int) -> torch.Tensor:
    """The learned square position grid ``table`` [side², h] resampled bilinearly (corners aligned) to a
    ``rows`` × ``cols`` patch grid, in merge-window order: [rows·cols, h]."""
    side = int(round(table.shape[0] ** 0.5))
    grid = table.reshape(side, side, -1).permute(2, 0, 1).unsqueeze(0)  # [1, h, side, side]
    out = F.interpolate(grid.float(), size=(rows, cols), mode="bilinear", align_corners=True)[0].to(table.dtype)
    r, c = patch_rows_cols(rows, cols, merge, table.device)
    return out[:, r, c].t()


def mrope_positions(is_image: list[bool] | torch.Tensor, grids: list[tuple[int, int]], merge: int) -> torch.Tensor:
    """[3, s] (temporal, height, width) positions of one sample whose tokens are text or image
    (``is_image``), the images' patch grids ``grids`` in order. Text advances all three by one; an image's
    tokens share its start in time and count rows and columns from it; the text after it resumes at the start
    plus the longer side of its token grid. Built run by run (a sample has a few runs of text and images), on
    the host: a Python step per token cost tens of milliseconds a micro-batch at 8K tokens."""
    flags = torch.as_tensor(is_image, dtype=torch.bool).cpu()
    s = flags.numel()
    out = torch.empty(3, s, dtype=torch.long)
    changes = (torch.nonzero(flags[1:] != flags[:-1]).flatten() + 1).tolist()
    pos, image = 0, 0
    for a, e in zip([0] + changes, changes + [s]):
        if not flags[a]:
            out[:, a:e] = torch.arange(pos, pos + e - a)
            pos += e - a
            continue
        i = a
        while i < e:  # adjacent images make one run
            rows, cols = grids[image][0] // merge, grids[image][1] // merge
            n = rows * cols
            out[0, i:i + n] = pos
            out[1, i:i + n] = torch.arange(rows).repeat_interleave(cols) + pos
            out[2, i:i + n] = torch.arange(cols).repeat(rows) + pos
            pos, i, image = pos + max(rows, cols), i + n, image + 1
    return out


def mrope_tables(positions_3S: torch.Tensor, head_dim: int, base: float,
                 section: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [s, head_dim] (fp32) of interleaved multimodal RoPE: frequency pair j rotates by the height
    position when j ≡ 1 (mod 3) and j < 3·section[1], by the width position when j ≡ 2 (mod 3) and
    j < 3·section[2], else by the temporal one (for text all three are equal: plain RoPE)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = positions_3S.float()[..., None] * inv_freq.to(positions_3S.device)  # [3, s, d/2]
    mixed = angles[0].clone()
    for axis in (1, 2):
        idx = slice(axis, section[axis] * 3, 3)
        mixed[:, idx] = angles[axis][:, idx]
    mixed = torch.cat([mixed, mixed], dim=-1)
    return mixed.cos(), mixed.sin()
