"""Entering and leaving a tensor-parallel region under sequence parallelism.

Between layers each TP rank holds a 1/tp slice of the sequence ([s/tp, b, h]). A column-parallel linear
needs the whole sequence: :func:`enter_tp` all-gathers it (backward: reduce-scatter). A row-parallel
linear leaves partial sums: :func:`leave_tp` reduce-scatters them back to sequence slices (backward:
all-gather). Without sequence parallelism (tp == 1 only, see :func:`check_layout`) both are identities.
"""

from __future__ import annotations

import torch

from spec.errors import InvalidConfigError
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.validity import executor_layout_error, executor_layout_rules
from executor.parallel.collectives import all_gather, reduce_scatter
from executor.parallel.groups import ParallelState


def enter_tp(x_SBH: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Full-sequence input of a column-parallel linear from this rank's sequence slice."""
    return all_gather(x_SBH, state.tp)


def leave_tp(y_SBH: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """This rank's sequence slice of the sum of the row-parallel partial outputs."""
    return reduce_scatter(y_SBH, state.tp)


def check_layout(model: ModelSpec, config: ParallelConfig, seq_length: int) -> None:
    """Raise InvalidConfigError for layouts this executor cannot run, naming the offending values."""
    rejections = executor_layout_rules(model, config, seq_length)
    if rejections:
        raise InvalidConfigError(executor_layout_error(model, config, rejections))
