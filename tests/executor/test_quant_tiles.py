"""executor/microbench/quant_tiles.py off the GPU: the variants it tries, the bytes it counts, the equality that
keeps a tile changing a byte from being picked."""

import torch

from executor.kernels.fp8 import quantize
from executor.microbench import quant_tiles


def test_variants_start_with_the_current_tiles_then_integer_rounding_then_one_key_at_a_time():
    for family in quant_tiles.SWEEP:
        tried = quant_tiles.variants(family)
        assert tried[:2] == [{}, quant_tiles.INTEGER_ROUNDING]
        assert all(len(v) == 1 and next(iter(v.values())) != quantize.TILES[next(iter(v))] for v in tried[2:])
        assert len(tried) == 2 + sum(len([x for x in vals if x != quantize.TILES[k]])
                                     for k, vals in quant_tiles.SWEEP[family].items())


def test_bytes_moved_are_one_read_and_the_e4m3_writes():
    t = torch.zeros(32, 64, dtype=torch.bfloat16)
    rows = quant_tiles.Case("rows", "t", (32, 64), 1)
    assert quant_tiles._bytes_moved(rows, t, None) == 32 * 64 * 3 + 32 * 4  # bf16 read, e4m3 written, a scale a row
    both = quant_tiles.Case("both", "t", (32, 64), 1)
    assert quant_tiles._bytes_moved(both, t, None) == 32 * 64 * 4 + (32 + 64) * 4  # two e4m3 forms, row + column scales
    groups = quantize.padded_groups(torch.tensor([5, 5, 32], dtype=torch.int32), 32)
    case = quant_tiles.Case("groups", "t", (32, 64), 1)
    assert quant_tiles._bytes_moved(case, t, groups) == 32 * 64 * 2 + groups.rows * 64 + quant_tiles.G * 64 * 4


def test_a_changed_byte_or_scale_is_not_equal():
    x = torch.randn(4, 32).to(torch.bfloat16)
    want = [quantize._quantize_rowwise_torch(x)]
    q, s = quantize._quantize_rowwise_torch(x)
    assert quant_tiles._equal((q, s), want)
    q.view(torch.uint8)[1, 3] ^= 1
    assert not quant_tiles._equal((q, s), want)
    both = quantize._quantize_both_torch(x)
    assert quant_tiles._equal(both, list(quantize._quantize_both_torch(x)))
    (q2, s2), pair = both
    s2[0] *= 2
    assert not quant_tiles._equal(((q2, s2), pair), list(quantize._quantize_both_torch(x)))
