"""A folded layout as Megatron-LM command-line arguments (parallelism, batch, recompute, dispatcher, optimizer and
its state dtypes).

With cp > 1 the CP communication type is always given (``--cp-comm-type``, Megatron's spelling: all_gather, p2p,
a2a, a2a+p2p, and ``--hierarchical-context-parallel-sizes`` for the last), since Megatron's default is p2p.

Only what the layout and the training recipe decide is emitted; the model's architecture arguments
(--num-layers, --hidden-size, ...) come from the user's model script. The pipeline placement:

- a layout with Megatron's own placement options passes them on as given: ``--pipeline-model-parallel-layout``
  (which fixes vpp), or ``--decoder-first/last-pipeline-num-layers`` / ``--account-for-embedding-in-pipeline-
  split`` / ``--account-for-loss-in-pipeline-split`` with ``--num-virtual-stages-per-pipeline-rank``;
- otherwise, when pp·vpp divides the layers, interleaving is ``--num-virtual-stages-per-pipeline-rank``; when
  it does not, the chunks of :func:`spec.pipeline_layout.layer_chunks` (sizes differing by at most one) are
  spelled out as ``--pipeline-model-parallel-layout`` (E = embedding, t = decoder layer, m = MTP layer,
  L = loss, '|' between chunks, ``(x|)*n`` and ``t*n`` repeat).
"""

from __future__ import annotations

import shlex

from spec.cp_comm_types import CP_COMM_BY_NAME
from spec.dispatchers import dispatcher_kind
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.training_spec import TrainingSpec
from spec.validity import cuda_graph_scope
from spec.pipeline_layout import chunk_sizes, format_layout


def pipeline_layout(num_layers: int, pp: int, vpp: int, mtp_num_layers: int = 0) -> str:
    """Megatron's ``--pipeline-model-parallel-layout`` string for the pp·vpp chunks of ``layer_chunks``.

    Chunks are listed in Megatron's flattened order (chunk j = virtual stage j // pp of rank j % pp), the
    embedding opens the first, MTP layers and the loss close the last; runs of equal chunks are folded.
    """
    return format_layout(chunk_sizes(num_layers, pp, vpp), mtp_num_layers)


def megatron_args(config: ParallelConfig, model: ModelSpec, training: TrainingSpec) -> list[list[str]]:
    """The arguments, one flag (with its values) per inner list, in a stable order."""
    c = config
    args: list[list[str]] = [
        ["--tensor-model-parallel-size", str(c.tp)],
        ["--pipeline-model-parallel-size", str(c.pp)],
    ]
    split = c.pipeline_split
    if split.layout is not None:
        args.append(["--pipeline-model-parallel-layout", split.layout])
    elif not split.is_default:
        if split.first is not None:
            args.append(["--decoder-first-pipeline-num-layers", str(split.first)])
        if split.last is not None:
            args.append(["--decoder-last-pipeline-num-layers", str(split.last)])
        if split.embedding:
            args.append(["--account-for-embedding-in-pipeline-split"])
        if split.loss:
            args.append(["--account-for-loss-in-pipeline-split"])
        if c.vpp > 1:
            args.append(["--num-virtual-stages-per-pipeline-rank", str(c.vpp)])
    elif model.num_layers % (c.pp * c.vpp):
        args.append(["--pipeline-model-parallel-layout", pipeline_layout(model.num_layers, c.pp, c.vpp,
                                                                         model.mtp_num_layers)])
    elif c.vpp > 1:
        args.append(["--num-virtual-stages-per-pipeline-rank", str(c.vpp)])
    args += [
        ["--context-parallel-size", str(c.cp)],
        ["--expert-model-parallel-size", str(c.ep)],
        ["--expert-tensor-parallel-size", str(c.etp)],
    ]
    if c.cp > 1:  # always spelled out: Megatron's default type (p2p) is not foldtune's (allgather)
        args.append(["--cp-comm-type", CP_COMM_BY_NAME[c.cp_comm_type].megatron])
        if c.hierarchical_context_parallel_sizes:
            args.append(["--hierarchical-context-parallel-sizes", *map(str, c.hierarchical_context_parallel_sizes)])
    if c.sequence_parallel:
        args.append(["--sequence-parallel"])
    args += [
        ["--micro-batch-size", str(c.micro_batch_size)],
        ["--global-batch-size", str(training.global_batch_size)],
        ["--seq-length", str(training.seq_length)],
    ]
    if c.recompute_granularity == "selective":
        args.append(["--recompute-granularity", "selective"])
        args.append(["--recompute-modules", *c.recompute_modules])
    elif c.recompute_granularity == "full":
        args.append(["--recompute-granularity", "full"])
        if c.recompute_num_layers:
            # the first k layers of each stage; 'block' keeps the rest's activations
            args.append(["--recompute-method", "block"])
            args.append(["--recompute-num-layers", str(c.recompute_num_layers)])
        else:
            args.append(["--recompute-method", "uniform"])
            args.append(["--recompute-num-layers", "1"])
    if model.is_moe:
        args.append(["--moe-grouped-gemm"])
        kind = dispatcher_kind(c.moe_token_dispatcher_type)
        args.append(["--moe-token-dispatcher-type", kind.megatron_type or kind.name])
        if kind.flex_backend is not None:
            args.append(["--moe-flex-dispatcher-backend", kind.flex_backend])
        if training.routing_mode == "capacity":
            args.append(["--moe-expert-capacity-factor", f"{training.moe_expert_capacity_factor:g}"])
            if training.moe_pad_expert_input_to_capacity:
                args.append(["--moe-pad-expert-input-to-capacity"])
    if c.use_distributed_optimizer:
        args.append(["--use-distributed-optimizer"])
    if c.overlap_grad_reduce:
        args.append(["--overlap-grad-reduce"])
    if c.overlap_param_gather:
        args.append(["--overlap-param-gather"])
    if c.optimizer_cpu_offload_fraction:
        args.append(["--optimizer-cpu-offload"])
        args.append(["--optimizer-offload-fraction", f"{c.optimizer_cpu_offload_fraction:g}"])
    if c.use_precision_aware_optimizer:
        # a state dtype other than fp32, or Megatron's HybridDeviceOptimizer (CPU offload), which runs inside the
        # precision-aware distributed optimizer
        args.append(["--use-precision-aware-optimizer"])
        for flag, dtype in zip(("--exp-avg-dtype", "--exp-avg-sq-dtype", "--main-params-dtype"), c.optimizer_dtypes):
            if dtype != "fp32":
                args.append([flag, dtype])
    offloaded = [name for module in c.activation_offload_modules for name in MEGATRON_OFFLOAD_MODULES[module]]
    if offloaded:
        args.append(["--fine-grained-activation-offloading"])
        args.append(["--offload-modules", *offloaded])
    if c.tp_comm_overlap:
        args.append(["--tp-comm-overlap"])
    if c.overlap_moe_expert_parallel_comm:
        args.append(["--overlap-moe-expert-parallel-comm"])
    if c.moe_shared_expert_overlap:
        args.append(["--moe-shared-expert-overlap"])
    if c.cuda_graphs:
        # Megatron's per-module graphs (Transformer Engine's capture): 'attn' holds the attention block and its
        # norm, 'moe_router' the pre-MLP norm, the router and the shared experts where they are not overlapped;
        # the scope foldtune captures (spec.validity.cuda_graph_scope)
        scope = ["attn"] + (["moe_router"] if "router" in cuda_graph_scope(model, c, model.is_moe) else [])
        args.append(["--cuda-graph-impl", "transformer_engine"])
        args.append(["--cuda-graph-scope", *scope])
    if training.precision in ("bf16", "fp8"):
        args.append(["--bf16"])
    elif training.precision == "fp16":
        args.append(["--fp16"])
    if training.precision == "fp8":
        args.append(["--fp8-format", "hybrid"])
    return args


#: foldtune's activation offload modules -> the nearest modules of Megatron's fine-grained activation offloading
#: (which offloads each module's input): the norms are Megatron's two layernorm modules, the MoE block its expert
#: FC1 input and activation; a dense MLP has no offload module there (left out).
MEGATRON_OFFLOAD_MODULES: dict[str, tuple[str, ...]] = {
    "core_attn": ("core_attn",),
    "layernorm": ("attn_norm", "mlp_norm"),
    "moe": ("expert_fc1", "moe_act"),
    "mlp": (),
}


def format_megatron_args(config: ParallelConfig, model: ModelSpec, training: TrainingSpec) -> str:
    """The arguments as a shell fragment, one flag per line, joined by backslash-newlines (values quoted)."""
    return " \\\n".join(" ".join(shlex.quote(part) for part in flag)
                         for flag in megatron_args(config, model, training))


def megatron_env(config: ParallelConfig) -> dict[str, str]:
    """The environment Megatron-LM needs for ``config``: with TP or CP (sequence-parallel and context-parallel
    communication overlapped with GEMMs) Megatron asserts ``CUDA_DEVICE_MAX_CONNECTIONS=1`` so that
    communication kernels are scheduled in issue order."""
    return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if config.tp > 1 or config.cp > 1 else {}


def megatron_script(config: ParallelConfig, model: ModelSpec, training: TrainingSpec) -> str:
    """A shell fragment to paste before a Megatron-LM launch: the ``export`` lines of :func:`megatron_env`,
    then ``MEGATRON_ARGS=(...)``, a bash array of :func:`megatron_args` (pass it as ``"${MEGATRON_ARGS[@]}"``)."""
    return script_text(megatron_env(config), megatron_args(config, model, training))


def script_text(env: dict[str, str], args: list[list[str]]) -> str:
    """``export`` lines of ``env``, then ``MEGATRON_ARGS=(...)`` of ``args``, one flag per line."""
    lines = [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    lines.append("MEGATRON_ARGS=(")
    lines += ["    " + " ".join(shlex.quote(part) for part in flag) for flag in args]
    lines.append(")")
    return "\n".join(lines)
