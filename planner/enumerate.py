"""Enumerate every valid folded layout of a (model, training, cluster), counting what each rule rejects.

The search space is a product of candidate axes:

- (tp, cp, pp, dp): every ordered factorisation of the world size, except CP degrees that would cut the
  sequence into chunks shorter than ``SearchSpace.cp_min_chunk_tokens`` (128 by default: the load-balanced
  causal split gives each CP rank two chunks of seq/(2·cp) tokens, and below one 128-row flash-attention
  tile per chunk the attention kernel and every GEMM run mostly empty);
- vpp: 1 .. ``SearchSpace.vpp_max`` (4 by default: more virtual stages only shave a bubble that is
  already (pp-1)/(vpp·m) small, and multiply the p2p traffic; Megatron itself has no cap, so a user may
  raise it up to ``VPP_LIMIT``); with a Megatron layout string (``SearchSpace.pipeline``) pp·vpp is the
  string's chunk count, so each pp has at most one vpp, whatever the cap;
- the pipeline placement: Megatron's options in ``SearchSpace.pipeline`` (``spec.pipeline_layout``), the
  same for every layout (the ``layers_pp`` rule rejects the pp/vpp they do not fit);
- (ep, etp, edp): every ordered factorisation of world / pp, except ETP degrees that leave each rank fewer
  than ``SearchSpace.expert_ffn_min_columns`` columns of an expert's FFN (128 by default: one GEMM tile;
  below it the grouped GEMM runs mostly empty while ETP still moves every token);
- micro_batch_size: 1 .. ``SearchSpace.mbs_max`` (8 by default; larger micro-batches rarely help an MoE
  GEMM that already has seq·mbs/tp/cp rows, and cost activation memory);
- recompute: a chain of increasing recomputation (the ranker needs each option to save memory and cost time
  over the one before). MoE models (:data:`MOE_RECOMPUTE`): none, selective(layernorm+moe_act) (what
  Megatron's MoE recipes run), selective(core_attn+moe_act+layernorm), that plus mla_up_proj (Megatron's
  DeepSeek recipe), full (uniform, every layer); core_attn alone is left out there because the cost model
  finds it saving less memory than layernorm+moe_act for about the same time (measured on the catalog's
  Qwen3, Mixtral and DeepSeek models: it would break the chain). Dense models (:data:`RECOMPUTE_OPTIONS`):
  none, selective(core_attn), selective(core_attn+moe_act+layernorm), full. Options a model cannot use
  are rejected by the ``recompute_modules`` rule; those the executor does not build (mla_up_proj) stay
  priced and are filtered where layouts must run (``planner.runnable``, rule ``executor_recompute``);
- dispatcher: every name of ``SearchSpace.dispatchers`` (the executor's: alltoall, allgather; Megatron's flex
  dispatcher too under ``plan --megatron``, and only where Megatron's ``flex_dispatcher`` rule allows it) when
  tokens leave the GPU (ep·etp > 1), except that by
  default (``SearchSpace.gathering_within_node``) a dispatcher that gathers every token (allgather: every
  token to all etp·ep ranks instead of its top-k experts' ranks, which only pays off for small groups on
  NVLink) is tried only while the ETP·EP group fits in one node; with ep·etp = 1 every dispatcher only
  permutes locally, so only the default (alltoall) is considered;
- EP all-to-all overlap (``overlap_moe_expert_parallel_comm``, ``SearchSpace.ep_overlap``): tried beside the
  plain alltoall dispatcher where Megatron allows it (ep > 1, no full recompute, vpp > 1 when pp > 1: the
  ``ep_overlap`` rule); it rides the dispatcher axis as the option ``DispatchOption("alltoall", ep_overlap=True)``;
- shared-expert overlap (``moe_shared_expert_overlap``, ``SearchSpace.shared_overlap``): tried beside the plain
  alltoall dispatcher for a model with shared experts where there is an EP all-to-all to hide them under (ep > 1:
  the ``shared_overlap`` rule), as the option ``DispatchOption("alltoall", shared_overlap=True)``;
- CUDA graphs (``cuda_graphs``, ``SearchSpace.cuda_graphs``): on GPU clusters, where the executor captures them
  (tp = cp = pp = 1: the ``executor_cuda_graphs`` rule; foldtune prices the launches its own executor saves, and
  at larger tp or pp a layout's GPU work sets its step time anyway), every dispatcher option but the EP overlap is
  tried once more with the layers' static parts replayed from CUDA graphs, as the option
  ``DispatchOption(..., cuda_graphs=True)``, with the recompute options the ``cuda_graphs_recompute`` rule leaves
  (the chain's prefix before the first that recomputes the captured attention half: none, in the default chains);
  not when the space offloads a captured module's activations;
- CP communication type (``SearchSpace.cp_comm_types``, :mod:`spec.cp_comm_types`) for every cp > 1: allgather,
  p2p and a2a (where the ``cp_a2a_heads`` rule lets the heads split over tp·cp), and a2a+p2p only where the CP
  group spans nodes, split as ``a`` = the CP ranks one node holds (the all-to-all on NVLink) by the ``cp / a``
  nodes (the ring over the network), with a, cp / a >= 2 and the heads rule at tp·a; other splits are valid
  layouts (``cp_comm=a2a+p2p:AxP``) the planner does not try. With cp = 1 the type changes nothing: allgather;
- distributed optimizer: on and off, or the one the training spec forces;
- precision (opt-in, ``SearchSpace.precisions``): by default only the training spec's precision is planned;
  a space that lists several (e.g. bf16 and fp8) has each planned as a whole (``planner.rank.plan_precisions``:
  the precision changes the GEMM peak, so every layout is re-priced), fp8 only on GPUs with an fp8 peak and
  bf16 otherwise. It is not an axis of this enumeration: each precision's is the same set of layouts.
- offload (``SearchSpace.optimizer_offload`` fractions and ``SearchSpace.activation_offload`` module sets, none by
  default): every combination beside no offload is an offload option. An option with optimizer offload keeps
  only the distributed optimizer (Megatron's offload lives in it), one with activation offload drops the
  recompute options that recompute an offloaded module or the whole layer. Each option's configs are valid
  configs of their own (counted in ``valid`` and ``considered`` alike); the ranker scans them option by option.
- the precision-aware optimizer (``SearchSpace.optimizer_dtypes``: (exp_avg, exp_avg_sq, main_params) triples,
  none by default): each triple rides the same options as offload does (less memory for a little more optimizer
  time), every offload option once per triple; a triple other than fp32 keeps only the distributed optimizer
  (Megatron's ``precision_aware_distopt`` rule), and one whose master weights are not fp32 is dropped for fp32
  training (the ``main_params_half_params`` rule).

Sequence parallelism is on whenever tp > 1; gradient-reduce overlap is on, parameter-gather overlap is
on with the distributed optimizer. "Considered" is the size of that product; every considered config is
either valid or counted under the first rule it breaks, checked in the order of :data:`RULE_ORDER` (the
order in which the enumeration binds the axes), so considered = valid + sum of rejections.

Nothing per configuration is materialised here: the result lists *layouts* (tp, cp, pp, vpp, ep, etp) with
the micro-batch sizes and dispatchers valid for each; the knobs multiply out lazily in :meth:`Enumeration.configs`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from spec.cp_comm_types import CP_COMM_TYPES, DEFAULT_CP_COMM, HIERARCHICAL
from spec.dispatchers import DISPATCHERS, EXECUTOR_DISPATCHERS, GATHERING_DISPATCHERS, MEGATRON_ONLY_DISPATCHERS
from spec.errors import InvalidConfigError
from spec.hardware import ClusterSpec, GPUSpec
from spec.layout_rules import (activation_offload_problem, main_params_problem, optimizer_offload_problem,
                               precision_aware_problem)
from spec.model_spec import ModelSpec
from spec.layout_codec import ACTIVATION_OFFLOAD_MODULES, PIPELINE_FIELDS, placement_label
from spec.optimizer_dtypes import FIELDS as OPTIMIZER_DTYPE_FIELDS, FP32_STATES, dtypes_text, vocabulary_problems
from spec.parallel_config import ParallelConfig
from spec.pipeline_layout import DEFAULT_SPLIT, PipelineSplit
from spec.rank_groups import GridSizes, group_stride_span
from spec.training_spec import PRECISIONS, TrainingSpec
from spec.validity import (CUDA_GRAPH_MODULES, Rejection, Validator, cuda_graphs_rule,
                           ep_overlap_recomputes_whole_layers, ep_overlap_rule, flex_dispatcher_rule,
                           needs_distributed_optimizer)

# (granularity, modules) in order of increasing recomputation: less memory, more time.
RECOMPUTE_OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("none", ()),
    ("selective", ("core_attn",)),
    ("selective", ("core_attn", "moe_act", "layernorm")),
    ("full", ()),
)
MOE_RECOMPUTE: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("none", ()),
    ("selective", ("layernorm", "moe_act")),
    ("selective", ("core_attn", "moe_act", "layernorm")),
    ("selective", ("core_attn", "moe_act", "layernorm", "mla_up_proj")),
    ("full", ()),
)
VPP_LIMIT = 64  # the largest vpp_max a search space accepts (a bound on the enumeration, not Megatron's)

class KnobOption(NamedTuple):
    """One option of the knobs that trade memory for time beside the layout (the ranker scans each on its own):
    the optimizer CPU offload fraction, the activation-offloaded modules and the optimizer state dtypes
    (exp_avg, exp_avg_sq, main_params)."""

    optimizer_offload: float
    activation_offload: tuple[str, ...]
    optimizer_dtypes: tuple[str, str, str] = FP32_STATES


NO_OFFLOAD = KnobOption(0.0, ())  # no offload, fp32 optimizer state


class DispatchOption(NamedTuple):
    """One value of the enumeration's dispatcher axis: a token dispatcher of ``spec.dispatchers``, and whether
    the EP all-to-all overlap (``overlap_moe_expert_parallel_comm``) or the shared-expert overlap
    (``moe_shared_expert_overlap``) rides on it."""

    dispatcher: str
    ep_overlap: bool = False
    shared_overlap: bool = False  # moe_shared_expert_overlap: the shared experts under the dispatch all-to-all
    cuda_graphs: bool = False  # the layers' static parts replayed from CUDA graphs

    def fields(self) -> dict:
        """The ParallelConfig fields of this option."""
        return {"moe_token_dispatcher_type": self.dispatcher, "overlap_moe_expert_parallel_comm": self.ep_overlap,
                "moe_shared_expert_overlap": self.shared_overlap, "cuda_graphs": self.cuda_graphs}


class CpCommOption(NamedTuple):
    """One value of the enumeration's CP communication axis: a type of ``spec.cp_comm_types`` and, for a2a+p2p,
    its (a2a size, p2p size)."""

    cp_comm_type: str = DEFAULT_CP_COMM
    sizes: tuple[int, int] | None = None

    def fields(self) -> dict:
        """The ParallelConfig fields of this option."""
        return {"cp_comm_type": self.cp_comm_type, "hierarchical_context_parallel_sizes": self.sizes}


DEFAULT_CP_OPTION = CpCommOption()
GRAPHED = DispatchOption("alltoall", cuda_graphs=True)  # any option with CUDA graphs: its recompute count


RULE_ORDER: tuple[str, ...] = ("fp8_hardware", "heads_tp", "kv_heads_tp", "hidden_tp", "ffn_tp", "seq_cp",
                               "cp_a2a_heads", "vpp_needs_pp", "layers_pp", "gbs_mbs_dp", "vpp_microbatches",
                               "experts_ep", "expert_ffn_etp", "recompute_modules", "ep_overlap",
                               "cuda_graphs_recompute")


@dataclass(frozen=True)
class SearchSpace:
    """The candidate values beside the layout axes (see the module docstring for the defaults' reasons)."""

    mbs_max: int = 8
    vpp_max: int = 4
    cp_min_chunk_tokens: int = 128
    expert_ffn_min_columns: int = 128
    gathering_within_node: bool = True
    recompute: tuple[tuple[str, tuple[str, ...]], ...] | None = None  # None: the chain for the model
    # the executor's dispatchers by default; Megatron-only ones (the flex dispatcher) when asked
    # (:meth:`with_megatron_dispatchers`, ``plan --megatron``) or named here
    dispatchers: tuple[str, ...] = EXECUTOR_DISPATCHERS
    ep_overlap: bool = True
    shared_overlap: bool = True
    cuda_graphs: bool = True  # tried on GPU clusters (the rule book's cuda_graphs_device)
    pipeline: PipelineSplit = DEFAULT_SPLIT
    # precisions searched as a knob (:meth:`precisions_for`); None: the training spec's precision alone
    precisions: tuple[str, ...] | None = None
    optimizer_offload: tuple[float, ...] = ()  # optimizer CPU offload fractions tried beside 0
    activation_offload: tuple[tuple[str, ...], ...] = ()  # activation offload module sets tried beside none
    cp_comm_types: tuple[str, ...] = CP_COMM_TYPES  # the CP communication types tried for cp > 1
    # (exp_avg, exp_avg_sq, main_params) optimizer state dtypes tried beside fp32 (the precision-aware optimizer)
    optimizer_dtypes: tuple[tuple[str, str, str], ...] = ()

    def __post_init__(self) -> None:
        bad = [f for f in self.optimizer_offload if not 0.0 < f <= 1.0]
        if bad:
            raise InvalidConfigError(f"optimizer offload fractions must be in (0, 1], got {bad}")
        unknown = sorted({m for mods in self.activation_offload for m in mods} - set(ACTIVATION_OFFLOAD_MODULES))
        if unknown:
            raise InvalidConfigError(f"unknown activation offload modules {unknown}; known: "
                                     f"{', '.join(ACTIVATION_OFFLOAD_MODULES)}")
        for dtypes in self.optimizer_dtypes:
            problems = vocabulary_problems(tuple(dtypes)) if len(dtypes) == 3 else [
                f"optimizer dtypes are (exp_avg, exp_avg_sq, main_params), got {dtypes!r}"]
            problems += [main_params_problem(dtypes[2])] if not problems and main_params_problem(dtypes[2]) else []
            if problems:
                raise InvalidConfigError("searched optimizer dtypes: " + "; ".join(problems))
        if self.precisions is not None:
            bad = [p for p in self.precisions if p not in PRECISIONS]
            if bad or not self.precisions:
                raise InvalidConfigError(f"searched precisions must be among {', '.join(PRECISIONS)}, got "
                                         f"{', '.join(map(repr, self.precisions)) or 'none'}")
        if not 1 <= self.vpp_max <= VPP_LIMIT:
            raise InvalidConfigError(f"vpp_max must be in 1..{VPP_LIMIT}, got {self.vpp_max}")
        problems = self.pipeline.problems()
        if problems:
            raise InvalidConfigError("; ".join(problems))
        # configs of the enumeration are built unchecked (ParallelConfig.trusted), so an unknown dispatcher
        # name must fail here rather than reach the cost model as a config ParallelConfig would refuse
        unknown = [d for d in self.dispatchers if d not in DISPATCHERS]
        if unknown:
            raise InvalidConfigError(f"unknown dispatcher {', '.join(map(repr, unknown))} in the search space; "
                                     f"dispatchers are {', '.join(DISPATCHERS)}")
        unknown = [c for c in self.cp_comm_types if c not in CP_COMM_TYPES]
        if unknown or not self.cp_comm_types:
            raise InvalidConfigError(f"CP communication types of the search space must be among "
                                     f"{', '.join(CP_COMM_TYPES)}, got {', '.join(map(repr, self.cp_comm_types))}")

    def with_megatron_dispatchers(self) -> SearchSpace:
        """This space with Megatron's own dispatchers (:data:`spec.dispatchers.MEGATRON_ONLY_DISPATCHERS`)
        added, for a ranking of what Megatron-Core runs; unchanged when it names them already."""
        extra = tuple(d for d in MEGATRON_ONLY_DISPATCHERS if d not in self.dispatchers)
        return replace(self, dispatchers=self.dispatchers + extra) if extra else self

    def precisions_for(self, training: TrainingSpec, gpu: GPUSpec) -> tuple[str, ...]:
        """The precisions planned: the training spec's alone by default; else those of ``precisions`` the GPU
        runs, fp8 only where it has an fp8 peak (bf16 where that leaves none)."""
        if self.precisions is None:
            return (training.precision,)
        kept = tuple(dict.fromkeys(p for p in self.precisions if p != "fp8" or gpu.supports_fp8))
        return kept or ("bf16",)

    def offload_options(self, training: TrainingSpec | None = None) -> tuple[KnobOption, ...]:
        """No offload and fp32 optimizer state first, then every (fraction, module set, optimizer dtypes)
        combination the space tries; with ``training``, less the dtypes whose master weights it cannot have
        (fp32 training: fp32 weights are their own master weights)."""
        options = [NO_OFFLOAD]
        dtype_options = (FP32_STATES,) + tuple(tuple(d) for d in self.optimizer_dtypes)
        if training is not None and training.param_bytes == 4:
            dtype_options = tuple(d for d in dtype_options if d[2] == "fp32")
        for dtypes in dtype_options:
            for fraction in (0.0,) + tuple(self.optimizer_offload):
                for mods in ((),) + tuple(self.activation_offload):
                    option = KnobOption(float(fraction), tuple(m for m in ACTIVATION_OFFLOAD_MODULES if m in mods),
                                        dtypes)
                    if option not in options:
                        options.append(option)
        return tuple(options)

    def recompute_for(self, model: ModelSpec) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """The recompute chain tried for ``model`` (see the module docstring)."""
        if self.recompute is not None:
            return self.recompute
        return MOE_RECOMPUTE if model.is_moe else RECOMPUTE_OPTIONS

    def allows_cp(self, cp: int, seq_length: int) -> bool:
        """Whether ``cp`` is in the search space (CP chunks of at least ``cp_min_chunk_tokens``)."""
        return cp == 1 or seq_length // (2 * cp) >= self.cp_min_chunk_tokens

    def cp_comm_options(self, tp: int, cp: int, gpus_per_node: int) -> tuple[CpCommOption, ...]:
        """The CP communication options tried with ``tp`` and ``cp`` (see the module docstring): the default alone
        for cp = 1; the hierarchical one only where the CP group spans nodes, split by the ranks a node holds."""
        if cp <= 1:
            return (DEFAULT_CP_OPTION,)
        out = []
        for name in self.cp_comm_types:
            if name != HIERARCHICAL:
                out.append(CpCommOption(name))
                continue
            group = GridSizes(tp=tp, cp=cp).group("cp")
            nodes = group_stride_span(group.stride, cp, gpus_per_node)
            if nodes > 1 and cp // nodes >= 2:
                out.append(CpCommOption(name, (cp // nodes, nodes)))
        return tuple(out) or (DEFAULT_CP_OPTION,)

    def allows_etp(self, etp: int, model: ModelSpec) -> bool:
        """Whether ``etp`` is in the search space (expert FFN shards of at least ``expert_ffn_min_columns``)."""
        return etp == 1 or not model.is_moe or model.expert_ffn_hidden_size // etp >= self.expert_ffn_min_columns

    def dispatchers_for(self, ep: int, etp: int, moe: bool, gpus_per_node: int,
                        shared_experts: bool = False, gpu: bool = False) -> tuple[DispatchOption, ...]:
        """The dispatcher options tried for an expert layout (see the module docstring); with EP the alltoall
        one also with the EP overlap when ``ep_overlap`` is searched (the ``ep_overlap`` rule then decides per
        pp/vpp and recompute), and for a model with ``shared_experts`` with the shared-expert overlap when
        ``shared_overlap`` is searched (valid wherever it is tried); on a ``gpu`` cluster every option but the
        EP overlap once more with CUDA graphs when ``cuda_graphs`` is searched (:meth:`graphs_searched`)."""
        group = ep * etp
        if not moe or group == 1:
            names = self.dispatchers[:1]
        elif self.gathering_within_node and group > gpus_per_node:
            names = tuple(d for d in self.dispatchers if d not in GATHERING_DISPATCHERS) or self.dispatchers[:1]
        else:
            names = self.dispatchers
        options = tuple(DispatchOption(name) for name in names)
        if moe and group > 1 and self.ep_overlap and ep > 1 and "alltoall" in names:
            options += (DispatchOption("alltoall", ep_overlap=True),)
        if moe and shared_experts and self.shared_overlap and ep > 1 and "alltoall" in names:
            options += (DispatchOption("alltoall", shared_overlap=True),)
        if gpu and self.graphs_searched():
            options += tuple(d._replace(cuda_graphs=True) for d in options if not d.ep_overlap)
        return options

    def graphs_searched(self) -> bool:
        """Whether CUDA graphs are tried (on GPU clusters): asked for, and no offloaded module set holds a part
        they capture (the ``cuda_graphs_recompute`` rule)."""
        return self.cuda_graphs and not any(m in CUDA_GRAPH_MODULES for mods in self.activation_offload for m in mods)

    def vpps_for(self, pp: int) -> range | tuple[int, ...]:
        """The vpp values tried with ``pp`` (a layout string fixes pp·vpp: at most one)."""
        chunks = self.pipeline.num_chunks()
        if chunks is None:
            return range(1, self.vpp_max + 1)
        return (chunks // pp,) if chunks % pp == 0 else ()

    def describe(self) -> str:
        """One line naming the caps of this search space."""
        vpp = (f"vpp from the layout's {self.pipeline.num_chunks()} chunks" if self.pipeline.layout is not None
               else f"vpp <= {self.vpp_max}")
        text = (f"micro-batch <= {self.mbs_max}, {vpp}, CP chunks >= {self.cp_min_chunk_tokens} "
                f"tokens, expert FFN shards >= {self.expert_ffn_min_columns} columns, "
                f"{'/'.join(GATHERING_DISPATCHERS)} dispatcher "
                f"{'within a node' if self.gathering_within_node else 'everywhere'}"
                f"{', EP a2a overlap tried' if self.ep_overlap else ''}"
                f"{', shared-expert overlap tried' if self.shared_overlap else ''}"
                f"{', CUDA graphs tried on GPUs' if self.graphs_searched() else ''}"
                f", CP {'/'.join(self.cp_comm_types)}"
                f"{f' ({HIERARCHICAL} where CP spans nodes)' if HIERARCHICAL in self.cp_comm_types else ''}")
        if self.optimizer_offload:
            text += ", optimizer offload " + "/".join(f"{f:g}" for f in self.optimizer_offload) + " tried"
        if self.activation_offload:
            text += ", activation offload " + "/".join("+".join(m) for m in self.activation_offload) + " tried"
        if self.optimizer_dtypes:
            text += (", optimizer state " + "/".join(dtypes_text(tuple(d)) for d in self.optimizer_dtypes)
                     + " (exp_avg+exp_avg_sq+main_params) tried")
        placement = placement_label(self.pipeline)
        return text + (f", pipeline {placement}" if placement else "")


def pipeline_fields(split: PipelineSplit) -> dict:
    """ParallelConfig's pipeline placement fields for ``split``."""
    values = (split.layout, split.first, split.last, split.embedding, split.loss)
    return dict(zip(PIPELINE_FIELDS, values))


class StaircaseKey(NamedTuple):
    """One memory staircase of the ranker (planner.rank): a layout's expert and dense shape, one dispatcher
    option and one optimizer choice; the staircase a vpp lower is its first guess."""

    tp: int
    cp: int
    pp: int
    ep: int
    etp: int
    dispatcher: DispatchOption
    optimizer_choice: int
    cp_comm: CpCommOption


class BoundKey(NamedTuple):
    """The layouts whose steady-state time bound is one (planner.rank): the bound does not depend on pp or vpp."""

    tp: int
    cp: int
    ep: int
    etp: int
    dispatcher: DispatchOption
    micro_batch_size: int
    cp_comm: CpCommOption


_new = tuple.__new__


@dataclass(frozen=True)
class Layout:
    """One valid folded layout; ``stage_layers`` are the decoder layers of each pipeline rank."""

    tp: int
    cp: int
    pp: int
    vpp: int
    ep: int
    etp: int
    dp: int
    edp: int
    stage_layers: tuple[int, ...]
    micro_batch_sizes: tuple[int, ...]  # the valid ones, ascending
    dispatchers: tuple[DispatchOption, ...]
    cp_comm: CpCommOption = DEFAULT_CP_OPTION

    def staircase_key(self, dispatcher: DispatchOption, optimizer_choice: int) -> StaircaseKey:
        """The key of this layout's memory staircase with ``dispatcher`` and the optimizer choice (an index)."""
        return _new(StaircaseKey, (self.tp, self.cp, self.pp, self.ep, self.etp, dispatcher, optimizer_choice,
                                   self.cp_comm))

    def bound_key(self, dispatcher: DispatchOption, micro_batch_size: int) -> BoundKey:
        """The key of the steady-state time bound this layout shares with ``dispatcher`` and the micro-batch size."""
        return _new(BoundKey, (self.tp, self.cp, self.ep, self.etp, dispatcher, micro_batch_size, self.cp_comm))


def divisors(n: int) -> list[int]:
    """Divisors of ``n`` in ascending order."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@dataclass
class Enumeration:
    """Every valid layout plus the bookkeeping: how many configs were considered and why the others failed."""

    world_size: int
    layouts: list[Layout]
    recompute: tuple[tuple[str, tuple[str, ...]], ...]  # the options valid for this model
    distributed_optimizer: tuple[bool, ...]
    considered: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    examples: dict[str, Rejection] = field(default_factory=dict)

    offload: tuple[KnobOption, ...] = (NO_OFFLOAD,)

    @property
    def valid(self) -> int:
        """Number of valid complete configs (layouts times their knobs, every offload option)."""
        # micro-batch sizes per set of dispatcher options: a handful of sets, whose recompute counts are summed once
        # (the planner and its report read this count several times; per layout it took ~10 ms on 2·10^4 layouts)
        sizes: dict[tuple[DispatchOption, ...], int] = {}
        for lay in self.layouts:
            sizes[lay.dispatchers] = sizes.get(lay.dispatchers, 0) + len(lay.micro_batch_sizes)
        total = 0
        for option in self.offload:
            distopts, chain = self.knobs_for(option)
            total += sum(n * sum(recompute_count(chain, d) for d in dispatchers)
                         for dispatchers, n in sizes.items()) * len(distopts)
        return total

    def knobs_for(self, option: KnobOption):
        """(distributed-optimizer settings, recompute options) valid with a knob option (module docstring)."""
        fraction, modules, dtypes = option  # the rule book's offload and precision-aware optimizer rules
        distopts = tuple(d for d in self.distributed_optimizer if optimizer_offload_problem(fraction, d) is None
                         and precision_aware_problem(dtypes, d) is None)
        chain = tuple((g, m) for g, m in self.recompute if activation_offload_problem(g, m, modules) is None)
        return distopts, chain

    def recompute_count(self, dispatcher: DispatchOption) -> int:
        """How many of the recompute options (a prefix of ``recompute``) go with a dispatcher option: EP
        overlap excludes full recompute (the ``ep_overlap`` rule), which closes the chain."""
        return recompute_count(self.recompute, dispatcher)

    def _reject(self, rejection: Rejection, count: int) -> None:
        if count:
            self.rejected[rejection.rule] = self.rejected.get(rejection.rule, 0) + count
            self.examples.setdefault(rejection.rule, rejection)

    pipeline: PipelineSplit = DEFAULT_SPLIT

    def configs(self) -> Iterator[ParallelConfig]:
        """Every valid config, layout by layout (micro-batch, dispatcher, optimizer, recompute vary fastest)."""
        for option in self.offload:
            maker = ConfigMaker(self.world_size, self.pipeline, option)
            distopts, chain = self.knobs_for(option)
            for lay in self.layouts:
                for mbs in lay.micro_batch_sizes:
                    for dispatcher in lay.dispatchers:
                        for distopt in distopts:
                            for granularity, modules in chain[:recompute_count(chain, dispatcher)]:
                                yield maker.make(lay, mbs, dispatcher, distopt, granularity, modules)


class ConfigMaker:
    """Builds ParallelConfig objects for layouts the Validator already accepted, without re-validating
    (:meth:`ParallelConfig.trusted`: the planner builds hundreds of thousands of them)."""

    def __init__(self, world_size: int, pipeline: PipelineSplit = DEFAULT_SPLIT,
                 offload: KnobOption = NO_OFFLOAD) -> None:
        # the placement options were checked by the SearchSpace; pp·vpp by the layers_pp rule per layout; the
        # knob option's knobs by Enumeration.knobs_for
        offload = KnobOption(*offload)
        self._template = {**ParallelConfig(world_size=world_size).field_values(), **pipeline_fields(pipeline),
                          "optimizer_cpu_offload_fraction": offload.optimizer_offload,
                          "activation_offload_modules": offload.activation_offload,
                          **dict(zip(OPTIMIZER_DTYPE_FIELDS, offload.optimizer_dtypes))}

    @property
    def template(self) -> dict:
        """Every field of a default config of this world size and placement (a base for ``ParallelConfig.trusted``)."""
        return self._template

    def base(self, lay: Layout, dispatcher: DispatchOption) -> dict:
        """The fields every config of ``lay`` with the dispatcher option ``dispatcher`` shares (pass to
        :meth:`from_base`)."""
        d = dict(self._template)
        d.update(tp=lay.tp, cp=lay.cp, pp=lay.pp, vpp=lay.vpp, ep=lay.ep, etp=lay.etp,
                 sequence_parallel=lay.tp > 1, **dispatcher.fields(), **lay.cp_comm.fields())
        return d

    @staticmethod
    def knobs(distopt: bool, granularity: str, modules: tuple[str, ...]) -> dict:
        """The optimizer and recompute fields (merged over a :meth:`base` by ``ParallelConfig.trusted``)."""
        return {"use_distributed_optimizer": distopt, "overlap_param_gather": distopt,
                "recompute_granularity": granularity, "recompute_modules": modules}

    @classmethod
    def from_base(cls, base: dict, mbs: int, distopt: bool, granularity: str,
                  modules: tuple[str, ...]) -> ParallelConfig:
        return ParallelConfig.trusted(base, cls.knobs(distopt, granularity, modules), {"micro_batch_size": mbs})

    def make(self, lay: Layout, mbs: int, dispatcher: DispatchOption, distopt: bool, granularity: str,
             modules: tuple[str, ...]) -> ParallelConfig:
        return self.from_base(self.base(lay, dispatcher), mbs, distopt, granularity, modules)


def recompute_count(recompute: tuple[tuple[str, tuple[str, ...]], ...], dispatcher: DispatchOption) -> int:
    """See :meth:`Enumeration.recompute_count`; with CUDA graphs the chain stops at its first option that
    recomputes a captured part (the ``cuda_graphs_recompute`` rule)."""
    if dispatcher.cuda_graphs:
        return next((i for i, (g, m) in enumerate(recompute) if graphs_recompute_broken(g, m)), len(recompute))
    if dispatcher.ep_overlap and recompute and ep_overlap_recomputes_whole_layers(recompute[-1][0]):
        return len(recompute) - 1
    return len(recompute)


def graphs_recompute_broken(granularity: str, modules: tuple[str, ...]) -> bool:
    """Whether a recompute option breaks the ``cuda_graphs_recompute`` rule (full, or a captured module)."""
    return granularity == "full" or (granularity == "selective" and any(m in CUDA_GRAPH_MODULES for m in modules))


def distopt_options(training: TrainingSpec) -> tuple[bool, ...]:
    """The distributed-optimizer settings to try: the forced one, or both (on first: it is the usual winner)."""
    if training.distributed_optimizer is None:  # the rule book's optimizer_distopt rule, applied to the options
        return (True,) if needs_distributed_optimizer(training) else (True, False)
    return (training.distributed_optimizer,)


def enumerate_layouts(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec,
                      space: SearchSpace | None = None) -> Enumeration:
    """Every valid layout of ``model`` on ``cluster`` for ``training``, with rejection counts per rule."""
    space = space or SearchSpace()
    v = Validator(model, training, cluster, space.pipeline)
    world = cluster.num_gpus
    moe = model.is_moe
    recompute_ok: list[tuple[str, tuple[str, ...]]] = []
    recompute_bad: list[Rejection] = []
    distopt = distopt_options(training)[0]
    probe = ParallelConfig(world_size=world, use_distributed_optimizer=distopt, overlap_param_gather=distopt)
    chain = space.recompute_for(model)
    for granularity, modules in chain:
        r = v.knobs(probe.replace(recompute_granularity=granularity, recompute_modules=modules))
        if r:
            recompute_bad.append(r)
        else:
            recompute_ok.append((granularity, modules))
    n_opt = len(distopt_options(training))
    n_rec = len(chain)
    result = Enumeration(world_size=world, layouts=[], recompute=tuple(recompute_ok),
                         distributed_optimizer=distopt_options(training), pipeline=space.pipeline)

    # Expert factorisations per pp and the knob leaves under each one. Each pair carries what its layouts share
    # (worked out once here rather than per layout): the first rule it breaks, and whether it has the EP overlap
    # option and that option lacks full recompute.
    gpu = cuda_graphs_rule(probe.replace(cuda_graphs=True), cluster.gpu.name) is None  # CUDA graphs need CUDA ranks
    # keyed by (pp, whether CUDA graphs are tried: only where the executor captures them, tp = cp = pp = 1)
    expert_pairs: dict[tuple[int, bool], list[tuple[int, int, tuple[DispatchOption, ...], Rejection | None, bool,
                                                    bool]]] = {}
    expert_leaves: dict[tuple[int, bool], int] = {}
    for pp in divisors(world):
        rest = world // pp
        for graphs in ((False, True) if pp == 1 and gpu else (False,)):
            pairs = []
            for ep in divisors(rest):
                for etp in divisors(rest // ep):
                    if not space.allows_etp(etp, model):
                        continue
                    names = tuple(d for d in space.dispatchers_for(ep, etp, moe, cluster.gpus_per_node,
                                                                   bool(model.shared_expert_ffn_hidden_size), graphs)
                                  if flex_dispatcher_rule(d.dispatcher, ep, etp, training) is None)
                    overlap = [d for d in names if d.ep_overlap]
                    pairs.append((ep, etp, names, v.ep(ep) or v.etp(etp), bool(overlap),
                                  bool(overlap) and recompute_count(result.recompute, overlap[0]) < len(recompute_ok)))
            expert_pairs[pp, graphs] = pairs
            expert_leaves[pp, graphs] = sum(len(d) for _, _, d, _, _, _ in pairs) * n_rec * n_opt

    # the first recompute option CUDA graphs cannot hold, as the rule book words it
    dropped = [(g, m) for g, m in recompute_ok if graphs_recompute_broken(g, m)]
    graphs_dropped = dropped and cuda_graphs_rule(probe.replace(cuda_graphs=True, recompute_granularity=dropped[0][0],
                                                                recompute_modules=dropped[0][1]), cluster.gpu.name)
    glob = v.global_()
    for tp in divisors(world):
        tp_rej = glob or v.tp(tp)
        for cp in divisors(world // tp):
            if not space.allows_cp(cp, training.seq_length):
                continue
            # the CP communication options of (tp, cp): those a rule rejects are counted, the others ride on every
            # layout below as neighbours (a layout's options next to each other: the ranker shares their memory)
            cp_rej = tp_rej or v.cp(cp)
            cp_options = space.cp_comm_options(tp, cp, cluster.gpus_per_node)
            option_rejs = [cp_rej or v.cp_comm(tp, cp, o.cp_comm_type, o.sizes) for o in cp_options]
            kept = tuple(o for o, r in zip(cp_options, option_rejs) if r is None)
            k = len(kept)
            for pp in divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                graphs = gpu and tp == cp == pp == 1
                per_mbs = expert_leaves[pp, graphs]
                per_vpp = space.mbs_max * per_mbs
                vpps = space.vpps_for(pp)
                result.considered += len(vpps) * per_vpp * len(cp_options)
                for rejection in option_rejs:
                    if rejection is not None:
                        result._reject(rejection, len(vpps) * per_vpp)
                if not kept:
                    continue
                for vpp in vpps:
                    pp_rej = v.pp(pp, vpp)
                    if pp_rej:
                        result._reject(pp_rej, per_vpp * k)
                        continue
                    ok_mbs = []
                    for mbs in range(1, space.mbs_max + 1):
                        b_rej = v.batch(dp, mbs, pp, vpp)
                        if b_rej:
                            result._reject(b_rej, per_mbs * k)
                        else:
                            ok_mbs.append(mbs)
                    if not ok_mbs:
                        continue
                    split = v.split(pp, vpp)
                    n_mbs = len(ok_mbs)
                    sizes = tuple(ok_mbs)
                    for ep, etp, dispatchers, e_rej, overlap, overlap_drops_full in expert_pairs[pp, graphs]:
                        leaves = n_mbs * len(dispatchers) * n_rec * n_opt
                        if e_rej:
                            result._reject(e_rej, leaves * k)
                            continue
                        for bad in recompute_bad:
                            result._reject(bad, n_mbs * len(dispatchers) * n_opt * k)
                        # the rule book's ep_overlap rule, on the overlap option (alltoall, ep > 1) without and
                        # with full recompute
                        overlap_rej = overlap and ep_overlap_rule(ep, "alltoall", "none", pp, vpp)
                        if overlap_rej:
                            result._reject(overlap_rej, n_mbs * len(recompute_ok) * n_opt * k)
                            dispatchers = tuple(d for d in dispatchers if not d.ep_overlap)
                        elif overlap_drops_full:
                            result._reject(ep_overlap_rule(ep, "alltoall", "full", pp, vpp), n_mbs * n_opt * k)
                        graphed = sum(1 for d in dispatchers if d.cuda_graphs)
                        if graphed and graphs_dropped:  # the recompute options the cuda_graphs_recompute rule drops
                            result._reject(graphs_dropped, n_mbs * n_opt * k * graphed
                                           * (len(recompute_ok) - recompute_count(result.recompute, GRAPHED)))
                        for option in kept:
                            result.layouts.append(Layout(tp, cp, pp, vpp, ep, etp, dp, world // (pp * ep * etp),
                                                         split, sizes, dispatchers, option))
    options = space.offload_options(training)
    if len(options) > 1:  # the offload options' configs: valid configs beside those counted above
        base = result.valid
        result.offload = options
        result.considered += result.valid - base
    return result
