"""ParallelConfig: one folded layout (attention TP·CP·DP·PP, MoE ETP·EP·EDP·PP) plus the knobs beside it.

Its text, Optuna and JSON forms (label/parse, knob suffixes, Optuna parameters, to_dict/from_dict) are
inherited from :class:`spec.layout_codec.LayoutCodec`, the one codec of a layout."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from spec._validate import positive_ints, raise_if, require
from spec.cp_comm_types import CP_COMM_TYPES, DEFAULT_CP_COMM, cp_split
from spec.dispatchers import DEFAULT_DISPATCHER, DISPATCHERS
from spec.errors import InvalidConfigError
from spec.optimizer_dtypes import is_precision_aware, vocabulary_problems
from spec.layout_codec import (ACTIVATION_OFFLOAD_MODULES, DEFAULT_SELECTIVE_MODULES, OPTUNA_PARAMS, PIPELINE_FIELDS,
                               RECOMPUTE_GRANULARITIES, RECOMPUTE_MODULES, Labelled, LayoutCodec)
from spec.pipeline_layout import DEFAULT_SPLIT, PipelineSplit, canonical_layout


@dataclass(frozen=True)
class ParallelConfig(LayoutCodec):
    """A complete folded layout for ``world_size`` GPUs.

    ``world_size = tp·cp·dp·pp = etp·ep·edp·pp``; ``dp`` and ``edp`` are derived. Names follow
    Megatron-LM: ``vpp`` is the number of virtual stages per pipeline rank (1 = no interleaving),
    ``sequence_parallel`` defaults to on whenever ``tp > 1`` (Megatron requires it for MoE),
    ``recompute_num_layers`` is how many layers per stage a 'full' recompute covers (0 = all).
    ``overlap_moe_expert_parallel_comm`` hides the EP all-to-all of one micro-batch behind another's compute.
    ``moe_shared_expert_overlap`` (Megatron's ``--moe-shared-expert-overlap``) runs the shared experts' GEMMs
    while the dispatch all-to-all of the same micro-batch is in flight.
    ``cuda_graphs`` replays each decoder layer's static part from CUDA graphs (one launch per captured region
    and pass instead of its kernels'): what it covers is :func:`spec.validity.cuda_graph_scope`, where it holds
    the rule book's ``cuda_graphs*`` rules (Megatron's ``--cuda-graph-impl`` / ``--cuda-graph-scope``).
    ``optimizer_cpu_offload_fraction`` (Megatron's ``--optimizer-cpu-offload --optimizer-offload-fraction``): the
    share of each rank's optimizer state (fp32 master weights + Adam moments) kept in CPU memory and stepped
    there; it needs the distributed optimizer, as Megatron's does. ``activation_offload_modules``: modules of
    :data:`ACTIVATION_OFFLOAD_MODULES` whose saved activations go to pinned CPU memory in forward and come back
    in backward (not with full recompute, nor for a module that is also recomputed).
    ``exp_avg_dtype``, ``exp_avg_sq_dtype``, ``main_params_dtype`` (Megatron's precision-aware optimizer,
    ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` / ``--main-params-dtype``, words of
    :mod:`spec.optimizer_dtypes`): the dtypes the optimizer keeps its Adam moments and master weights in; all
    fp32 by default. Any other needs the distributed optimizer, as Megatron's does.
    The pipeline placement options are Megatron's (``spec.pipeline_layout``): ``pipeline_layout``
    (``--pipeline-model-parallel-layout``, stored without its cosmetic commas; it fixes pp·vpp),
    ``decoder_first/last_pipeline_num_layers`` and ``account_for_embedding/loss_in_pipeline_split``; none
    given, the layers split into pp·vpp chunks that differ by at most one.
    ``cp_comm_type`` (Megatron's ``--cp-comm-type``, :mod:`spec.cp_comm_types`): how context parallelism
    exchanges K/V (allgather, p2p, a2a, a2a+p2p); ``hierarchical_context_parallel_sizes`` (a2a size, p2p size)
    split the CP group for a2a+p2p (Megatron's ``--hierarchical-context-parallel-sizes``).
    """

    world_size: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    micro_batch_size: int = 1
    sequence_parallel: bool | None = None
    recompute_granularity: str = "none"
    recompute_modules: tuple[str, ...] = ()
    recompute_num_layers: int = 0
    moe_token_dispatcher_type: str = DEFAULT_DISPATCHER
    use_distributed_optimizer: bool = True
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    tp_comm_overlap: bool = False
    overlap_moe_expert_parallel_comm: bool = False
    moe_shared_expert_overlap: bool = False
    cuda_graphs: bool = False
    optimizer_cpu_offload_fraction: float = 0.0
    activation_offload_modules: tuple[str, ...] = ()
    pipeline_layout: str | None = None
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    cp_comm_type: str = DEFAULT_CP_COMM
    hierarchical_context_parallel_sizes: tuple[int, ...] | None = None
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    main_params_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.pipeline_layout is not None:
            object.__setattr__(self, "pipeline_layout", canonical_layout(str(self.pipeline_layout)))
        if isinstance(self.recompute_modules, (list, set)):
            object.__setattr__(self, "recompute_modules", tuple(self.recompute_modules))
        if isinstance(self.hierarchical_context_parallel_sizes, list):
            object.__setattr__(self, "hierarchical_context_parallel_sizes",
                               tuple(self.hierarchical_context_parallel_sizes))
        if not isinstance(self.activation_offload_modules, str):
            object.__setattr__(self, "activation_offload_modules", _module_order(self.activation_offload_modules))
        if self.sequence_parallel is None:
            object.__setattr__(self, "sequence_parallel", self.tp > 1)
        if self.recompute_granularity == "selective" and not self.recompute_modules:
            object.__setattr__(self, "recompute_modules", DEFAULT_SELECTIVE_MODULES)
        # types and ranges only: how the sizes fold the world and which knobs go together are rules of the
        # rule book (spec.layout_rules, spec.validity.check), which names the rule a layout breaks
        p: list[str] = []
        positive_ints(p, self, ("world_size", "tp", "cp", "pp", "vpp", "ep", "etp", "micro_batch_size"))
        raise_if(p, "parallel config")
        require(p, self.recompute_granularity in RECOMPUTE_GRANULARITIES,
                f"recompute_granularity must be one of {RECOMPUTE_GRANULARITIES}, got {self.recompute_granularity!r}")
        bad = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
        require(p, not bad, f"unknown recompute_modules {bad}; known: {RECOMPUTE_MODULES}")
        require(p, self.recompute_num_layers >= 0, f"recompute_num_layers must be >= 0, got {self.recompute_num_layers}")
        p += _offload_problems(self)
        p += vocabulary_problems(self.optimizer_dtypes)
        require(p, self.moe_token_dispatcher_type in DISPATCHERS,
                f"moe_token_dispatcher_type must be one of {DISPATCHERS}, got {self.moe_token_dispatcher_type!r}")
        require(p, self.cp_comm_type in CP_COMM_TYPES,
                f"cp_comm_type must be one of {CP_COMM_TYPES}, got {self.cp_comm_type!r}")
        sizes = self.hierarchical_context_parallel_sizes
        require(p, sizes is None or (isinstance(sizes, tuple) and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes)),
                f"hierarchical_context_parallel_sizes must be positive integers, got {sizes!r}")
        p += self.pipeline_split.problems()
        if p:
            raise InvalidConfigError("invalid parallel config: " + "; ".join(p))

    @property
    def dp(self) -> int:
        """Data-parallel size of the attention/dense layout (rounded down where tp·cp·pp does not divide the
        world: the rule book's world_dense rule, which a layout must pass before it is used)."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        """Expert data-parallel size of the MoE layout (rounded down where etp·ep·pp does not divide the world:
        the rule book's world_expert rule)."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def pipeline_split(self) -> PipelineSplit:
        """Megatron's pipeline placement options of this layout (``spec.pipeline_layout``)."""
        if (self.pipeline_layout is None and self.decoder_first_pipeline_num_layers is None
                and self.decoder_last_pipeline_num_layers is None and not self.account_for_embedding_in_pipeline_split
                and not self.account_for_loss_in_pipeline_split):
            return DEFAULT_SPLIT
        return PipelineSplit(self.pipeline_layout, self.decoder_first_pipeline_num_layers,
                             self.decoder_last_pipeline_num_layers, self.account_for_embedding_in_pipeline_split,
                             self.account_for_loss_in_pipeline_split)

    @property
    def cp_split(self) -> tuple[int, int]:
        """(a2a size, ring size) of the CP group under ``cp_comm_type`` (:func:`spec.cp_comm_types.cp_split`)."""
        return cp_split(self.cp_comm_type, self.cp, self.hierarchical_context_parallel_sizes)

    @property
    def optimizer_dtypes(self) -> tuple[str, str, str]:
        """(exp_avg, exp_avg_sq, main_params) dtypes of the optimizer state (:mod:`spec.optimizer_dtypes`)."""
        return (self.exp_avg_dtype, self.exp_avg_sq_dtype, self.main_params_dtype)

    @property
    def use_precision_aware_optimizer(self) -> bool:
        """Whether Megatron runs this layout with ``--use-precision-aware-optimizer``: a state dtype other than
        fp32, or optimizer CPU offload (Megatron's hybrid device optimizer runs on that code path)."""
        return is_precision_aware(self.optimizer_dtypes) or bool(self.optimizer_cpu_offload_fraction)

    def num_micro_batches(self, global_batch_size: int) -> int:
        """Micro-batches per pipeline per step (gradient-accumulation steps)."""
        return global_batch_size // (self.micro_batch_size * self.dp)

    # ---- field form: the fast path for layouts a Validator has already accepted --------------------
    def field_values(self) -> dict[str, Any]:
        """Every field by name (a template for :meth:`trusted`)."""
        return dict(self.__dict__)

    @classmethod
    def trusted(cls, *parts: dict[str, Any]) -> ParallelConfig:
        """A config from field mappings merged left to right (the first one complete, e.g. from
        :meth:`field_values`), without the checks of the constructor.

        Only for layouts whose every field is already known to be valid: the planner builds hundreds of
        thousands of configs that its Validator has just accepted, and the constructor's checks cost a few
        microseconds each.
        """
        cfg = object.__new__(cls)
        d = cfg.__dict__
        for part in parts:
            d.update(part)
        return cfg

    def replace(self, **changes: Any) -> ParallelConfig:
        return replace(self, **changes)


def _module_order(modules) -> tuple[str, ...]:
    """Known offload modules in vocabulary order (one spelling per set), unknown ones after, as given."""
    known = [m for m in ACTIVATION_OFFLOAD_MODULES if m in modules]
    return tuple(known + [m for m in modules if m not in ACTIVATION_OFFLOAD_MODULES])


def _offload_problems(cfg: ParallelConfig) -> list[str]:
    """What is wrong with the offload knobs of ``cfg`` on their own (a fraction out of range, an unknown module)."""
    p: list[str] = []
    f = cfg.optimizer_cpu_offload_fraction
    if not isinstance(f, (int, float)) or isinstance(f, bool) or not 0.0 <= f <= 1.0:
        p.append(f"optimizer_cpu_offload_fraction must be a fraction in [0, 1], got {f!r}")
    bad = [m for m in cfg.activation_offload_modules if m not in ACTIVATION_OFFLOAD_MODULES]
    if bad:
        p.append(f"unknown activation_offload_modules {bad}; known: {ACTIVATION_OFFLOAD_MODULES}")
    return p


__all__ = ["ACTIVATION_OFFLOAD_MODULES", "DEFAULT_SELECTIVE_MODULES", "OPTUNA_PARAMS", "PIPELINE_FIELDS",
           "RECOMPUTE_GRANULARITIES", "RECOMPUTE_MODULES", "Labelled", "ParallelConfig"]
