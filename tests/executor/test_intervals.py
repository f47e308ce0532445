"""executor/microbench/intervals.py: unions, overlaps and gaps of device intervals."""

from __future__ import annotations

import pytest

from executor.microbench.intervals import gaps, overlap_us


def test_communication_beside_compute_is_the_intersection_with_the_compute_union():
    # all-to-all kernels [0, 10) and [20, 30); compute [5, 8), [7, 12) (overlapping each other), [25, 40)
    assert overlap_us([(0, 10), (20, 30)], [(5, 8), (7, 12), (25, 40)]) == pytest.approx(5 + 5)
    assert overlap_us([(0, 10)], []) == 0.0 and overlap_us([(0, 10)], [(10, 20)]) == 0.0
    assert overlap_us([(0, 4), (2, 6)], [(0, 100)]) == pytest.approx(6)  # counted once where they overlap


def test_the_device_idles_between_the_pieces_of_its_activity_union():
    # kernels [0, 10) and [5, 12) overlap; [15, 20) and [20, 22) touch; [30, 31) stands alone
    busy = [(5, 12), (0, 10), (20, 22), (15, 20), (30, 31)]
    assert gaps(busy) == [(12, 15), (22, 30)]
    assert gaps([(0, 1)]) == [] and gaps([]) == []
