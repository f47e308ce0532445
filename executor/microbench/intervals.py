"""Unions, overlaps and gaps of [start, end) time intervals, as profilers' device events give them.

The profiled-step readers (:mod:`.step_trace`, :mod:`.device_timeline`) read a step's device activity as
intervals in microseconds: how long some kernel or copy ran (the union), how much of one kind ran beside
another, and where the device sat idle between two operations.
"""

from __future__ import annotations


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals as disjoint sorted intervals."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (the same unit as the intervals: microseconds)."""
    return sum(e - s for s, e in merged(intervals))


def overlap_us(intervals: list[tuple[float, float]], others: list[tuple[float, float]]) -> float:
    """Time of ``intervals`` (their union) during which some interval of ``others`` runs too (microseconds):
    for NCCL kernels against compute kernels, how much of the communication ran beside compute."""
    total, theirs, j = 0.0, merged(others), 0
    for s, e in merged(intervals):
        while j < len(theirs) and theirs[j][1] <= s:
            j += 1
        k = j
        while k < len(theirs) and theirs[k][0] < e:
            total += min(e, theirs[k][1]) - max(s, theirs[k][0])
            k += 1
    return total


def gaps(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The idle stretches between the union's pieces, [end of one, start of the next), in time order."""
    pieces = merged(intervals)
    return [(a[1], b[0]) for a, b in zip(pieces, pieces[1:])]
