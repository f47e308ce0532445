"""The token dispatchers a user may choose: one descriptor per name, the single source of those names.

``ParallelConfig.moe_token_dispatcher_type`` must be one of :data:`DISPATCHERS`. Each name has a pricing
registered in the cost model (``costmodel.dispatch.PRICING``); each of :data:`EXECUTOR_DISPATCHERS` also has an
implementation registered in the executor (``executor.dispatcher.DISPATCHER_CLASSES``). The others
(:data:`MEGATRON_ONLY_DISPATCHERS`: Megatron's flex dispatcher over DeepEP or HybridEP kernels) are priced and
exported to Megatron's arguments but not built: the rule book's ``executor_dispatcher`` rule names them, and
the planner searches them only when asked (``planner.enumerate.SearchSpace.dispatchers``, ``plan --megatron``).
``tests/executor/test_dispatcher_registry.py`` checks that both registries hold exactly these names.
Adding a dispatcher: one descriptor here, its executor class and its pricing, each registered
(docs/architecture.md walks through it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DispatcherKind:
    """One dispatcher: foldtune's name for it, what it does and how Megatron's arguments select it
    (``--moe-token-dispatcher-type`` and, for the flex dispatcher, ``--moe-flex-dispatcher-backend``)."""

    name: str
    summary: str
    megatron_type: str = ""  # Megatron's --moe-token-dispatcher-type; empty: the name itself
    flex_backend: str | None = None  # Megatron's --moe-flex-dispatcher-backend (flex only)
    # whether executor/ builds it (False: Megatron-only, rejected by the executor_dispatcher rule)
    executor_builds: bool = True
    # sends every token to every rank of the ETP·EP group rather than only to its top-k experts' ranks, which
    # pays off only on NVLink: the planner's search space keeps such a dispatcher inside one node
    # (planner.enumerate.SearchSpace.gathering_within_node)
    gathers_every_token: bool = False


DISPATCHER_KINDS: tuple[DispatcherKind, ...] = (
    DispatcherKind("alltoall", "all-to-all of the routed token copies over EP, all-gather of them over ETP"),
    DispatcherKind("allgather", "all-gather of every token over ETP·EP, each rank keeps its experts' copies",
                   gathers_every_token=True),
    DispatcherKind("flex_deepep", "Megatron's flex dispatcher on DeepEP's kernels: each token crosses the network "
                   "once per destination node, then NVLink to its experts' GPUs", megatron_type="flex",
                   flex_backend="deepep", executor_builds=False),
    DispatcherKind("flex_hybridep", "Megatron's flex dispatcher on HybridEP's kernels (TMA-driven, few SMs), "
                   "the same per-node hierarchy", megatron_type="flex", flex_backend="hybridep",
                   executor_builds=False),
)
DISPATCHERS: tuple[str, ...] = tuple(k.name for k in DISPATCHER_KINDS)  # the first is the default
DEFAULT_DISPATCHER = DISPATCHERS[0]
GATHERING_DISPATCHERS: tuple[str, ...] = tuple(k.name for k in DISPATCHER_KINDS if k.gathers_every_token)
EXECUTOR_DISPATCHERS: tuple[str, ...] = tuple(k.name for k in DISPATCHER_KINDS if k.executor_builds)
MEGATRON_ONLY_DISPATCHERS: tuple[str, ...] = tuple(k.name for k in DISPATCHER_KINDS if not k.executor_builds)
FLEX_DISPATCHERS: tuple[str, ...] = tuple(k.name for k in DISPATCHER_KINDS if k.flex_backend is not None)


def dispatcher_kind(name: str) -> DispatcherKind:
    """The descriptor of dispatcher ``name`` (KeyError for a name not in :data:`DISPATCHERS`)."""
    return {k.name: k for k in DISPATCHER_KINDS}[name]
