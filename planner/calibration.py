"""Re-calibrating the cost model from measurements taken during a search.

The analytical model prices each term of a step from datasheet or microbenchmark constants. Real runs
differ per *kind* of term (kernels slower than their curve, collectives faster than the ring model,
...), so the calibration learns one multiplier per term group by ridge regression towards a single
common factor (the model's structure is the prior; the common factor absorbs a machine that is uniformly
slower or faster than its profile): with few measurements only the common factor moves, with many each
group follows the data. Errors are weighted relatively so that fast and slow layouts count alike.

Memory is calibrated conservatively: the multiplier is the largest measured/predicted ratio seen, and a
layout that ran out of memory raises it until that layout is predicted not to fit. A planner that
under-predicts memory wastes trials on OOMs; one that over-predicts a little only skips a few layouts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from costmodel.terms import TERM_GROUPS, calibration_group

# The term groups (what usually mis-predicts together) are the term table's ``group`` column.
GROUPS = tuple(TERM_GROUPS)


def group_seconds(terms: Sequence[tuple[str, float]]) -> dict[str, float]:
    """Sum exposed seconds (s) per term group; InvalidConfigError for a term the term table does not hold."""
    out = dict.fromkeys(GROUPS, 0.0)
    for name, seconds in terms:
        out[calibration_group(name)] += seconds
    return out


@dataclass(frozen=True)
class Observation:
    """One finished trial as the calibration sees it (seconds and bytes)."""

    predicted_terms: tuple[tuple[str, float], ...]
    predicted_memory_bytes: float
    measured_step_time: float | None = None  # None when the trial failed
    measured_peak_bytes: float | None = None
    out_of_memory: bool = False
    capacity_bytes: float | None = None  # usable device memory, needed to learn from an OOM


@dataclass(frozen=True)
class Calibration:
    """Per-group time multipliers and one memory multiplier; identity when nothing was measured."""

    time_multipliers: tuple[tuple[str, float], ...] = tuple((g, 1.0) for g in GROUPS)
    memory_multiplier: float = 1.0
    relative_rmse: float = 0.0  # of the calibrated time fit over the observations (0 when < 2 points)
    num_observations: int = 0
    details: dict = field(default_factory=dict, compare=False)

    def step_time(self, terms: Sequence[tuple[str, float]]) -> float:
        """Calibrated step time (s) of a prediction given by its exposed time terms."""
        mult = dict(self.time_multipliers)
        return sum(mult[g] * s for g, s in group_seconds(terms).items())

    def memory(self, predicted_bytes: float) -> float:
        """Calibrated peak memory (bytes)."""
        return predicted_bytes * self.memory_multiplier

    def to_dict(self) -> dict:
        return {"time_multipliers": dict(self.time_multipliers), "memory_multiplier": self.memory_multiplier,
                "relative_rmse": self.relative_rmse, "num_observations": self.num_observations}


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for the small symmetric systems of the ridge fit."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-300:
            continue
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] if abs(m[i][i]) > 1e-300 else 1.0 for i in range(n)]


def fit_calibration(observations: Sequence[Observation], prior_strength: float = 0.5,
                    min_multiplier: float = 0.1, max_multiplier: float = 10.0) -> Calibration:
    """Fit per-group time multipliers (ridge towards 1) and the memory multiplier.

    Minimises Σ_i ((Σ_g c_g·x_ig − y_i) / y_i)² + Σ_g λ_g·(c_g − c_0)², where x_ig is the predicted seconds
    of group g for observation i, y_i the measured step time, and λ_g = ``prior_strength`` · mean_i
    (x_ig / y_i)²: the prior weighs as much as ``prior_strength`` typical observations of that group and
    pulls towards c_0, the single least-squares factor of measured over predicted time (1 without data).
    Multipliers are clamped to [``min_multiplier``, ``max_multiplier``] · c_0.
    """
    timed = [o for o in observations if o.measured_step_time and o.measured_step_time > 0]
    n = len(GROUPS)
    ata = [[0.0] * n for _ in range(n)]
    atb = [0.0] * n
    rows = []
    for o in timed:
        x = group_seconds(o.predicted_terms)
        row = [x[g] / o.measured_step_time for g in GROUPS]  # relative weighting: divide by y
        rows.append(row)
        for i in range(n):
            atb[i] += row[i]  # y_i / y_i = 1
            for j in range(n):
                ata[i][j] += row[i] * row[j]
    # The prior is the model's *structure*: every group scaled by one common factor, the least-squares
    # ratio of measured to predicted (1 with no data). A machine that is uniformly slower than its
    # profile (a CPU, a throttled GPU) then needs no per-group evidence to be predicted well.
    common = 1.0
    if rows:
        totals = [sum(row) for row in rows]  # predicted / measured per observation
        common = sum(totals) / sum(t * t for t in totals)
    for i in range(n):
        # Each multiplier is pulled to ``common`` with the weight of ``prior_strength`` average
        # observations *of that group*, so a group that is a small share of every step is not frozen.
        scale = (ata[i][i] / len(rows)) if rows else 1.0
        weight = prior_strength * max(scale, 1e-6)
        ata[i][i] += weight
        atb[i] += weight * common
    coef = [min(max_multiplier * common, max(min_multiplier * common, c)) for c in _solve(ata, atb)]
    rmse = 0.0
    if len(rows) >= 2:
        rmse = math.sqrt(sum((sum(c * v for c, v in zip(coef, row)) - 1.0) ** 2 for row in rows) / len(rows))

    mem = 1.0
    ratios = [o.measured_peak_bytes / o.predicted_memory_bytes for o in observations
              if o.measured_peak_bytes and o.predicted_memory_bytes > 0]
    if ratios:
        mem = max(ratios)
    for o in observations:
        if o.out_of_memory and o.capacity_bytes and o.predicted_memory_bytes > 0:
            # The layout did not fit: its calibrated prediction must exceed capacity.
            mem = max(mem, 1.02 * o.capacity_bytes / o.predicted_memory_bytes)
    return Calibration(time_multipliers=tuple(zip(GROUPS, coef)), memory_multiplier=mem, relative_rmse=rmse,
                       num_observations=len(timed))
