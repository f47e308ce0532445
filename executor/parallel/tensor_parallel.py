"""Entering and leaving a tensor-parallel region under sequence parallelism.

Between layers each TP rank holds a 1/tp slice of the sequence ([s/tp, b, h]). A column-parallel linear
needs the whole sequence: :func:`enter_tp` all-gathers it (backward: reduce-scatter). A row-parallel
linear leaves partial sums: :func:`leave_tp` reduce-scatters them back to sequence slices (backward:
all-gather). Without sequence parallelism (tp == 1 only: the rule book's ``sp_needs_tp`` and ``executor_sp``)
both are identities.

TP communication overlap (``ParallelConfig.tp_comm_overlap``, Megatron's ``--tp-comm-overlap``): the same
results with the collectives under the GEMMs next to them. :func:`gathered` computes the column-parallel part
of this rank's own slice while the other slices are being gathered, then theirs; :func:`scattered` cuts the
row-parallel GEMM into :data:`TP_OVERLAP_CHUNKS` pieces of every rank's slice and reduce-scatters each piece
while the next one is computed. The GEMMs run on row blocks (each row's result as in one GEMM, up to the
kernel's blocking); the backward runs its collectives in line, and so does a recomputed forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor.parallel.collectives import all_gather, all_gather_async, reduce_scatter, reduce_scatter_async
from executor.parallel.groups import ParallelState
from executor.recompute import recomputing

# Pieces the row-parallel GEMM is cut into under TP overlap: the first piece's reduce-scatter hides under the
# second's GEMM and the last one's stays exposed (the cost model's TP_OVERLAP_EXPOSED_FRACTION assumes more
# pieces on GPU; two is the least that overlaps, and keeps the GEMMs large on the small test models).
TP_OVERLAP_CHUNKS = 2

Rows = torch.Tensor | tuple[torch.Tensor, ...]


def enter_tp(x_SBH: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Full-sequence input of a column-parallel linear from this rank's sequence slice."""
    return all_gather(x_SBH, state.tp)


def leave_tp(y_SBH: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """This rank's sequence slice of the sum of the row-parallel partial outputs."""
    return reduce_scatter(y_SBH, state.tp)


def tp_overlap(state: ParallelState) -> bool:
    """Whether this layout overlaps its TP collectives with the GEMMs (tp_comm_overlap, over a real TP group)."""
    return bool(state.config.tp_comm_overlap) and state.tp.size > 1


def gathered(x_SBH: torch.Tensor, fn: Callable[[torch.Tensor], Rows], state: ParallelState) -> Rows:
    """``fn(enter_tp(x_SBH))`` for a row-wise ``fn`` (each output row depends on its input row alone; a tensor
    or a tuple of tensors along the sequence): ``fn`` of this rank's slice runs while the all-gather of the
    others' is in flight, then ``fn`` of each other slice, and the outputs are joined in rank order."""
    tp = state.tp
    pending = all_gather_async(x_SBH, tp)
    mine = fn(x_SBH)
    full = pending.wait()
    n = x_SBH.shape[0]
    parts = [mine if r == tp.rank else fn(full[r * n:(r + 1) * n]) for r in range(tp.size)]
    if isinstance(mine, torch.Tensor):
        return torch.cat(parts)
    return tuple(torch.cat(column) for column in zip(*parts))


def scattered(x_SBF: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], state: ParallelState) -> torch.Tensor:
    """``leave_tp(fn(x_SBF))`` for a row-wise ``fn`` of the whole sequence (a row-parallel GEMM): in
    :data:`TP_OVERLAP_CHUNKS` pieces, each holding the same rows of every rank's slice, the reduce-scatter of
    one piece started before the next piece's ``fn``. In line when a slice does not split into the pieces."""
    tp = state.tp
    s = x_SBF.shape[0]
    n = s // tp.size
    if n % TP_OVERLAP_CHUNKS:
        return leave_tp(fn(x_SBF), state)
    p = n // TP_OVERLAP_CHUNKS
    by_rank = x_SBF.reshape(tp.size, n, *x_SBF.shape[1:])
    # a checkpointed forward re-running in backward stops once it has what backward saved (torch's early stop),
    # which may be before the last wait: there each piece is waited for at once, leaving nothing in flight
    inline = recomputing()
    pending = []
    for i in range(TP_OVERLAP_CHUNKS):
        pending.append(reduce_scatter_async(fn(by_rank[:, i * p:(i + 1) * p].reshape(tp.size * p, *x_SBF.shape[1:])),
                                            tp))
        if inline:
            pending[-1].wait()
    return torch.cat([piece.wait() for piece in pending])
