"""Multimodal RoPE positions (executor.vlm.positions.mrope_positions) against the rule applied token by token:
text advances (t, h, w) together; an image's tokens share its start in time and count rows and columns from it;
the text after it resumes at the start plus the longer side of its token grid."""

from __future__ import annotations

import random

import torch

from executor.vlm.positions import mrope_positions


def _token_by_token(is_image: list[bool], grids: list[tuple[int, int]], merge: int) -> torch.Tensor:
    out, pos, i, image = [], 0, 0, 0
    while i < len(is_image):
        if not is_image[i]:
            out.append((pos, pos, pos))
            pos, i = pos + 1, i + 1
            continue
        rows, cols = grids[image][0] // merge, grids[image][1] // merge
        out += [(pos, pos + r, pos + c) for r in range(rows) for c in range(cols)]
        pos, i, image = pos + max(rows, cols), i + rows * cols, image + 1
    return torch.tensor(out, dtype=torch.long).t()


def test_a_hand_worked_sample():
    # text, a 2x3 token grid (4x6 patches, merge 2), text: the text after it resumes at 1 + max(2, 3) = 4
    is_image = [False] + [True] * 6 + [False, False]
    got = mrope_positions(is_image, [(4, 6)], 2)
    assert got.tolist() == [[0, 1, 1, 1, 1, 1, 1, 4, 5],
                            [0, 1, 1, 1, 2, 2, 2, 4, 5],
                            [0, 1, 2, 3, 1, 2, 3, 4, 5]]


def test_random_layouts_with_adjacent_images_and_images_at_both_ends_equal_the_rule():
    rng = random.Random(0)
    for _ in range(50):
        grids, is_image = [], []
        for _ in range(rng.randint(1, 4)):
            is_image += [False] * rng.choice([0, 0, 1, 5])  # 0: the image follows the previous one directly
            grid = (2 * rng.randint(1, 4), 2 * rng.randint(1, 4))
            grids.append(grid)
            is_image += [True] * (grid[0] * grid[1] // 4)
        is_image += [False] * rng.choice([0, 3])
        assert torch.equal(mrope_positions(is_image, grids, 2), _token_by_token(is_image, grids, 2))
        assert torch.equal(mrope_positions(torch.tensor(is_image), grids, 2), _token_by_token(is_image, grids, 2))
