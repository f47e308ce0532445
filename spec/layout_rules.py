"""The rules a :class:`ParallelConfig` must keep on its own, before any model is known: its sizes fold the
world, and its knobs go together. Part of the rule book (:func:`spec.validity.check`).

``ParallelConfig.__post_init__`` checks only types and ranges (positive sizes, known words, fractions), so
a layout that breaks one of these rules can still be built, priced as "invalid" by the planner and
refused, with the rule's id, by every front door. Each rule is an entry of :data:`LAYOUT_RULES`: an id, what
it demands, and a function of the config that returns the reason it is broken (None when it holds);
:func:`register` adds one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from spec.cp_comm_types import hierarchical_problem
from spec.optimizer_dtypes import MAIN_PARAMS_DTYPES, is_precision_aware
from spec.parallel_config import ParallelConfig


@dataclass(frozen=True)
class Rejection:
    """Why a layout is invalid: the id of the rule it breaks (a key of ``spec.validity.RULES`` or
    ``spec.validity.EXECUTOR_RULES``) and one readable line."""

    rule: str
    reason: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.reason}"


@dataclass(frozen=True)
class LayoutRule:
    """One rule on a config alone: ``broken(config)`` is the reason it fails, or None when it holds."""

    id: str
    demands: str
    broken: Callable[[ParallelConfig], str | None]

    def __call__(self, config: ParallelConfig) -> Rejection | None:
        reason = self.broken(config)
        return None if reason is None else Rejection(self.id, reason)


def world_dense(world: int, tp: int, cp: int, pp: int) -> Rejection | None:
    """tp·cp·pp must divide the world (dp is what is left)."""
    if world % (tp * cp * pp):
        return Rejection("world_dense", f"tp·cp·pp = {tp}·{cp}·{pp} = {tp * cp * pp} does not divide "
                                        f"the world size {world}")
    return None


def world_expert(world: int, ep: int, etp: int, pp: int) -> Rejection | None:
    """etp·ep·pp must divide the world (edp is what is left)."""
    if world % (etp * ep * pp):
        return Rejection("world_expert", f"etp·ep·pp = {etp}·{ep}·{pp} = {etp * ep * pp} does not divide "
                                         f"the world size {world}")
    return None


def folds_the_world(config: ParallelConfig) -> bool:
    """Whether both grids (tp·cp·pp and etp·ep·pp) divide the world, so ``dp`` and ``edp`` are exact."""
    c = config
    return not (world_dense(c.world_size, c.tp, c.cp, c.pp) or world_expert(c.world_size, c.ep, c.etp, c.pp))


def _sp_needs_tp(c: ParallelConfig) -> str | None:
    return "sequence_parallel needs tp > 1" if c.sequence_parallel and c.tp == 1 else None


def _recompute_modules_selective(c: ParallelConfig) -> str | None:
    if c.recompute_modules and c.recompute_granularity != "selective":
        return (f"recompute_modules {list(c.recompute_modules)} are only used with recompute_granularity "
                f"'selective', got {c.recompute_granularity!r}")
    return None


def _pipeline_chunks(c: ParallelConfig) -> str | None:
    split = c.pipeline_split
    chunks = split.num_chunks() if not split.problems() else None
    if chunks is not None and chunks != c.pp * c.vpp:
        return (f"pipeline_layout has {chunks} chunks; pp·vpp = {c.pp}·{c.vpp} = {c.pp * c.vpp} "
                f"(vpp = chunks / pp)")
    return None


def optimizer_offload_problem(fraction: float, distributed_optimizer: bool) -> str | None:
    """Why optimizer CPU offload of ``fraction`` does not go with the distributed-optimizer setting, or None."""
    if fraction and not distributed_optimizer:
        return "optimizer_cpu_offload_fraction > 0 needs the distributed optimizer (as Megatron's --optimizer-cpu-offload)"
    return None


def precision_aware_problem(dtypes: tuple[str, str, str], distributed_optimizer: bool) -> str | None:
    """Why optimizer state ``dtypes`` (exp_avg, exp_avg_sq, main_params) do not go with the distributed-optimizer
    setting, or None: Megatron builds its precision-aware optimizer inside the distributed optimizer only."""
    if is_precision_aware(dtypes) and not distributed_optimizer:
        return (f"optimizer state dtypes {'/'.join(dtypes)} (exp_avg/exp_avg_sq/main_params) need the distributed "
                f"optimizer (Megatron's --use-precision-aware-optimizer)")
    return None


def main_params_problem(main_params_dtype: str) -> str | None:
    """Why ``main_params_dtype`` is not one Megatron keeps master weights in (``--main-params-dtype``), or None."""
    if main_params_dtype not in MAIN_PARAMS_DTYPES:
        return (f"main_params_dtype {main_params_dtype!r}: Megatron keeps master weights in "
                f"{' or '.join(MAIN_PARAMS_DTYPES)} (--main-params-dtype)")
    return None


def activation_offload_problem(granularity: str, recompute_modules: tuple[str, ...],
                               modules: tuple[str, ...]) -> str | None:
    """Why offloading the activations of ``modules`` does not go with the recompute setting, or None."""
    if not modules:
        return None
    if granularity == "full":
        return "activation_offload_modules cannot be combined with full recompute (the layer keeps only its input)"
    recomputed = recompute_modules if granularity == "selective" else ()
    both = [m for m in modules if m in recomputed]
    if both:
        return f"modules {both} are both recomputed and offloaded; choose one"
    if "core_attn" in modules and "mla_up_proj" in recomputed:
        return "core_attn cannot be offloaded while mla_up_proj is recomputed (the core runs inside that region)"
    return None


LAYOUT_RULES: list[LayoutRule] = [
    LayoutRule("world_dense", "tp·cp·pp divides the world size",
               lambda c: (r := world_dense(c.world_size, c.tp, c.cp, c.pp)) and r.reason),
    LayoutRule("world_expert", "etp·ep·pp divides the world size",
               lambda c: (r := world_expert(c.world_size, c.ep, c.etp, c.pp)) and r.reason),
    LayoutRule("sp_needs_tp", "sequence parallelism needs tp > 1", _sp_needs_tp),
    LayoutRule("recompute_modules_selective", "recompute modules go with selective recompute only",
               _recompute_modules_selective),
    LayoutRule("pipeline_chunks", "a pipeline layout string has pp·vpp chunks", _pipeline_chunks),
    LayoutRule("optimizer_offload_distopt", "optimizer CPU offload needs the distributed optimizer",
               lambda c: optimizer_offload_problem(c.optimizer_cpu_offload_fraction, c.use_distributed_optimizer)),
    LayoutRule("precision_aware_distopt", "optimizer state dtypes other than fp32 need the distributed optimizer",
               lambda c: precision_aware_problem(c.optimizer_dtypes, c.use_distributed_optimizer)),
    LayoutRule("main_params_dtype", "master weights are kept in fp32 or fp16",
               lambda c: main_params_problem(c.main_params_dtype)),
    LayoutRule("activation_offload", "activation offload excludes full recompute and modules that are recomputed "
                                     "(core_attn also while mla_up_proj is)",
               lambda c: activation_offload_problem(c.recompute_granularity, c.recompute_modules,
                                                    c.activation_offload_modules)),
    LayoutRule("cp_comm_hierarchical", "cp_comm_type a2a+p2p has hierarchical_context_parallel_sizes (a2a, p2p) "
                                       "whose product is cp; the other types have none",
               lambda c: hierarchical_problem(c.cp_comm_type, c.cp, c.hierarchical_context_parallel_sizes)),
]


def register(rule: LayoutRule) -> LayoutRule:
    """Add ``rule`` to the rules every config is checked against (its id must be new)."""
    if any(r.id == rule.id for r in LAYOUT_RULES):
        raise ValueError(f"layout rule {rule.id!r} is registered twice")
    LAYOUT_RULES.append(rule)
    return rule


def layout_rejections(config: ParallelConfig) -> list[Rejection]:
    """Every rule of :data:`LAYOUT_RULES` that ``config`` breaks (empty: its sizes and knobs go together)."""
    return [r for r in (rule(config) for rule in LAYOUT_RULES) if r is not None]
