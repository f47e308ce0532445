"""Memory-bound op classes as measured (``executor.microbench.memory_bound``) -> the profile's per-class curves
of bytes per kernel -> achieved / datasheet bandwidth, bytes counted as the time model counts them.

The benchmark times one forward + backward of each class (``spec.hardware.MEMORY_OP_CLASSES``) at a few sizes.
For each measurement the time model books ``B = (1 + ELEMENTWISE_BWD_RATIO) x`` the forward bytes of that op
(:func:`forward_bytes`: the formulas of ``costmodel.step_time``'s residual add, norm, activation and token
permutation) in two kernels, forward and backward. The curve's point is (B / 2 bytes per kernel,
B / seconds / datasheet bandwidth): what ``costmodel.compute.memory_time`` reads back, so that a kernel of the
measured size and class is priced at the measured seconds. The fixed cost of an op (a GPU's launch gap and
tail; on a CPU rank the framework's dispatch and autograd, tens of microseconds, most of a tiny model's norm)
is inside the small sizes' points, and below the smallest size the time model keeps that size's seconds.

A copy's bandwidth (``hbm_efficiency``) is no measure of these ops: on a CPU they run as several passes
(RMSNorm in fp32 math, SwiGLU's silu and product, their backward) and their fixed cost dominates small
tensors; on a GPU eager elementwise kernels reach less of the bandwidth than a copy.
"""

from __future__ import annotations

from costmodel.step_time import ELEMENTWISE_BWD_RATIO
from spec.hardware import MeasuredCurve

KERNELS_PER_CALL = 2  # the benchmark's call is one forward and one backward


def forward_bytes(row: dict) -> float:
    """Bytes the time model books for the forward of one benchmarked op (``row`` from the benchmark)."""
    elements = row["rows"] * row["width"] * row["elem_bytes"]
    op = row["op"]
    if op == "norm":  # costmodel.step_time norm: read and write the tokens' rows
        return 2.0 * elements
    if op in ("elementwise", "activation"):  # two inputs and one output (a residual add; gate, up -> output)
        return 3.0 * elements
    if op == "permute":  # read every row once, write each of its copies
        return (1.0 + row.get("copies", 1)) * elements
    raise ValueError(f"unknown memory-bound op class {op!r}")


def curve_point(row: dict, datasheet_bandwidth: float) -> tuple[float, float]:
    """(bytes per kernel, achieved / datasheet bandwidth) of one benchmark row, bytes as the time model counts."""
    booked = (1.0 + ELEMENTWISE_BWD_RATIO) * forward_bytes(row)
    return booked / KERNELS_PER_CALL, booked / row["seconds"] / datasheet_bandwidth


def memory_bound_curves(rows: list[dict], datasheet_bandwidth: float) -> tuple[tuple[str, MeasuredCurve], ...]:
    """``memory_bound_efficiency`` of the benchmark's rows: class -> curve, sorted by class (empty: no rows)."""
    points: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        points.setdefault(row["op"], []).append(curve_point(row, datasheet_bandwidth))
    return tuple(sorted((op, MeasuredCurve(tuple(pts))) for op, pts in points.items()))
