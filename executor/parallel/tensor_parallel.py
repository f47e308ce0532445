"""Entering and leaving a tensor-parallel region under sequence parallelism.

Between layers each TP rank holds a 1/tp slice of the sequence ([s/tp, b, h]). A column-parallel linear
needs the whole sequence: :func:`enter_tp` all-gathers it (backward: reduce-scatter). A row-parallel
linear leaves partial sums: :func:`leave_tp` reduce-scatters them back to sequence slices (backward:
all-gather). Without sequence parallelism (tp == 1 only: the rule book's ``sp_needs_tp`` and ``executor_sp``)
both are identities.
"""

from __future__ import annotations

import torch

from executor.parallel.collectives import all_gather, reduce_scatter
from executor.parallel.groups import ParallelState


def enter_tp(x_SBH: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Full-sequence input of a column-parallel linear from this rank's sequence slice."""
    return all_gather(x_SBH, state.tp)


def leave_tp(y_SBH: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """This rank's sequence slice of the sum of the row-parallel partial outputs."""
    return reduce_scatter(y_SBH, state.tp)
