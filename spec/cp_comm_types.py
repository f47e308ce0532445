"""The context-parallel communication types a layout may choose: one descriptor per name, the single source of
those names (Megatron's ``--cp-comm-type``).

Every type keeps Megatron's load-balanced causal split (the sequence in 2·cp chunks, CP rank i holding chunks i
and 2·cp−1−i); they differ in how a rank's queries meet the other ranks' keys and values:

- ``allgather``: K and V all-gathered over the CP group before the attention (backward: their gradients
  reduce-scattered); nothing hides the exchange.
- ``p2p``: a ring. Each rank's K/V chunk pair travels once around the CP group, one hop per step; a step's
  hop runs while the rank attends to the chunk pair it received the step before, and the partial results merge
  by their log-sum-exp (online softmax). Backward sends the pairs round again with their gradient
  accumulators. The load balance makes every step after the first the same amount of causal work.
- ``a2a``: Ulysses-style. An all-to-all per q, k and v scatters the heads and gathers the sequence, so each rank
  attends over the whole sequence with heads/cp of its TP rank's heads; one more all-to-all brings the output
  back. Needs the query and KV heads to split over tp·cp (rule ``cp_a2a_heads``).
- ``a2a+p2p``: hierarchical. The CP group splits into sub-groups of ``a`` consecutive CP ranks (Megatron's
  ``hierarchical_context_parallel_sizes = (a, p)``, a·p = cp): the all-to-all runs inside a sub-group, the ring
  across the ``p`` sub-groups among the CP ranks of the same index in theirs. In Megatron's rank order
  consecutive CP ranks are nearest (tp ranks apart), so the all-to-all stays inside a node while the ring
  crosses nodes; the planner tries it only there, with ``a`` the CP ranks one node holds.

``ParallelConfig.cp_comm_type`` must be one of :data:`CP_COMM_TYPES`. The executor registers an implementation
per name (``executor.parallel.cp_exchange.CP_EXCHANGES``) and the cost model a pricing
(``costmodel.context_parallel.CP_PRICING``); ``tests/executor/test_cp_comm_types.py`` checks that both hold
exactly these names.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CpCommType:
    """One CP communication type: its name in foldtune's labels, Megatron's spelling, what it does, and how it
    uses the CP group: ``scatters_heads`` (an all-to-all trades heads for the sequence) and ``ring`` (K/V chunks
    travel around a ring of ranks)."""

    name: str
    megatron: str
    summary: str
    scatters_heads: bool = False
    ring: bool = False


CP_COMM_KINDS: tuple[CpCommType, ...] = (
    CpCommType("allgather", "all_gather", "K/V all-gathered over CP before the attention"),
    CpCommType("p2p", "p2p", "K/V chunks passed around the CP ring, each hop hidden by the attention of the "
                             "chunk before", ring=True),
    CpCommType("a2a", "a2a", "all-to-all scatters heads and gathers the sequence (Ulysses)", scatters_heads=True),
    CpCommType("a2a+p2p", "a2a+p2p", "all-to-all inside sub-groups of the CP group, ring across them",
               scatters_heads=True, ring=True),
)
CP_COMM_TYPES: tuple[str, ...] = tuple(k.name for k in CP_COMM_KINDS)  # the first is the default
DEFAULT_CP_COMM = CP_COMM_TYPES[0]
HIERARCHICAL = "a2a+p2p"
CP_COMM_BY_NAME: dict[str, CpCommType] = {k.name: k for k in CP_COMM_KINDS}


def cp_split(cp_comm_type: str, cp: int, hierarchical_sizes: tuple[int, ...] | None) -> tuple[int, int]:
    """(a2a size, ring size) of a CP group of ``cp`` ranks under ``cp_comm_type``: the ranks one all-to-all spans
    and the ranks one ring spans (1 where the type has none). ``allgather`` (1, 1); ``p2p`` (1, cp); ``a2a``
    (cp, 1); ``a2a+p2p`` ``hierarchical_sizes`` (checked by the rule book's ``cp_comm_hierarchical`` rule; (1, cp)
    while they are missing)."""
    if cp <= 1 or cp_comm_type == "allgather":
        return 1, 1
    if cp_comm_type == "p2p":
        return 1, cp
    if cp_comm_type == "a2a":
        return cp, 1
    if hierarchical_sizes and len(hierarchical_sizes) == 2:
        return int(hierarchical_sizes[0]), int(hierarchical_sizes[1])
    return 1, cp


def hierarchical_problem(cp_comm_type: str, cp: int, sizes: tuple[int, ...] | None) -> str | None:
    """Why ``hierarchical_context_parallel_sizes`` ``sizes`` do not go with ``cp_comm_type`` and ``cp``, or None:
    a2a+p2p needs two sizes (a2a, ring) whose product is cp; every other type takes none."""
    if cp_comm_type != HIERARCHICAL:
        if sizes:
            return f"hierarchical_context_parallel_sizes {list(sizes)} go with cp_comm_type a2a+p2p only"
        return None
    if not sizes or len(sizes) != 2:
        return ("cp_comm_type a2a+p2p needs hierarchical_context_parallel_sizes (a2a size, p2p size), e.g. "
                "cp_comm=a2a+p2p:2x4")
    if sizes[0] * sizes[1] != cp:
        return (f"hierarchical_context_parallel_sizes {sizes[0]}x{sizes[1]} multiply to {sizes[0] * sizes[1]}, "
                f"not cp ({cp})")
    return None
