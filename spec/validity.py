"""The rule book: :func:`check` returns every rule a layout breaks, each a :class:`Rejection` with a rule id and a
readable reason. Its rules are Megatron-LM's (:data:`RULES`), the rules on a config alone
(:mod:`spec.layout_rules`, listed in :data:`RULES` too), and what ``executor/`` builds (:data:`EXECUTOR_RULES`);
the cost model's preconditions are Megatron rules (:data:`COSTMODEL_RULES`).

Each rule is checked at the level of the enumeration where its variables become known (the model and
the GPU; then tp; cp; pp and vpp; ep; etp; the batch; the knobs), so the enumerator can reject a whole
subtree with one check and count what it rejected. :meth:`Validator.check` runs every rule on one
complete :class:`ParallelConfig` (``foldtune plan --explain``).

Where a rule comes from Megatron-LM (read, not copied, at commit d98e8a6 of NVIDIA/Megatron-LM, Aug 2026):
- heads_tp, kv_heads_tp: ``TransformerConfig.__post_init__`` (``num_query_groups`` must be a multiple *or a
  divisor* of tp: with tp > query groups the KV heads are replicated);
- seq_cp: ``arguments.py`` (seq_length % (2·cp) for the load-balanced causal split);
- world_dense / world_expert: ``arguments.py`` and ``parallel_state`` (tp·cp·pp and etp·ep·pp divide the world);
- experts_ep: ``arguments.py`` (num_experts % ep);
- gbs_mbs_dp: ``num_microbatches_calculator`` (global batch % (micro batch · dp));
- vpp_needs_pp: ``arguments.py``: interleaving needs pp > 1 when p2p communication is overlapped
  (``overlap_p2p_comm``, Megatron's default) and pp > 2 without it. foldtune keeps Megatron's default,
  so the rule is pp > 1;
- vpp_microbatches: ``schedules.py`` (interleaved 1F1B with the default
  ``microbatch_group_size_per_vp_stage = pp`` needs the micro-batch count to be a multiple of pp);
- layers_pp: ``arguments.py`` / ``PipelineParallelLayerLayout`` / ``get_num_layers_to_build`` (num_layers %
  (pp·vpp) unless an explicit ``--pipeline-model-parallel-layout`` places the layers; foldtune emits one for
  uneven splits, so without Megatron's placement options the rule left is one decoder layer per chunk at
  least; with them, what :func:`spec.pipeline_layout.chunk_sizes` demands: a layout string that places every
  decoder and MTP layer, the embedding first and the loss last, in pp·vpp chunks; first/last stage layers
  that leave an even share for the middle ranks; (layers + embedding + loss) % (pp·vpp) when those are
  accounted as layers; every rank's layers a multiple of vpp; see :func:`pipeline_split`);
- sp_with_tp: ``moe_layer.py`` refuses to train MoE with tp > 1 and no sequence parallelism;
- recompute_modules: ``TransformerConfig`` (moe_act needs grouped-GEMM MoE, mla_up_proj needs MLA);
- param_gather_distopt: ``arguments.py`` (overlap_param_gather needs the distributed optimizer);
- ep_overlap: ``TransformerConfig`` (EP all-to-all overlap needs ep > 1, the alltoall dispatcher, no full
  recompute, and vpp when pp > 1);
- pad_to_capacity: ``TransformerConfig`` (``moe_pad_expert_input_to_capacity`` needs
  ``moe_expert_capacity_factor``);
- flex_dispatcher: ``TransformerConfig.__post_init__`` and ``MoEFlexTokenDispatcher.__init__`` (the flex
  dispatcher needs ``--moe-flex-dispatcher-backend deepep|hybridep``, which foldtune's dispatcher name carries,
  exchanges tokens over the TP·EP group so needs etp·ep > 1, and with the deepep backend refuses
  ``moe_pad_expert_input_to_capacity``);
- tp_overlap_sp: ``arguments.py`` (TP comm overlap needs sequence parallelism);
- shared_overlap: ``TransformerConfig`` (``moe_shared_expert_overlap`` needs shared experts and the alltoall
  dispatcher) and ``arguments.py`` (not together with ``overlap_moe_expert_parallel_comm``, whose schedule places
  the shared experts itself); foldtune adds ep > 1: without an EP all-to-all there is nothing to hide under;
- cuda_graphs_device, cuda_graphs_recompute, cuda_graphs_ep_overlap: foldtune's rules on ``cuda_graphs`` (its
  capture, :func:`cuda_graph_scope`, holds one micro-batch's forward per layer until that micro-batch's backward,
  without checkpoints or offload inside; Megatron's own CUDA graphs are exported as ``--cuda-graph-impl
  transformer_engine --cuda-graph-scope attn moe_router``, whose scopes hold the same parts);
- cp_a2a_heads: Transformer Engine's context-parallel attention (``--cp-comm-type a2a`` and ``a2a+p2p``): the
  all-to-all hands each rank of its group whole query heads and whole KV heads of its TP rank, so both head
  counts split over tp times the all-to-all's size;
- cp_comm_hierarchical (a rule on the config alone, :mod:`spec.layout_rules`): ``arguments.py`` (a2a+p2p needs
  ``--hierarchical-context-parallel-sizes`` whose product is the CP size);
- precision_aware_distopt: ``megatron/core/optimizer/__init__.py`` (``--use-precision-aware-optimizer only
  supported with distributed optimizer``); main_params_dtype: ``arguments.py``'s ``--main-params-dtype``
  choices (fp32, fp16: Transformer Engine's FusedAdam keeps no other master weights). Megatron takes any state
  dtype other than fp32 as the precision-aware optimizer (its ``OptimizerConfig`` refuses them without it), so
  foldtune's layout has no separate switch;
- fp8_params_precision: ``arguments.py`` (``--fp8-param-gather`` gathers the fp8 weights of an fp8 run);
- optimizer_distopt: ``arguments.py`` (``--fp8-param-gather only supported with distributed optimizer``): fp8
  primary weights (the optimizer state's dtypes are the layout's, rule precision_aware_distopt).

The executor's capability rules (:data:`EXECUTOR_RULES`, :func:`executor_rules`, :meth:`Validator.executor`)
say what ``executor/`` builds today: a subset of what Megatron runs. The planner does not filter by them (it
plans for Megatron; :func:`is_executor_rule` tells them apart); the tuning runner, the front door, benchmarks
and the executor itself (``executor.buildable``, once before the ranks build their slices) do.

foldtune's own rules: fp8_hardware (the GPU has no fp8 peak), hidden_tp / ffn_tp / expert_ffn_etp (the
sharded GEMM dimensions must split evenly over the group that shards them), distopt_choice (the training
spec forced the distributed optimizer on or off), main_params_half_params (fp16 master weights of fp32
parameters: Megatron keeps no master copy of fp32 parameters, so the dtype would change nothing). Not rules: a TP group wider than a node is valid but slow
(the cost model prices it); capacity (token-dropping) routing works with both dispatchers and any CP,
because Megatron drops tokens in the router (padding to capacity too: the router's map then holds the padded
rows, which Megatron's alltoall dispatcher ships as fixed-size chunks and its allgather dispatcher as
gathered rows); the vocabulary is padded to a multiple of 128·tp, so it never blocks a tp.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from spec.attention_kinds import attention_kind, modules_of_other_kinds
from spec.errors import SpecError
from spec.cp_comm_types import CP_COMM_BY_NAME, cp_split
from spec.dispatchers import EXECUTOR_DISPATCHERS, dispatcher_kind
from spec.hardware import ClusterSpec
from spec.layout_rules import LAYOUT_RULES, Rejection, layout_rejections, world_dense, world_expert
from spec.model_spec import ModelSpec
from spec.multimodal import ImageInputs, VisionLanguageSpec
from spec.multimodal_layout import MultimodalLayout
from spec.norm_scopes import QK_NORM_SCOPES
from spec.optimizer_dtypes import EXECUTOR_STATE_DTYPES, FIELDS as OPTIMIZER_DTYPE_FIELDS
from spec.shape_defaults import is_cpu
from spec.pipeline_layout import DEFAULT_SPLIT, PipelineLayoutError, PipelineSplit, check_placement, layer_chunks
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec

# rule id -> what it demands (shown by `foldtune plan` next to its rejection count)
RULES: dict[str, str] = {
    "fp8_hardware": "fp8 training needs a GPU with an fp8 peak",
    "world_dense": "tp·cp·pp divides the world size",
    "world_expert": "etp·ep·pp divides the world size",
    "heads_tp": "num_attention_heads % tp == 0",
    "kv_heads_tp": "num_query_groups is a multiple or a divisor of tp",
    "hidden_tp": "hidden_size % tp == 0",
    "ffn_tp": "dense and shared-expert FFN sizes % tp == 0",
    "seq_cp": "seq_length % (2·cp) == 0 when cp > 1",
    "layers_pp": "the pipeline placement fits the model: at least one decoder layer per chunk by default (uneven "
                 "splits allowed), or Megatron's layout / first-last / embedding-loss options place every layer",
    "vpp_needs_pp": "interleaving (vpp > 1) needs pp > 1",
    "experts_ep": "num_experts % ep == 0 (ep > 1 needs a MoE model)",
    "expert_ffn_etp": "expert FFN size % etp == 0 (etp > 1 needs a MoE model)",
    "gbs_mbs_dp": "global_batch_size % (micro_batch_size·dp) == 0",
    "vpp_microbatches": "interleaving needs the micro-batch count to be a multiple of pp",
    "sp_with_tp": "sequence parallelism is on when tp > 1 (MoE)",
    "recompute_modules": "moe_act needs a MoE model, mla_up_proj needs MLA",
    "param_gather_distopt": "overlap_param_gather needs the distributed optimizer",
    "ep_overlap": "EP comm overlap needs ep > 1, alltoall, no full recompute, vpp when pp > 1",
    "tp_overlap_sp": "TP comm overlap needs sequence parallelism",
    "shared_overlap": "shared-expert overlap needs shared experts, ep > 1, alltoall, no EP comm overlap",
    "cuda_graphs_device": "CUDA graphs need CUDA ranks (a GPU, not CPU ranks)",
    "cuda_graphs_recompute": "CUDA graphs hold no full recompute, and no selective recompute or activation "
                             "offload of the captured attention half (core_attn, layernorm, mla_up_proj)",
    "cuda_graphs_ep_overlap": "CUDA graphs do not run with the EP comm overlap schedule",
    "cp_a2a_heads": "cp_comm a2a / a2a+p2p: attention heads and KV heads % (tp·a2a size) == 0",
    "flex_dispatcher": "the flex dispatcher needs etp·ep > 1; with DeepEP no padding to capacity",
    "distopt_choice": "the distributed optimizer setting matches the training spec",
    "pad_to_capacity": "padding the experts' input to capacity needs capacity routing",
    "fp8_params_precision": "fp8 primary weights (fp8_param_gather) need precision fp8",
    "optimizer_distopt": "fp8 primary weights need the distributed optimizer",
}
# the rules on a config alone (how its sizes fold the world, which knobs go together): spec.layout_rules
RULES.update({rule.id: rule.demands for rule in LAYOUT_RULES if rule.id not in RULES})

# rule id -> what executor/ can run: a subset of Megatron's layouts (the reasons name the executor's limits)
EXECUTOR_RULES: dict[str, str] = {
    "executor_model": "RMSNorm, RoPE, SwiGLU or quick-GeGLU, causal windows, no dropout",
    "executor_sp": "tp > 1 needs sequence parallelism",
    "executor_seq_cp": "seq_length % (2·cp) == 0",
    "executor_layers_pp": "the pipeline placement fits the model (the executor runs any chunk sizes, empty included)",
    "executor_vpp_pp": "vpp > 1 needs pp > 1",
    "executor_heads_tp": "attention heads and kv heads % tp == 0",
    "executor_ffn_tp": "ffn_hidden_size and the shared-expert FFN size % tp == 0",
    "executor_seq_tp_cp": "seq_length % (tp·cp) == 0",
    "executor_experts_ep": "num_experts % ep == 0, expert FFN size (and hidden size with biases) % etp == 0; ep, etp > 1 need a MoE model",
    "executor_recompute": "selective recompute of mla_up_proj is built together with core_attn only",
    "executor_ep_overlap": "EP all-to-all overlap (overlap_moe_expert_parallel_comm) is built without full "
                           "recompute, selective recompute of moe or activation offload of moe",
    "executor_dispatcher": "the token dispatcher is one the executor builds (alltoall, allgather); Megatron's "
                           "flex dispatcher (DeepEP, HybridEP kernels) is not",
    "executor_vl_layout": "a vision-language model runs the encoder at cp = pp = 1 and the LLM at pp = 1, or "
                          "pipelined (vpp = 1) under a colocated encoder whose tp divides a stage's ranks; "
                          "colocated, encoder tp divides the LLM's ranks; separate, encoder dp divides them",
}

#: The rules whose breaking leaves the cost model nothing to price (``costmodel.step_time`` refuses such a
#: layout with their rejection): experts split over EP, the sequence over CP, the layers over the pipeline.
COSTMODEL_RULES = ("experts_ep", "seq_cp", "layers_pp")


def is_executor_rule(rule: str) -> bool:
    """Whether ``rule`` says what executor/ builds (a key of :data:`EXECUTOR_RULES`) rather than what
    Megatron-LM runs: a layout broken only by such rules is valid for the planner, which plans for Megatron."""
    return rule in EXECUTOR_RULES


def pipeline_split(num_layers: int, pp: int, vpp: int = 1, split: PipelineSplit = DEFAULT_SPLIT,
                   mtp_num_layers: int = 0) -> tuple[int, ...] | None:
    """Decoder layers held by each of the ``pp`` pipeline ranks, or None when the placement does not fit.

    foldtune supports uneven stages: by default the model is cut into pp·vpp consecutive chunks whose sizes
    differ by at most one; Megatron's placement options (``split``) cut it as
    :func:`spec.pipeline_layout.chunk_sizes` says (the placement the memory and time models price and the
    executor builds). MTP layers are not part of ``num_layers`` (they follow the decoder on the last rank).
    """
    return pipeline_split_or_reason(num_layers, pp, vpp, split, mtp_num_layers)[0]


def pipeline_split_or_reason(num_layers: int, pp: int, vpp: int, split: PipelineSplit = DEFAULT_SPLIT,
                             mtp_num_layers: int = 0) -> tuple[tuple[int, ...] | None, str]:
    """(decoder layers per pipeline rank, "") or (None, why the placement does not fit)."""
    if pp < 1 or vpp < 1:
        return None, f"pp ({pp}) and vpp ({vpp}) must be positive"
    try:
        sizes = check_placement(num_layers, pp, vpp, split, mtp_num_layers)
    except PipelineLayoutError as exc:
        return None, exc.reason
    return tuple(sum(sizes[v * pp + rank] for v in range(vpp)) for rank in range(pp)), ""


# Conditions Megatron's rules and the executor's share (each rule set words its own reason).
def interleaving_without_pipeline(pp: int, vpp: int) -> bool:
    """Virtual stages (vpp > 1) without a pipeline (pp == 1)."""
    return vpp > 1 and pp == 1


def fewer_layers_than_chunks(num_layers: int, pp: int, vpp: int) -> bool:
    """Fewer decoder layers than pp·vpp pipeline chunks."""
    return num_layers < pp * vpp


def experts_do_not_split(model: ModelSpec, ep: int) -> bool:
    """The experts do not split evenly over ``ep`` ranks (ep > 1 without experts included)."""
    return model.num_experts % ep != 0 if model.is_moe else ep > 1


def expert_ffn_does_not_split(model: ModelSpec, etp: int) -> bool:
    """An expert's FFN does not split evenly over ``etp`` ranks (etp > 1 without experts included)."""
    return model.expert_ffn_hidden_size % etp != 0 if model.is_moe else etp > 1


def batch_rule(global_batch_size: int, micro_batch_size: int, dp: int) -> Rejection | None:
    """Megatron's batch rule: the global batch (sequences) splits into whole micro-batches on every DP rank."""
    if global_batch_size % (micro_batch_size * dp):
        return Rejection("gbs_mbs_dp", f"global_batch_size ({global_batch_size}) is not divisible by "
                                       f"micro_batch_size·dp = {micro_batch_size}·{dp} = {micro_batch_size * dp}")
    return None


def seq_cp_rule(seq_length: int, cp: int) -> Rejection | None:
    """Megatron's context-parallel rule: the load-balanced causal split gives each CP rank two chunks of every
    sequence, so seq_length % (2·cp) == 0 when cp > 1."""
    if cp > 1 and seq_length % (2 * cp):
        return Rejection("seq_cp", f"seq_length ({seq_length}) is not divisible by 2·cp ({2 * cp}); "
                                   f"the load-balanced causal split gives each CP rank two chunks")
    return None


def cp_a2a_heads_rule(model: ModelSpec, tp: int, cp: int, cp_comm_type: str,
                      sizes: tuple[int, ...] | None = None) -> Rejection | None:
    """The all-to-all CP types' head rule: the all-to-all over ``a`` ranks (a = cp for a2a, the first
    hierarchical size for a2a+p2p) gives each of them heads/(tp·a) whole query heads and kv_heads/(tp·a) whole KV
    heads, so both counts must split over tp·a."""
    a2a, _ = cp_split(cp_comm_type, cp, sizes)
    if a2a <= 1:
        return None
    heads, kv_heads = model.num_attention_heads, model.num_kv_heads
    if heads % (tp * a2a) or kv_heads % (tp * a2a):
        return Rejection("cp_a2a_heads", f"cp_comm {cp_comm_type} scatters heads over tp·{a2a} = {tp * a2a} ranks: "
                                         f"attention heads ({heads}) and kv heads ({kv_heads}) must both be "
                                         f"divisible by {tp * a2a}")
    return None


def experts_ep_rule(model: ModelSpec, ep: int) -> Rejection | None:
    """Megatron's expert rule: the experts split evenly over ``ep`` ranks (ep > 1 needs a MoE model)."""
    if not experts_do_not_split(model, ep):
        return None
    if not model.is_moe:
        return Rejection("experts_ep", f"ep {ep} needs a MoE model; {model.name} has no experts")
    return Rejection("experts_ep", f"num_experts ({model.num_experts}) is not divisible by ep ({ep})")


def ep_overlap_recomputes_whole_layers(recompute_granularity: str) -> bool:
    """The part of the EP-overlap rule on recomputation: the overlapped schedule cuts each layer at its
    all-to-alls, which full recompute (a checkpoint around the whole layer) would span."""
    return recompute_granularity == "full"


def ep_overlap_rule(ep: int, dispatcher: str, recompute_granularity: str, pp: int, vpp: int) -> Rejection | None:
    """Megatron's EP-overlap rule for a layout with ``overlap_moe_expert_parallel_comm`` on: ep > 1, the
    alltoall dispatcher, no full recompute, and interleaving (vpp > 1) when pp > 1."""
    why = [need for need, broken in (
        ("ep > 1", ep == 1),
        ("the alltoall dispatcher", dispatcher != "alltoall"),
        ("no full recompute", ep_overlap_recomputes_whole_layers(recompute_granularity)),
        ("vpp > 1 when pp > 1", pp > 1 and vpp == 1),
    ) if broken]
    if why:
        return Rejection("ep_overlap", "overlap_moe_expert_parallel_comm needs " + ", ".join(why))
    return None


def shared_overlap_rule(model: ModelSpec, ep: int, dispatcher: str, ep_overlap: bool) -> Rejection | None:
    """The rule on ``moe_shared_expert_overlap`` (module docstring: rule shared_overlap): a shared expert to run,
    an EP all-to-all (ep > 1, the alltoall dispatcher) to run it under, and not the EP-overlap schedule."""
    why = [need for need, broken in (
        ("shared experts", not model.shared_expert_ffn_hidden_size),
        ("ep > 1", ep == 1),
        ("the alltoall dispatcher", dispatcher != "alltoall"),
        ("no overlap_moe_expert_parallel_comm", ep_overlap),
    ) if broken]
    if why:
        return Rejection("shared_overlap", "moe_shared_expert_overlap needs " + ", ".join(why))
    return None


#: Recompute and activation-offload modules inside the part of a layer every CUDA graph captures (the attention
#: half and its norms): the graph replays a forward that saved its activations, with no checkpoint or offload in it.
CUDA_GRAPH_MODULES = ("core_attn", "layernorm", "mla_up_proj")


def cuda_graph_scope(model: ModelSpec, config: ParallelConfig, moe: bool) -> tuple[str, ...]:
    """What one decoder layer (an MoE layer when ``moe``) replays from its CUDA graphs under ``config.cuda_graphs``:
    'attention' (input norm, attention block, residual add), 'mlp_norm' (the MLP's input norm), and in an MoE layer
    'router' (the router's logits, before top-k) and 'shared_experts' (their GEMMs do not depend on the routing).
    The router and shared experts stay eager where the MoE block is recomputed or offloaded (selective recompute
    of moe, activation offload of moe), the shared experts also under their own recompute and where they run
    beside the dispatch all-to-all (moe_shared_expert_overlap). The rest of the MoE block (top-k, permutation,
    experts, combine) is never captured: dropless routing changes its shapes every micro-batch."""
    parts = ("attention", "mlp_norm")
    if not moe:
        return parts
    selective = config.recompute_modules if config.recompute_granularity == "selective" else ()
    if "moe" in selective or "moe" in config.activation_offload_modules:
        return parts
    parts += ("router",)
    if (model.shared_expert_ffn_hidden_size and not config.moe_shared_expert_overlap
            and "shared_experts" not in selective):
        parts += ("shared_experts",)
    return parts


def cuda_graphs_rule(config: ParallelConfig, gpu: str | None = None) -> Rejection | None:
    """The rule book's rules on ``cuda_graphs`` (module docstring: cuda_graphs_device, cuda_graphs_recompute,
    cuda_graphs_ep_overlap): the first one ``config`` breaks on the GPU named ``gpu`` ('cpu': CPU ranks; None: the
    GPU is not judged), or None (also when the knob is off)."""
    c = config
    if not c.cuda_graphs:
        return None
    if gpu is not None and is_cpu(gpu):
        return Rejection("cuda_graphs_device", "cuda_graphs needs CUDA ranks; the run has CPU ranks")
    selective = c.recompute_modules if c.recompute_granularity == "selective" else ()
    recomputed = [m for m in CUDA_GRAPH_MODULES if m in selective]
    moved = [m for m in CUDA_GRAPH_MODULES if m in c.activation_offload_modules]
    why = ((["full recompute"] if c.recompute_granularity == "full" else [])
           + [f"selective recompute of {m}" for m in recomputed] + [f"activation offload of {m}" for m in moved])
    if why:
        return Rejection("cuda_graphs_recompute", "cuda_graphs replays the attention half as captured, without "
                                                  + ", ".join(why))
    if c.overlap_moe_expert_parallel_comm:
        return Rejection("cuda_graphs_ep_overlap", "cuda_graphs holds one micro-batch per layer between its forward "
                                                   "and backward; the EP overlap schedule runs another micro-batch's "
                                                   "forward in between (overlap_moe_expert_parallel_comm)")
    return None


def executor_cuda_graphs_problem(config: ParallelConfig, precision: str | None = None) -> str | None:
    """What of ``config`` (trained in ``precision``, None: not judged) the executor's CUDA graphs cannot hold
    (rule executor_cuda_graphs), or None."""
    c = config
    why = [need for need, broken in (
        (f"tp = cp = 1: the graphs capture no collectives (got tp {c.tp}, cp {c.cp})", c.tp > 1 or c.cp > 1),
        (f"pp = 1: a pipeline runs several forwards of a layer before their backwards (got pp {c.pp})", c.pp > 1),
        ("no overlapped parameter gather across ranks: its forward hooks wait outside the graph "
         "(overlap_param_gather with the distributed optimizer)",
         c.overlap_param_gather and c.use_distributed_optimizer and c.world_size > 1),
        ("precision other than fp8: its kernels cache quantised weights between replays", precision == "fp8"),
    ) if broken]
    return "cuda_graphs needs " + "; ".join(why) if why else None


def cuda_graphs_rejections(config: ParallelConfig, precision: str | None = None,
                           gpu: str | None = None) -> list[Rejection]:
    """Every rejection of the rule book's CUDA-graph rules ``config`` draws (empty when the knob is off or holds):
    the capture's own (:func:`cuda_graphs_rule`), then the executor's (executor_cuda_graphs)."""
    if not config.cuda_graphs:
        return []
    found = [cuda_graphs_rule(config, gpu)]
    problem = executor_cuda_graphs_problem(config, precision)
    found.append(Rejection("executor_cuda_graphs", problem) if problem else None)
    return [r for r in found if r is not None]


def flex_dispatcher_rule(dispatcher: str, ep: int, etp: int, training: TrainingSpec) -> Rejection | None:
    """Megatron's conditions on its flex dispatcher (module docstring: rule flex_dispatcher); None for the
    other dispatchers."""
    kind = dispatcher_kind(dispatcher)
    if kind.flex_backend is None:
        return None
    if ep * etp <= 1:
        return Rejection("flex_dispatcher", f"dispatcher {dispatcher} (flex) needs etp·ep > 1, got etp {etp} ep {ep}")
    if kind.flex_backend == "deepep" and training.moe_pad_expert_input_to_capacity:
        return Rejection("flex_dispatcher", f"dispatcher {dispatcher}: the flex dispatcher's deepep backend does "
                                            f"not support moe_pad_expert_input_to_capacity")
    return None


def pad_to_capacity_problem(training: TrainingSpec) -> str | None:
    """Why ``training`` cannot pad the experts' input to capacity (Megatron's TransformerConfig: padding needs a
    capacity factor), or None."""
    capacity = training.routing_mode == "capacity" and training.moe_expert_capacity_factor is not None
    if training.moe_pad_expert_input_to_capacity and not capacity:
        return ("moe_pad_expert_input_to_capacity needs capacity routing (a moe_expert_capacity_factor): dropless "
                "experts have no capacity to pad to")
    return None


def needs_distributed_optimizer(training: TrainingSpec) -> bool:
    """Whether ``training``'s recipe runs with Megatron's distributed optimizer only: fp8 primary weights
    (``--fp8-param-gather``). The precision-aware optimizer's state dtypes are the layout's own knob, checked per
    layout (rule precision_aware_distopt)."""
    return training.fp8_param_gather


def unsupported_features(model: ModelSpec) -> list[str]:
    """The architecture features of ``model`` that the executor does not build (yet); empty when it builds it."""
    unsupported = []
    if model.normalization != "rmsnorm":
        unsupported.append(f"normalization={model.normalization}")
    if model.position_embedding_type != "rope":
        unsupported.append(f"position_embedding_type={model.position_embedding_type}")
    if not model.gated_linear_unit:
        unsupported.append("swiglu=False")
    if model.window_size is not None and model.window_size[1] != 0:
        unsupported.append(f"window_size right extent {model.window_size[1]} (causal models only)")
    kind = attention_kind(model)
    if not kind.windows_and_sinks and (model.window_size is not None or model.softmax_type != "vanilla"):
        unsupported.append(f"{kind.label} attention with a window or attention sinks")
    if model.hidden_dropout or model.attention_dropout:
        unsupported.append("dropout")
    scope = QK_NORM_SCOPES.get(model.qk_layernorm_scope)
    if scope is not None and scope.split_with_heads and not kind.split_qk_norms:
        unsupported.append(f"qk_layernorm_scope {scope.name!r} (q/k norms split with the heads) with "
                           f"{kind.label} attention")
    return unsupported


def executor_model_rule(model: ModelSpec) -> Rejection | None:
    """The executor's model rule: a Rejection naming every feature of ``model`` it does not build."""
    unsupported = unsupported_features(model)
    if unsupported:
        return Rejection("executor_model", f"model {model.name!r}: the executor does not support "
                                           f"{', '.join(unsupported)}")
    return None


def executor_layout_rules(model: ModelSpec, config: ParallelConfig, seq_length: int) -> list[Rejection]:
    """Every executor capability rule (:data:`EXECUTOR_RULES`, the model rule aside) that ``config`` breaks
    for ``model`` at ``seq_length`` tokens per sequence; empty when the executor can run it."""
    c, m = config, model
    found = []

    def rule(name: str, broken: bool, reason: str) -> None:
        if broken:
            found.append(Rejection(name, reason))

    rule("executor_sp", c.tp > 1 and not c.sequence_parallel,
         "tp > 1 needs sequence_parallel (as Megatron requires for MoE)")
    rule("executor_seq_cp", seq_length % (2 * c.cp) != 0,
         f"seq_length ({seq_length}) must be divisible by 2·cp ({2 * c.cp})")
    placed, why = pipeline_split_or_reason(m.num_layers, c.pp, c.vpp, c.pipeline_split, m.mtp_num_layers)
    rule("executor_layers_pp", placed is None, f"pipeline placement of {m.num_layers} layers on pp·vpp "
                                               f"{c.pp}·{c.vpp}: {why}")
    rule("executor_vpp_pp", interleaving_without_pipeline(c.pp, c.vpp), f"vpp={c.vpp} needs pp > 1")
    rule("executor_heads_tp", m.num_attention_heads % c.tp != 0 or m.num_kv_heads % c.tp != 0,
         f"attention heads ({m.num_attention_heads}) and kv heads ({m.num_kv_heads}) "
         f"must be divisible by tp ({c.tp})")
    rule("executor_ffn_tp", m.ffn_hidden_size % c.tp != 0,
         f"ffn_hidden_size ({m.ffn_hidden_size}) must be divisible by tp ({c.tp})")
    rule("executor_ffn_tp", m.shared_expert_ffn_hidden_size % c.tp != 0,
         f"moe_shared_expert_intermediate_size ({m.shared_expert_ffn_hidden_size}) must be "
         f"divisible by tp ({c.tp})")
    rule("executor_seq_tp_cp", seq_length % (c.tp * c.cp) != 0,
         f"seq_length ({seq_length}) must be divisible by tp·cp ({c.tp}·{c.cp})")
    # a run that ignored it would be measured as a different layout than its label says
    rule("executor_recompute", c.recompute_granularity == "selective" and "mla_up_proj" in c.recompute_modules
         and "core_attn" not in c.recompute_modules,
         "selective recompute of mla_up_proj is built together with core_attn only (one checkpoint covers the up "
         "projections and the attention core; every other module is built alone)")
    # the overlapped schedule (executor/ep_overlap.py) cuts each MoE layer at its all-to-alls: a checkpoint
    # around the whole layer or the whole MoE block would span them (with any pp: executor/pipeline.py runs the
    # combined 1F1B; Megatron's own rule, ep_overlap, asks for vpp > 1 when pp > 1)
    overlap_why = [why for why, broken in (
        ("full recompute", c.recompute_granularity == "full"),
        ("selective recompute of moe", c.recompute_granularity == "selective" and "moe" in c.recompute_modules),
        # its staged layer runs the MoE block's parts itself, outside the module that offloads their activations
        ("activation offload of moe", "moe" in c.activation_offload_modules),
    ) if broken]
    rule("executor_dispatcher", not dispatcher_kind(c.moe_token_dispatcher_type).executor_builds,
         f"dispatcher {c.moe_token_dispatcher_type} (Megatron's --moe-token-dispatcher-type flex) runs DeepEP/"
         f"HybridEP kernels the executor does not build; it builds {', '.join(EXECUTOR_DISPATCHERS)}")
    rule("executor_ep_overlap", c.overlap_moe_expert_parallel_comm and bool(overlap_why),
         "EP all-to-all overlap (overlap_moe_expert_parallel_comm) is not built with " + ", ".join(overlap_why))
    ep_broken, etp_broken = experts_do_not_split(m, c.ep), expert_ffn_does_not_split(m, c.etp)
    if m.is_moe:
        rule("executor_experts_ep", ep_broken, f"num_experts ({m.num_experts}) must be divisible by ep ({c.ep})")
        rule("executor_experts_ep", etp_broken,
             f"expert ffn ({m.expert_ffn_hidden_size}) must be divisible by etp ({c.etp})")
        # each ETP rank adds its 1/etp slice of an expert's output bias, so the partial sums carry it once
        rule("executor_experts_ep", m.add_bias_linear and m.hidden_size % c.etp != 0,
             f"hidden_size ({m.hidden_size}) must be divisible by etp ({c.etp}) with add_bias_linear")
    else:
        rule("executor_experts_ep", ep_broken or etp_broken, f"ep={c.ep}, etp={c.etp} need a MoE model")
    return found


class Validator:
    """The validity rules bound to one (model, training, cluster); each level check returns a Rejection or None."""

    def __init__(self, model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec | None,
                 split: PipelineSplit = DEFAULT_SPLIT, world: int | None = None) -> None:
        """``split``: Megatron's pipeline placement options every layout of the level checks uses (the
        planner's search space); :meth:`check` reads them from the config it judges. Without a ``cluster``
        (the executor, which runs on what it is given) the GPU's rule is not checked and the world is
        ``world``."""
        self.model = model
        self.training = training
        self.cluster = cluster
        self.world = cluster.num_gpus if cluster is not None else world
        self.pipeline = split
        self._split_cache: dict[tuple, tuple[tuple[int, ...] | None, str]] = {}

    # ---- level checks (cheap; the enumerator calls them as soon as their inputs are bound) ----------
    def global_(self) -> Rejection | None:
        """Rules that depend only on the model, the training recipe and the GPU."""
        padding = pad_to_capacity_problem(self.training)
        if padding is not None:
            return Rejection("pad_to_capacity", padding)
        if self.cluster is None:
            return None
        if self.training.fp8_param_gather and self.training.precision != "fp8":
            return Rejection("fp8_params_precision", f"fp8 primary weights (fp8_param_gather) need precision fp8, "
                                                     f"the training spec has {self.training.precision}")
        if self.training.precision == "fp8" and "fp8" not in dict(self.cluster.gpu.peak_flops):
            return Rejection("fp8_hardware", f"precision fp8 needs a GPU with an fp8 peak; "
                                             f"{self.cluster.gpu.name} has only {sorted(dict(self.cluster.gpu.peak_flops))}")
        return None

    def tp(self, tp: int) -> Rejection | None:
        m = self.model
        if m.num_attention_heads % tp:
            return Rejection("heads_tp", f"num_attention_heads ({m.num_attention_heads}) is not divisible by tp ({tp})")
        heads = attention_kind(m).tp_rule(m, tp)
        if heads is not None:
            return Rejection(*heads)
        if m.hidden_size % tp:
            return Rejection("hidden_tp", f"hidden_size ({m.hidden_size}) is not divisible by tp ({tp})")
        if m.num_dense_layers and m.ffn_hidden_size % tp:
            return Rejection("ffn_tp", f"dense ffn_hidden_size ({m.ffn_hidden_size}) is not divisible by tp ({tp})")
        shared = m.shared_expert_ffn_hidden_size
        if shared and shared % tp:
            return Rejection("ffn_tp", f"shared-expert FFN size ({shared}) is not divisible by tp ({tp})")
        return None

    def cp(self, cp: int) -> Rejection | None:
        return seq_cp_rule(self.training.seq_length, cp)

    def cp_comm(self, tp: int, cp: int, cp_comm_type: str,
                sizes: tuple[int, ...] | None = None) -> Rejection | None:
        """The rule on the CP communication type that depends on the model (cp_a2a_heads)."""
        return cp_a2a_heads_rule(self.model, tp, cp, cp_comm_type, sizes)

    def world_dense(self, tp: int, cp: int, pp: int) -> Rejection | None:
        return world_dense(self.world, tp, cp, pp)

    def world_expert(self, ep: int, etp: int, pp: int) -> Rejection | None:
        return world_expert(self.world, ep, etp, pp)

    def _split(self, pp: int, vpp: int, split: PipelineSplit | None) -> tuple[tuple[int, ...] | None, str]:
        split = self.pipeline if split is None else split
        key = (pp, vpp, split)
        hit = self._split_cache.get(key)
        if hit is None:
            hit = self._split_cache[key] = pipeline_split_or_reason(self.model.num_layers, pp, vpp, split,
                                                                    self.model.mtp_num_layers)
        return hit

    def split(self, pp: int, vpp: int, split: PipelineSplit | None = None) -> tuple[int, ...] | None:
        """Decoder layers per pipeline rank (None: the placement does not fit); ``split`` defaults to the
        validator's own options."""
        return self._split(pp, vpp, split)[0]

    def pp(self, pp: int, vpp: int, split: PipelineSplit | None = None) -> Rejection | None:
        if interleaving_without_pipeline(pp, vpp):
            return Rejection("vpp_needs_pp", f"vpp {vpp} (interleaving) needs pp > 1, got pp 1")
        placed, why = self._split(pp, vpp, split)
        if placed is None:
            return Rejection("layers_pp", f"pipeline placement of {self.model.num_layers} layers on pp·vpp = "
                                          f"{pp}·{vpp}: {why}")
        return None

    def ep(self, ep: int) -> Rejection | None:
        return experts_ep_rule(self.model, ep)

    def etp(self, etp: int) -> Rejection | None:
        m = self.model
        if not expert_ffn_does_not_split(m, etp):
            return None
        if not m.is_moe:
            return Rejection("expert_ffn_etp", f"etp {etp} needs a MoE model; {m.name} has no experts")
        return Rejection("expert_ffn_etp", f"expert FFN size ({m.expert_ffn_hidden_size}) is not divisible "
                                           f"by etp ({etp})")

    def batch(self, dp: int, mbs: int, pp: int, vpp: int) -> Rejection | None:
        gbs = self.training.global_batch_size
        rejection = batch_rule(gbs, mbs, dp)
        if rejection is not None:
            return rejection
        if vpp > 1 and (gbs // (mbs * dp)) % pp:
            return Rejection("vpp_microbatches", f"interleaved schedule (vpp {vpp}) needs the micro-batch count "
                                                 f"({gbs // (mbs * dp)}) to be a multiple of pp ({pp})")
        return None

    def knobs(self, c: ParallelConfig) -> Rejection | None:
        """Rules on the switches beside the layout (sequence parallel, recompute, overlap, optimizer)."""
        if c.tp > 1 and not c.sequence_parallel and self.model.is_moe:
            return Rejection("sp_with_tp", f"tp {c.tp} with a MoE model needs sequence parallelism on")
        if c.recompute_granularity == "selective":
            if "moe_act" in c.recompute_modules and not self.model.is_moe:
                return Rejection("recompute_modules", f"recompute module moe_act needs a MoE model; "
                                                      f"{self.model.name} has no experts")
            foreign = modules_of_other_kinds(self.model)
            module = next((m for m in c.recompute_modules if m in foreign), None)
            if module is not None:
                return Rejection("recompute_modules", f"recompute module {module} needs {foreign[module].label} "
                                                      f"attention; {self.model.name} uses "
                                                      f"{attention_kind(self.model).label} attention")
        if c.overlap_param_gather and not c.use_distributed_optimizer:
            return Rejection("param_gather_distopt", "overlap_param_gather needs the distributed optimizer")
        if c.overlap_moe_expert_parallel_comm:
            overlap = ep_overlap_rule(c.ep, c.moe_token_dispatcher_type, c.recompute_granularity, c.pp, c.vpp)
            if overlap is not None:
                return overlap
        flex = flex_dispatcher_rule(c.moe_token_dispatcher_type, c.ep, c.etp, self.training)
        if flex is not None:
            return flex
        if c.tp_comm_overlap and not c.sequence_parallel:
            return Rejection("tp_overlap_sp", "tp_comm_overlap needs sequence parallelism (tp > 1)")
        if c.moe_shared_expert_overlap:
            shared = shared_overlap_rule(self.model, c.ep, c.moe_token_dispatcher_type,
                                         c.overlap_moe_expert_parallel_comm)
            if shared is not None:
                return shared
        if c.cuda_graphs:
            graphs = cuda_graphs_rule(c, None if self.cluster is None else self.cluster.gpu.name)
            if graphs is not None:
                return graphs
        if not c.use_distributed_optimizer and needs_distributed_optimizer(self.training):
            return Rejection("optimizer_distopt", "fp8 primary weights (fp8_param_gather) need the distributed "
                                                  "optimizer")
        forced = self.training.distributed_optimizer
        if forced is not None and c.use_distributed_optimizer != forced:
            return Rejection("distopt_choice", f"the training spec sets distributed_optimizer="
                                               f"{'on' if forced else 'off'}, the layout has it "
                                               f"{'on' if c.use_distributed_optimizer else 'off'}")
        return None

    # ---- one whole config ------------------------------------------------------------------------
    def check(self, c: ParallelConfig) -> list[Rejection]:
        """Every Megatron rule and every rule on the config alone (:mod:`spec.layout_rules`) ``c`` breaks, in
        enumeration order (empty when valid)."""
        found = [
            self.global_(), self.tp(c.tp), self.cp(c.cp),
            self.cp_comm(c.tp, c.cp, c.cp_comm_type, c.hierarchical_context_parallel_sizes),
            self.world_dense(c.tp, c.cp, c.pp),
            self.pp(c.pp, c.vpp, c.pipeline_split),
            self.ep(c.ep), self.world_expert(c.ep, c.etp, c.pp), self.etp(c.etp),
        ]
        if not self.world % (c.tp * c.cp * c.pp):
            found.append(self.batch(self.world // (c.tp * c.cp * c.pp), c.micro_batch_size, c.pp, c.vpp))
        found.append(self.knobs(c))
        found += [r for r in layout_rejections(c) if r.rule not in ("world_dense", "world_expert")]
        found += _registered(self.model, self.training, c, executor=False)
        return [r for r in found if r is not None]

    # ---- what executor/ can run (a subset of the above) ----------------------------------------------
    def executor(self, c: ParallelConfig) -> list[Rejection]:
        """Every executor capability rule ``c`` breaks with this model and training (empty: it runs)."""
        return executor_rules(self.model, self.training, c)


def check_config(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec,
                 config: ParallelConfig) -> list[Rejection]:
    """Every Megatron validity rule ``config`` breaks for this model, training recipe and cluster (empty =
    valid for the planner); :func:`check` adds the executor's rules."""
    if config.world_size != cluster.num_gpus:
        return [Rejection("world_dense", f"the layout is for {config.world_size} GPUs, the cluster has "
                                         f"{cluster.num_gpus}")]
    return Validator(model, training, cluster).check(config)


def check(model: ModelSpec, training: TrainingSpec, layout: ParallelConfig,
          cluster: ClusterSpec | None = None) -> list[Rejection]:
    """The rule book: every rule ``layout`` breaks for ``model`` trained as ``training`` on ``cluster``.

    Megatron-LM's rules and the rules on the config alone (:data:`RULES`; the cost model's preconditions,
    :data:`COSTMODEL_RULES`, are among them), then what the executor builds (:data:`EXECUTOR_RULES`,
    :func:`is_executor_rule`): a layout whose rejections are all executor rules is valid for Megatron
    (the planner's question) but not runnable by foldtune. Empty: the executor builds it. Without a
    ``cluster`` (the executor) the GPU is not judged and the world is the layout's.
    """
    if cluster is not None and layout.world_size != cluster.num_gpus:
        return check_config(model, training, cluster, layout)
    validator = Validator(model, training, cluster, world=layout.world_size)
    return validator.check(layout) + validator.executor(layout)


def executor_rules(model: ModelSpec, training: TrainingSpec, config: ParallelConfig) -> list[Rejection]:
    """Every executor capability rule (:data:`EXECUTOR_RULES`) that ``config`` breaks for ``model`` trained
    as ``training`` (empty: executor/ builds it)."""
    model_rule = executor_model_rule(model)
    found = ([model_rule] if model_rule else []) + executor_layout_rules(model, config, training.seq_length)
    return found + _registered(model, training, config, executor=True)


def executor_refusal(model: ModelSpec, training: TrainingSpec, config: ParallelConfig) -> str | None:
    """Why executor/ cannot run ``config`` (every executor rule it breaks, as ``[rule] reason``, joined by '; '),
    or None when it can: what the planner labels each layout it ranks with (a Megatron-only layout)."""
    rejections = executor_rules(model, training, config)
    return "; ".join(str(r) for r in rejections) if rejections else None


@dataclass(frozen=True)
class Rule:
    """A rule of the rule book on the whole case: ``broken(model, training, layout)`` is the reason the layout
    breaks it, or None. ``executor``: a rule on what executor/ builds (else Megatron's or foldtune's)."""

    id: str
    demands: str
    broken: Callable[[ModelSpec, TrainingSpec, ParallelConfig], str | None]
    executor: bool = False


_REGISTERED: list[Rule] = []


def register(rule: Rule) -> Rule:
    """Add ``rule`` to the rule book (:func:`check`, and :data:`RULES` or :data:`EXECUTOR_RULES`); its id must be
    new. The way an architecture feature or an executor limit brings its own rule."""
    book = EXECUTOR_RULES if rule.executor else RULES
    if rule.id in RULES or rule.id in EXECUTOR_RULES:
        raise ValueError(f"rule {rule.id!r} is registered twice")
    book[rule.id] = rule.demands
    _REGISTERED.append(rule)
    return rule


def _registered(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, executor: bool) -> list[Rejection]:
    found = []
    for rule in _REGISTERED:
        if rule.executor == executor:
            reason = rule.broken(model, training, config)
            if reason is not None:
                found.append(Rejection(rule.id, reason))
    return found



def _main_params_half_params(model: ModelSpec, training: TrainingSpec, config: ParallelConfig) -> str | None:
    if config.main_params_dtype != "fp32" and training.param_bytes == 4:
        return (f"main_params_dtype {config.main_params_dtype} with {training.precision} training: fp32 parameters "
                f"are their own master weights (Megatron then keeps none)")
    return None


def _executor_optimizer_dtypes(model: ModelSpec, training: TrainingSpec, config: ParallelConfig) -> str | None:
    unbuilt = [f"{name}={value}" for name, value in zip(OPTIMIZER_DTYPE_FIELDS, config.optimizer_dtypes)
               if value not in EXECUTOR_STATE_DTYPES]
    if unbuilt:
        return (f"optimizer state {', '.join(unbuilt)}: the executor keeps its state in "
                f"{', '.join(EXECUTOR_STATE_DTYPES)}")
    return None


register(Rule("main_params_half_params", "master weights other than fp32 need 16-bit parameters (bf16, fp16 or fp8 "
                                         "training)", _main_params_half_params))
register(Rule("executor_optimizer_dtypes", "optimizer state in fp32, bf16 or fp16 (no fp8 moments)",
              _executor_optimizer_dtypes, executor=True))


def _ring_with_masked_attention(model: ModelSpec, training: TrainingSpec, config: ParallelConfig) -> str | None:
    if config.cp > 1 and CP_COMM_BY_NAME[config.cp_comm_type].ring and (
            model.window_size is not None or model.softmax_type != "vanilla"):
        return f"cp_comm {config.cp_comm_type} with {model.name!r}'s sliding windows or attention sinks: the " \
               f"ring merges plain causal blocks only (allgather and a2a take windows and sinks)"
    return None


register(Rule("executor_cp_ring_attention", "cp_comm p2p and a2a+p2p are built for plain causal attention (no "
                                            "sliding window, no attention sinks)", _ring_with_masked_attention,
              executor=True))


def _megatron_optimizer_recipe(model: ModelSpec, training: TrainingSpec, config: ParallelConfig) -> str | None:
    # the executor's optimizer (executor/optimizer.py) keeps 16-bit weights and fp32 main grads whatever the
    # training spec says: a run with these knobs would be measured as another recipe (the state dtypes are the
    # layout's, and built: rule executor_optimizer_dtypes)
    knobs = [name for name, on in (("fp8 primary weights (fp8_param_gather)", training.fp8_param_gather),
                                   ("a bf16 gradient buffer (main_grads_fp32 off)", not training.main_grads_fp32))
             if on]
    if knobs:
        return "Megatron's optimizer recipe is not built: " + ", ".join(knobs)
    return None


def _executor_cuda_graphs(model: ModelSpec, training: TrainingSpec, config: ParallelConfig) -> str | None:
    return executor_cuda_graphs_problem(config, training.precision) if config.cuda_graphs else None


register(Rule("executor_cuda_graphs", "CUDA graphs are built at tp = cp = pp = 1, without overlapped parameter "
                                      "gathers across ranks, not in fp8", _executor_cuda_graphs, executor=True))


register(Rule("executor_optimizer_recipe", "16-bit weights and fp32 main grads (Megatron's fp8 primary weights and "
                                           "bf16 grad buffer are not built)",
              _megatron_optimizer_recipe, executor=True))


def refusal(model: ModelSpec, config: ParallelConfig, rejections: list[Rejection]) -> str:
    """One line naming the layout, the model and every rule (id and reason) the layout breaks."""
    return f"layout {config.label()} for {model.name}: " + "; ".join(str(r) for r in rejections)



# ---- multimodal layouts: the vision encoder's own layout and placement ------------------------------
# rule id -> what it demands. The LLM's part of a multimodal layout answers to every rule above (check()).
MULTIMODAL_RULES: dict[str, str] = {
    "mm_world": "the layout's GPUs are the cluster's: the LLM's, plus the encoder's own when separate",
    "enc_world": "colocated: encoder tp·cp·pp·dp is the LLM's world (its own groups over the same GPUs)",
    "image_tokens_seq": "a sample's image tokens leave room for text in seq_length",
    "enc_heads_tp": "vision attention heads % encoder tp == 0",
    "enc_width_tp": "vision hidden, MLP and projector widths % encoder tp == 0",
    "enc_cp_patches": "the patches of one image % encoder cp == 0 (cp splits each image's sequence)",
    "enc_layers_pp": "at least one encoder block per encoder pipeline stage",
    "enc_images_dp": "images per step (global batch · images per sample) % encoder dp == 0",
    "enc_separate_dp": "separate: the encoder's replicas feed the LLM's (encoder dp % LLM dp == 0 or LLM dp % "
                       "encoder dp == 0), so each boundary transfer has one sender and one receiver group",
}


def check_multimodal(vl: VisionLanguageSpec, training: TrainingSpec, images: ImageInputs, layout: MultimodalLayout,
                     cluster: ClusterSpec | None = None) -> list[Rejection]:
    """Every rule ``layout`` breaks for the vision-language model ``vl``: the encoder's
    (:data:`MULTIMODAL_RULES`), then the LLM part's (:func:`check` on the LLM's GPUs)."""
    out: list[Rejection] = []
    v, enc_tp = vl.vision, layout.encoder_tp

    def rule(rule_id: str, broken: bool, reason: str) -> None:
        if broken:
            out.append(Rejection(rule_id, reason))

    if cluster is not None:
        rule("mm_world", layout.world_size != cluster.num_gpus,
             f"the layout is for {layout.world_size} GPUs ({layout.placement}), the cluster has {cluster.num_gpus}")
    rule("enc_world", layout.placement == "colocated" and layout.encoder_world != layout.llm.world_size,
         f"encoder tp·cp·pp·dp = {layout.encoder_world} is not the LLM's {layout.llm.world_size} GPUs it shares")
    try:
        images.check_fits(v, training.seq_length)
        patches = images.patches_per_image(v)
    except SpecError as exc:
        out.append(Rejection("image_tokens_seq", str(exc)))
        patches = None
    rule("enc_heads_tp", v.num_attention_heads % enc_tp != 0,
         f"{v.num_attention_heads} vision heads do not split over encoder tp {enc_tp}")
    widths = {"hidden_size": v.hidden_size, "ffn_hidden_size": v.ffn_hidden_size,
              "projector width": v.merged_hidden_size}
    bad = [f"{name} {w}" for name, w in widths.items() if w % enc_tp]
    rule("enc_width_tp", bool(bad), f"{', '.join(bad)}: not divisible by encoder tp {enc_tp}")
    if patches is not None:
        rule("enc_cp_patches", patches % layout.encoder_cp != 0,
             f"{patches} patches per image do not split over encoder cp {layout.encoder_cp}")
    rule("enc_layers_pp", v.num_layers < layout.encoder_pp,
         f"{v.num_layers} encoder blocks cannot fill {layout.encoder_pp} pipeline stages")
    per_step = training.global_batch_size * images.images_per_sample
    rule("enc_images_dp", per_step % layout.encoder_dp != 0,
         f"{per_step} images per step do not split over encoder dp {layout.encoder_dp}")
    llm_dp = layout.llm.dp
    rule("enc_separate_dp", layout.placement == "separate" and layout.encoder_dp % llm_dp and llm_dp % layout.encoder_dp,
         f"encoder dp {layout.encoder_dp} and LLM dp {llm_dp}: neither divides the other")
    llm_cluster = None
    if cluster is not None and layout.world_size == cluster.num_gpus:
        llm_cluster = ClusterSpec(cluster.hardware, layout.llm.world_size, cluster.hbm_reserved_bytes,
                                  cluster.min_headroom) if layout.placement == "separate" else cluster
    try:
        out += check(vl.llm, training, layout.llm, llm_cluster)
    except SpecError as exc:  # an LLM share of GPUs that is no cluster (not whole nodes)
        out.append(Rejection("mm_world", str(exc)))
    return out


def executor_multimodal_rules(layout: MultimodalLayout, vl: VisionLanguageSpec | None = None) -> list[Rejection]:
    """What the executor's vision-language step (executor/vlm/train.py) cannot run of ``layout`` (of ``vl``,
    when given: where its deepstack tokens join a pipelined LLM): one ``executor_vl_layout`` rejection naming
    each limit it hits, else none."""
    limits = []
    if layout.placement == "separate" and layout.llm.world_size % layout.encoder_dp:
        limits.append(f"separate: encoder dp {layout.encoder_dp} must divide the LLM's {layout.llm.world_size} ranks "
                      "(each replica serves a block of them)")
    llm = layout.llm
    if llm.pp > 1 and layout.placement != "colocated":
        limits.append(f"the LLM runs at pp = 1 under a {layout.placement} encoder (got pp = {llm.pp}; a colocated "
                      "one feeds a pipelined LLM)")
    if llm.pp > 1 and llm.vpp > 1:
        limits.append(f"a pipelined LLM under the encoder runs without virtual stages (got vpp = {llm.vpp})")
    if vl is not None and llm.pp > 1 and vl.vision.deepstack_layers:
        try:
            first = len(layer_chunks(vl.llm.num_layers, llm.pp, llm.vpp, llm.pipeline_split)[0][0])
        except PipelineLayoutError:  # a placement that does not fit: the LLM part's rules name it
            first = len(vl.vision.deepstack_layers)
        if first < len(vl.vision.deepstack_layers):
            limits.append(f"pp > 1: the first pipeline chunk holds {first} LLM layers, the deepstack tokens join "
                          f"the first {len(vl.vision.deepstack_layers)}")
    if llm.pp > 1 and (llm.world_size // llm.pp) % layout.encoder_tp:
        limits.append(f"pp > 1: encoder tp {layout.encoder_tp} must divide the {llm.world_size // llm.pp} ranks of a "
                      "pipeline stage (an encoder TP group within one stage)")
    if layout.encoder_cp > 1 or layout.encoder_pp > 1:
        limits.append(f"the encoder runs at cp = pp = 1 (got enc_cp {layout.encoder_cp}, enc_pp {layout.encoder_pp})")
    if layout.llm.overlap_moe_expert_parallel_comm:
        limits.append("the EP all-to-all overlap schedule does not run the encoder")
    if layout.placement != "separate" and layout.llm.world_size % layout.encoder_tp:
        limits.append(f"encoder tp {layout.encoder_tp} does not divide the {layout.llm.world_size} ranks")
    if not limits:
        return []
    return [Rejection("executor_vl_layout", f"layout {layout.label()!r}: " + "; ".join(limits))]
