"""The token dispatchers a user may choose: one descriptor per name, the single source of those names.

``ParallelConfig.moe_token_dispatcher_type`` must be one of :data:`DISPATCHERS`. Each name has an
implementation registered in the executor (``executor.dispatcher.DISPATCHER_CLASSES``) and a pricing
registered in the cost model (``costmodel.dispatch.PRICING``);
``tests/executor/test_dispatcher_registry.py`` checks that both registries hold exactly these names.
Adding a dispatcher: one descriptor here, its executor class and its pricing, each registered
(docs/architecture.md walks through it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DispatcherKind:
    """One dispatcher: its name in Megatron's ``--moe-token-dispatcher-type`` words and what it does."""

    name: str
    summary: str
    # sends every token to every rank of the ETP·EP group rather than only to its top-k experts' ranks, which
    # pays off only on NVLink: the planner's search space keeps such a dispatcher inside one node
    # (planner.enumerate.SearchSpace.gathering_within_node)
    gathers_every_token: bool = False


DISPATCHER_KINDS: tuple[DispatcherKind, ...] = (
    DispatcherKind("alltoall", "all-to-all of the routed token copies over EP, all-gather of them over ETP"),
    DispatcherKind("allgather", "all-gather of every token over ETP·EP, each rank keeps its experts' copies",
                   gathers_every_token=True),
)
DISPATCHERS: tuple[str, ...] = tuple(k.name for k in DISPATCHER_KINDS)  # the first is the default
DEFAULT_DISPATCHER = DISPATCHERS[0]
GATHERING_DISPATCHERS: tuple[str, ...] = tuple(k.name for k in DISPATCHER_KINDS if k.gathers_every_token)
