"""Host-side launch work of the eager executor: ops and collectives one layer issues per micro-batch.

A step of an eager PyTorch trainer cannot run faster than its host can issue kernels. For small models
(hidden of a few hundred) the device finishes each kernel before the host has queued the next, and the
step time is the host's: ops x seconds per op launch. :func:`stage_host_ops` counts, per micro-batch,
what one pipeline rank issues forward and backward; :func:`step_host_ops` what it issues once per step
(gradient reduction, optimizer, zeroing, the step-end statistics). The time model turns them into seconds
with ``HardwareProfile.op_launch_seconds`` / ``collective_launch_seconds`` (measured by
``foldtune calibrate``) and takes, per pipeline rank, the larger of device time and host time.

**Where the counts come from.** Measured, not guessed: every aten op dispatched by this project's
executor (``executor/``) while it runs ``Trainer.forward_backward`` and the step's reduce + optimizer,
counted with a ``TorchDispatchMode`` on CPU ranks (gloo), bf16, torch 2.13, small-moe cut to 2 and 4
layers and run with 1 and 2 micro-batches (the differences give per layer, per micro-batch and per step);
view ops (view, permute, transpose, slice, expand, ...) and metadata queries are not counted because
they launch no kernel. Collectives are the ``c10d::`` ops of the same count. The counting
script is ``tests/executor/test_host_ops.py`` (``measure``), which re-measures and checks these constants.

Known differences on CUDA (not measured here, so not applied): ``F.rms_norm`` is one fused kernel per
direction where CPU decomposes it (about 10 fewer ops per norm pair), the GQA path repeats K/V
(+4 ops), the dispatcher's Triton permute replaces a few gathers; the net is within ~15 % of the CPU
count per layer. The count is of ops, and an op's host cost is what ``op_launch_seconds`` measures (a
tiny eager op), so Python overhead between ops (module calls, autograd Functions, hooks, the phase
timer's events) is not in it: a lower bound on the host time.
"""

from __future__ import annotations

from costmodel.dispatch import dispatcher_pricing
from costmodel.host_ops import ZERO, HostOps
from spec.dispatchers import dispatcher_kind
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.validity import cuda_graph_scope

# ---- per layer, per micro-batch, forward + backward (bf16, torch 2.13 executor; see module docstring) ----
# An MoE layer on one rank (tp = cp = ep = etp = 1, alltoall dispatcher): norms, Q/K/V/O projections,
# RoPE, SDPA, router (linear, softmax, top-k, counts, aux loss), permute, three grouped GEMMs, SwiGLU,
# unpermute, residuals, and the fp32 main-grad accumulation of its 10 parameters in backward.
MOE_LAYER = HostOps(162.0)
# A dense layer on one rank: the same attention half plus an unsharded SwiGLU MLP.
DENSE_LAYER = HostOps(126.0)
# Shared experts added to an MoE layer (a SwiGLU MLP on the layer's tokens).
SHARED_EXPERTS = HostOps(20.0)
# TP > 1 with SP, per TP block (attention; the dense MLP; the shared experts): enter/leave TP around it
# (all-gather / reduce-scatter forward, their mirrors backward).
TP_PER_BLOCK = HostOps(6.0, 4.0)
# CP > 1: all-gather of K and V (reduce-scatter of their gradients), the causal-mask attention path.
CP_PER_LAYER = HostOps(15.0, 4.0)
# cp_comm a2a: four all-to-alls each way (q, k, v, the output) and the reorders into and out of sequence order
# (small-moe, cp 2 and 4: 47 and 45 ops)
CP_A2A_PER_LAYER = HostOps(46.0, 8.0)
# cp_comm p2p over n ranks: per ring rank a block each way, the forward's merge, the backward's gradient adds, and
# its hops, each a send and a receive (small-moe, cp 2 and 4: 50 and 96 ops, 8 and 20 collectives)
CP_RING_PER_RANK = HostOps(23.0, 6.0)
CP_RING_FIXED = HostOps(4.0, -4.0)

# Launches per LOCAL expert of an MoE layer per micro-batch (forward + backward), which a GPU holding many small
# experts pays on top of the per-layer counts above. The executor issues none: its expert GEMMs are grouped (one
# torch._grouped_mm, one Triton fp8 grouped kernel or one padded bmm per projection whatever the local experts),
# and its router and permutation count and offset every expert inside single kernels (bincount, cumsum). A layout
# only Megatron-Core runs (a Megatron-only dispatcher, spec.dispatchers.MEGATRON_ONLY_DISPATCHERS) runs its
# experts through Transformer Engine's GroupedLinear, whose Hopper path issues one cuBLAS GEMM per local expert:
# fc1 and fc2 forward, their dgrad and wgrad backward (6), each counted as one op.
EXECUTOR_PER_LOCAL_EXPERT = HostOps(0.0)
TE_GROUPED_LINEAR_PER_LOCAL_EXPERT = HostOps(6.0)
# Forward ops a layer re-runs under full recomputation (its forward again, plus the checkpoint wrapper).
FULL_RECOMPUTE_MOE = HostOps(63.0)
FULL_RECOMPUTE_DENSE = HostOps(50.0)  # not counted: the MoE layer's 63 scaled by 126/162 (dense/MoE layer)
# Forward ops re-run per selectively recomputed module of one layer.
SELECTIVE_RECOMPUTE = {"core_attn": HostOps(1.0), "layernorm": HostOps(14.0), "moe_act": HostOps(1.0),
                       "moe": HostOps(25.0), "mlp": HostOps(0.0), "shared_experts": HostOps(4.0)}

# Activation-checkpoint regions (torch.utils.checkpoint calls, executor/recompute.py) one layer opens per
# micro-batch per selectively recomputed module: the layer's two RMSNorms (before attention, before the MLP / MoE
# block) are two regions, every other module one; moe_act, moe and shared_experts exist in MoE layers only, mlp in
# dense layers only; an MLA layer's layernorm adds the kv latent's norm and, with a q down-projection
# (q_lora_rank), the q latent's; mla_up_proj is one region (the up projections with the attention core). Full
# recomputation opens one region per recomputed layer. Each region costs
# HardwareProfile.recompute_region_s of host work beyond its re-run forward (the ops above).
SELECTIVE_REGIONS = {"core_attn": 1, "layernorm": 2, "moe_act": 1, "moe": 1, "mlp": 1, "shared_experts": 1,
                     "mla_up_proj": 1}
_MOE_ONLY = frozenset({"moe_act", "moe", "shared_experts"})


# ---- CUDA graphs (ParallelConfig.cuda_graphs): what replaying a layer's static part saves --------------------
# Eager ops of each part a layer captures (spec.validity.cuda_graph_scope), per micro-batch forward + backward,
# counted as above (small-moe, bf16 CPU ranks, torch 2.13) on the split the graphs run
# (tests/executor/test_cuda_graph_scope.py): the attention half with its input norm, residual and the MLP's input
# norm; the router's logits (the linear layer); the shared experts (as SHARED_EXPERTS, less the routed block's add).
# The counted attention is the GQA layer of small-moe; on CUDA its fused norms issue fewer ops (module
# docstring), so the saving is an upper bound there by about the norms' share.
GRAPHED_OPS = {"attention": HostOps(101.0), "router": HostOps(5.0), "shared_experts": HostOps(19.0)}
# What replaying costs instead, per layer and micro-batch: the forward's and the backward's graph launches and the
# copies of the input, cos and sin into the graph's buffers (executor/cuda_graphs.py)...
GRAPH_REPLAY = HostOps(5.0)
# ...and per part, each output's gradient copied into the graph and each parameter's (and the input's) gradient
# copied out of it (attention: x and h out; the input, its norm, four projections and the MLP norm's gradients;
# router: logits, its weight; shared experts: their output, gate/up/down weights).
GRAPH_COPIES = {"attention": HostOps(9.0), "router": HostOps(2.0), "shared_experts": HostOps(4.0)}


def cuda_graph_host_ops(model: ModelSpec, config: ParallelConfig, moe: bool) -> HostOps:
    """Ops one dense (``moe`` False) or MoE layer saves per micro-batch under ``config.cuda_graphs`` (forward +
    backward): the eager ops of the parts it captures less its replays and copies; ZERO with the knob off."""
    if not config.cuda_graphs:
        return ZERO
    saved = ZERO
    for part in cuda_graph_scope(model, config, moe):
        if part in GRAPHED_OPS:  # mlp_norm is counted with the attention half
            saved = saved + GRAPHED_OPS[part] + GRAPH_COPIES[part] * -1.0
    return saved + GRAPH_REPLAY * -1.0


# ---- per micro-batch, outside the decoder layers -----------------------------------------------------
EMBEDDING = HostOps(4.0)  # first stage: lookup and its backward
# last stage: final norm, the fused output layer + cross-entropy, loss scaling. Measured with one vocabulary
# block; further blocks (ExecutorOptions.cross_entropy_chunk_logits) add ops that are not counted (not measured)
HEAD = HostOps(94.0)
TP_HEAD = HostOps(17.0, 8.0)  # extra of the embedding + head with TP > 1 (vocab-parallel collectives)
PP_BOUNDARY = HostOps(7.0, 2.0)  # one chunk boundary per micro-batch: activations one way, gradients back

# ---- once per step -----------------------------------------------------------------------------------
# reduce + Adam measured at 19 ops plus 10 per MoE layer; the step-end loss/count statistics (about 8 ops
# and 5 small all-reduces over PP/DP/TP) are estimated from train_step.py, not counted
STEP_FIXED = HostOps(27.0, 5.0)
OPTIMIZER_PER_LAYER = HostOps(10.0)  # reduce + Adam + write-back ops per layer's parameters
ZERO_GRAD_PER_LAYER = HostOps(10.0)  # zeroing each parameter's fp32 main gradient (10 tensors per MoE layer)


def seconds_per_op(hardware) -> float:
    """Host seconds per counted op on ``hardware`` (a HardwareProfile): the measured executor MoE layer
    divided by its counted ops when calibration measured one (it includes the executor's Python between
    ops), else the measured (or default) bare eager-op launch."""
    if hardware.moe_layer_host_s:
        return hardware.moe_layer_host_s / MOE_LAYER.ops
    return hardware.op_launch_seconds


def layer_host_ops(model: ModelSpec, config: ParallelConfig, moe: bool, hardware=None) -> HostOps:
    """Ops and collectives of one decoder layer per micro-batch (forward + backward, recomputation incl.);
    ``hardware`` (a HardwareProfile) prices the local experts by its measured seconds where it has them."""
    out = MOE_LAYER if moe else DENSE_LAYER
    if moe and model.shared_expert_ffn_hidden_size:
        out = out + SHARED_EXPERTS
    if config.tp > 1:
        blocks = 1 + (0 if moe else 1) + (1 if moe and model.shared_expert_ffn_hidden_size else 0)
        out = out + TP_PER_BLOCK * blocks
    if config.cp > 1:
        out = out + cp_host_ops(config)
    if moe:
        out = out + dispatcher_pricing(config.moe_token_dispatcher_type).host_ops(config)
        out = out + local_expert_host_ops(model, config, hardware)
    if config.recompute_granularity == "selective":
        for module in config.recompute_modules:
            out = out + SELECTIVE_RECOMPUTE.get(module, ZERO)
    return out + cuda_graph_host_ops(model, config, moe) * -1.0


def cp_host_ops(config: ParallelConfig) -> HostOps:
    """Ops and collectives of one attention layer's CP exchange per micro-batch under its communication type
    (cp > 1): allgather's, a2a's, the ring's over its ranks, a2a+p2p both."""
    if config.cp_comm_type == "allgather":
        return CP_PER_LAYER
    a2a, ring = config.cp_split
    out = CP_A2A_PER_LAYER if a2a > 1 else ZERO
    if ring > 1:
        out = out + CP_RING_FIXED + CP_RING_PER_RANK * ring
    return out

def local_expert_host_ops(model: ModelSpec, config: ParallelConfig, hardware=None) -> HostOps:
    """Ops one MoE layer adds per micro-batch for its ``num_experts / ep`` local experts: the per-expert GEMM
    launches of whichever runtime runs ``config`` (the executor: none; Megatron-Core's TE GroupedLinear for a
    layout only Megatron runs).

    Where ``hardware`` (a HardwareProfile) holds the seconds per local expert measured at real widths
    (``local_expert_host_s`` for the executor, ``expert_loop_host_s`` for a per-expert-launch runtime:
    ``bench/finegrained_moe.py``), those seconds replace the counts, expressed in ops at
    :func:`seconds_per_op` so that the time model's op sum carries them."""
    local = max(1, (model.num_experts or 1) // config.ep)
    runs_on_megatron = not executor_runs(config)
    measured = None
    if hardware is not None:
        measured = hardware.expert_loop_host_s if runs_on_megatron else hardware.local_expert_host_s
    if measured is not None:
        return HostOps(measured / seconds_per_op(hardware)) * local
    return (TE_GROUPED_LINEAR_PER_LOCAL_EXPERT if runs_on_megatron else EXECUTOR_PER_LOCAL_EXPERT) * local


def executor_runs(config: ParallelConfig) -> bool:
    """True where the executor's grouped kernels run ``config``'s experts, False where Megatron-Core does (a
    Megatron-only dispatcher: TE GroupedLinear, one GEMM launch per local expert per pass)."""
    return dispatcher_kind(config.moe_token_dispatcher_type).executor_builds


def local_experts_priced(hardware) -> bool:
    """Whether ``hardware``'s measured seconds make the executor's host time depend on its local experts (the
    host cache must then tell EP sizes apart: ``costmodel.layout_keys.HostKey``)."""
    return hardware is not None and hardware.local_expert_host_s is not None


def recompute_regions(model: ModelSpec, config: ParallelConfig, moe: bool) -> float:
    """Activation-checkpoint regions one dense (``moe`` False) or MoE layer of ``model`` opens per micro-batch
    under ``config``'s selective recomputation (:data:`SELECTIVE_REGIONS`); 0 for none and for full (counted per
    recomputed layer by the time model)."""
    if config.recompute_granularity != "selective":
        return 0.0
    regions = 0
    for module in config.recompute_modules:
        if module == "mlp" and moe or module in _MOE_ONLY and not moe:
            continue
        if module == "shared_experts" and not model.shared_expert_ffn_hidden_size:
            continue
        regions += SELECTIVE_REGIONS.get(module, 0)
        if module == "layernorm" and model.multi_latent_attention:
            regions += 1 + (model.q_lora_rank is not None)
    return float(regions)


def full_recompute_ops(moe: bool) -> HostOps:
    """Ops one fully recomputed layer adds per micro-batch."""
    return FULL_RECOMPUTE_MOE if moe else FULL_RECOMPUTE_DENSE


def extras_host_ops(config: ParallelConfig, first: bool, last: bool) -> HostOps:
    """Ops per micro-batch a pipeline rank adds besides its layers (embedding, head, stage boundaries)."""
    out = ZERO
    if first:
        out = out + EMBEDDING
    if last:
        out = out + HEAD
    if config.tp > 1 and (first or last):
        out = out + TP_HEAD
    if config.pp > 1:
        # every virtual chunk boundary this rank crosses: receive on entry, send on exit (first/last less)
        boundaries = 2 * config.vpp - (1 if first else 0) - (1 if last else 0)
        out = out + PP_BOUNDARY * boundaries
    return out


def step_host_ops(num_layers: int) -> HostOps:
    """Ops once per step on a rank holding ``num_layers`` decoder layers (reduce, optimizer, zero-grad)."""
    return STEP_FIXED + (OPTIMIZER_PER_LAYER + ZERO_GRAD_PER_LAYER) * num_layers
