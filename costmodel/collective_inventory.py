"""Every collective the time model prices, call by call: what the executor issues per micro-batch and layer.

The time model (``costmodel.step_time``) prices each layer part's communication from the call lists built
here, one :class:`~costmodel.comm.Call` per collective the executor issues, each at its own message size
(so a small call pays its latency, not its bytes over the bandwidth). :func:`micro_batch_inventory` lists
them for a whole pipeline stage, which ``tests/costmodel/test_collective_inventory.py`` compares with the
collectives the executor really issues on CPU ranks: a change to either side that is not made to the
other fails that test.

Notation: ``T`` = micro-batch x seq / cp tokens on this rank (the full sequence a TP group works on),
``n = T / tp`` the tokens of this rank's sequence slice, ``h`` the hidden size, ``ab`` the activation bytes.
Sizes are full-size buffers in bytes (:class:`~costmodel.comm.Call`). With sequence parallelism (the
executor's only TP mode) a column-then-row parallel block all-gathers its input and reduce-scatters its
output forward; backward all-gathers the output gradient and reduce-scatters the input gradient. Without it
(Megatron's option, priced for comparison) one all-reduce each way.

Full recomputation (torch's non-reentrant checkpoint) re-runs a layer's forward during backward but stops
once every tensor the backward needs exists again (torch's early stop): a layer's last reduce-scatter,
whose output nothing saves, is not re-run (:func:`recompute_skipped`); the same holds for the selective
'mlp', 'moe' and 'shared_experts' regions.

Once per step (:func:`step_inventory`): the gradient buckets over DP·CP and EDP (priced from their totals by
``step_time``), and the small calls after the backward (:func:`step_stat_calls`, priced in ``dp_grad``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from costmodel import params as _params
from costmodel.attention_pricing import attention_pricing
from costmodel.comm import Call
from costmodel.dispatch import dispatcher_pricing
from spec.head_features import head_blocks
from spec.model_spec import ModelSpec
from spec.norm_scopes import qk_norm_scope
from spec.parallel_config import ParallelConfig
from spec.pipeline_layout import layer_chunks
from spec.rank_groups import GridSizes
from spec.router_options import RouterOptions
from spec.training_spec import TrainingSpec

F, B = "forward", "backward"
# the cost term each group's calls are priced under (costmodel.terms)
GROUP_TERM = {"tp": "tp_comm", "cp": "cp_comm", "cp_a2a": "cp_comm", "cp_p2p": "cp_comm", "ep": "ep_a2a",
              "etp": "etp_comm", "tp_ep": "ep_a2a"}
_FP32, _INT64 = 4, 8
# the executor's gradient buckets (executor/train_step.py: Trainer's bucket_mb = 25), in parameter bytes
EXECUTOR_BUCKET_BYTES = 25 * 2**20
_STATS = 3  # [ce, router loss, mtp loss], fp32, averaged over the step


@dataclass(frozen=True)
class Geometry:
    """What the call lists depend on: one layer shape of one layout (sizes in tokens and bytes)."""

    model: ModelSpec
    tp: int
    cp: int
    ep: int
    etp: int
    sp: bool
    tokens: int  # T: micro-batch x seq / cp
    act_bytes: int
    dispatcher: str
    regather: bool = False  # Megatron's SP backward re-gathers a block's input (TrainingSpec option)
    megatron_loss: bool = False  # Megatron's vocab-parallel cross-entropy (three all-reduces)
    aux_loss_sets: int = 0  # sets the load-balancing loss counts over (0: no aux loss; seq_aux_loss: micro-batch)
    capacity: bool = False  # token dropping: the router gathers every TP and CP rank's choices
    imbalance: float = 1.0  # the busiest EP rank's routed copies over the mean (scales the dispatch data)
    pad: bool = False  # padding to capacity: the allgather dispatcher gathers every rank's zero rows per expert
    global_aux: bool = False  # the global aux loss: its counts are summed over DP·CP too (``dp`` replicas)
    dp: int = 1
    cp_comm: str = "allgather"  # the CP communication type (spec.cp_comm_types)
    cp_a2a: int = 1  # ranks of its all-to-all (ParallelConfig.cp_split)
    cp_ring: int = 1  # ranks of its ring

    @property
    def local(self) -> float:
        """n: tokens of this rank's sequence slice (the tokens entering the MoE layer)."""
        return self.tokens / self.tp


def geometry(model: ModelSpec, training: TrainingSpec, config: ParallelConfig,
             router: RouterOptions | None = None, imbalance: float = 1.0) -> Geometry:
    """The :class:`Geometry` of ``config``'s layers; ``router`` as the executor's (default RouterOptions())."""
    router = router or RouterOptions()
    aux = aux_loss_sets(model, router, config.micro_batch_size)
    capacity = training.routing_mode == "capacity" and training.moe_expert_capacity_factor is not None
    return Geometry(model, config.tp, config.cp, config.ep, config.etp, bool(config.sequence_parallel),
                    config.micro_batch_size * training.seq_length // config.cp, training.activation_bytes,
                    config.moe_token_dispatcher_type, training.sequence_parallel_regather,
                    training.megatron_cross_entropy, aux, capacity, imbalance,
                    capacity and training.moe_pad_expert_input_to_capacity,
                    bool(aux) and router.moe_router_load_balancing_type == "global_aux_loss", config.dp,
                    config.cp_comm_type, *config.cp_split)


def aux_loss_sets(model: ModelSpec, router: RouterOptions, micro_batch_size: int) -> int:
    """How many sets the router's load-balancing loss counts tokens over: 0 without the loss, the micro-batch's
    sequences under 'seq_aux_loss', else 1."""
    router = router.resolve(model)
    if not (model.is_moe and router.moe_aux_loss_coeff and router.moe_router_load_balancing_type != "none"):
        return 0
    return micro_batch_size if router.moe_router_load_balancing_type == "seq_aux_loss" else 1


def tp_block(g: Geometry, gather_bytes: float, scatter_bytes: float) -> tuple[Call, ...]:
    """A column-then-row parallel block over TP (input ``gather_bytes``, output ``scatter_bytes``, both
    full-sequence), in the order the executor issues them."""
    if g.tp <= 1:
        return ()
    if not g.sp:
        return Call("all_reduce", "tp", scatter_bytes, F), Call("all_reduce", "tp", gather_bytes, B)
    regather = (Call("all_gather", "tp", gather_bytes, B),) if g.regather else ()
    return (Call("all_gather", "tp", gather_bytes, F), Call("reduce_scatter", "tp", scatter_bytes, F),
            Call("all_gather", "tp", scatter_bytes, B)) + regather + (Call("reduce_scatter", "tp", gather_bytes, B),)


def _cp_kv(g: Geometry, heads: float, k_dim: int, v_dim: int) -> tuple[Call, ...]:
    """K and V all-gathered over CP, one call each (backward: their gradients reduce-scattered)."""
    if g.cp <= 1:
        return ()
    out: tuple[Call, ...] = ()
    for dim in (k_dim, v_dim):
        gathered = g.cp * g.tokens * heads * dim * g.act_bytes
        out += (Call("all_gather", "cp", gathered, F), Call("reduce_scatter", "cp", gathered, B))
    return out


def ring_calls(group: str, ring: int, pair_bytes: float) -> tuple[Call, ...]:
    """The ring's hops over ``group`` (``ring`` ranks), each one K/V pair of ``pair_bytes`` sent to the next rank
    (one ``batch_isend_irecv``): forward ring−1 (the last pair is not passed on); backward ring−1 again, and a hop
    of the travelling dK/dV after each of the ring's blocks (ring of them, the last one bringing a rank its own)."""
    if ring <= 1:
        return ()
    return (Call("p2p", group, pair_bytes, F),) * (ring - 1) + (Call("p2p", group, pair_bytes, B),) * (2 * ring - 1)


def cp_calls(g: Geometry, heads: float, kv_heads: float, k_dim: int, v_dim: int) -> tuple[Call, ...]:
    """The CP exchange of one attention layer under ``g.cp_comm`` (``heads`` and ``kv_heads`` on this TP rank):
    allgather :func:`_cp_kv`; p2p the ring over cp (:func:`ring_calls`, a pair = this rank's K and V); a2a an
    all-to-all of q, k, v and of the output over cp, each way (the send buffer: this rank's tensor); a2a+p2p the
    all-to-alls over cp_a2a and the ring over cp_p2p, whose pair (a2a times the tokens, 1/a2a of the heads) has
    the same bytes."""
    if g.cp <= 1:
        return ()
    if g.cp_comm == "allgather":
        return _cp_kv(g, kv_heads, k_dim, v_dim)
    t, ab = g.tokens, g.act_bytes
    pair = t * kv_heads * (k_dim + v_dim) * ab
    if g.cp_comm == "p2p":
        return ring_calls("cp", g.cp, pair)
    group = "cp" if g.cp_comm == "a2a" else "cp_a2a"
    sizes = (t * heads * k_dim * ab, t * kv_heads * k_dim * ab, t * kv_heads * v_dim * ab, t * heads * v_dim * ab)
    a2a = tuple(Call("all_to_all", group, n, phase) for phase in (F, B) for n in sizes)
    return a2a + (ring_calls("cp_p2p", g.cp_ring, pair) if g.cp_comm == "a2a+p2p" else ())


def attention_calls(g: Geometry) -> tuple[Call, ...]:
    """Self-attention: the TP block (MLA: the latents are gathered, not the hidden states), the whole-width
    q/k norms' sums over TP (OLMoE), the CP exchange of its communication type (:func:`cp_calls`)."""
    m, t, ab, h = g.model, g.tokens, g.act_bytes, g.model.hidden_size
    pricing = attention_pricing(m)
    block = tp_block(g, t * pricing.tp_gather_width(m) * ab, t * h * ab)
    kv_heads, k_dim, v_dim = pricing.kv_exchange(m)
    cp = cp_calls(g, max(1, m.num_attention_heads // g.tp), max(1, kv_heads // g.tp), k_dim, v_dim)
    norms: tuple[Call, ...] = ()
    if m.qk_layernorm and qk_norm_scope(m).split_with_heads and g.tp > 1:  # one fp32 sum per token, q and k
        norms = (Call("all_reduce", "tp", t * _FP32, F),) * 2 + (Call("all_reduce", "tp", t * _FP32, B),) * 2
    # forward order: gather, norms, K/V, scatter (what recompute_skipped relies on: the scatter is last)
    return block[:1] + norms + cp + block[1:]


def mlp_calls(g: Geometry) -> tuple[Call, ...]:
    """A dense MLP or the shared experts: one TP block over the hidden states."""
    t, ab, h = g.tokens, g.act_bytes, g.model.hidden_size
    return tp_block(g, t * h * ab, t * h * ab)


def router_calls(g: Geometry) -> tuple[Call, ...]:
    """The router's statistics over the TP·CP group: tokens per expert for the aux loss (int64, over TP then
    CP; the global aux loss's over TP then DP·CP), every TP and CP rank's choices and probabilities under token
    dropping (each gathered over TP, then CP). Forward only (no gradient)."""
    m = g.model
    out: tuple[Call, ...] = ()
    if g.aux_loss_sets:
        counts = g.aux_loss_sets * (m.num_experts or 0) * _INT64
        groups = (("tp", g.tp), ("dp_cp", g.dp * g.cp)) if g.global_aux else (("tp", g.tp), ("cp", g.cp))
        out += tuple(Call("all_reduce", group, counts, F) for group, size in groups if size > 1)
    if g.capacity:
        choices = g.local * m.moe_router_topk
        for nbytes in (_INT64, _FP32):  # the choices, then their probabilities
            out += tuple(Call("all_gather", group, choices * gathered * nbytes, F)
                         for group, gathered, size in (("tp", g.tp, g.tp), ("cp", g.tp * g.cp, g.cp)) if size > 1)
    return out


def dispatch_calls(g: Geometry) -> tuple[Call, ...]:
    """The token dispatcher's calls (``costmodel.dispatch``: each pricing lists its own); padding to capacity adds
    the allgather dispatcher's gather of every rank's zero rows per expert (int64, over its TP·EP group)."""
    calls = dispatcher_pricing(g.dispatcher).collectives(g.model, g.act_bytes, g.local, g.ep, g.etp, g.imbalance)
    if g.pad and g.dispatcher == "allgather" and g.etp * g.ep > 1:  # after its gathers of tokens, probabilities, ids
        calls = calls[:3] + (Call("all_gather", "tp_ep", g.etp * g.ep * (g.model.num_experts or 0) * _INT64, F),) \
            + calls[3:]
    return calls


def embedding_calls(g: Geometry) -> tuple[Call, ...]:
    """The vocabulary-parallel lookup's sum over TP, scattered to sequence slices (backward: all-gather)."""
    if g.tp <= 1:
        return ()
    full = g.tokens * g.model.hidden_size * g.act_bytes
    if not g.sp:
        return (Call("all_reduce", "tp", full, F),)
    return Call("reduce_scatter", "tp", full, F), Call("all_gather", "tp", full, B)


def head_calls(g: Geometry) -> tuple[Call, ...]:
    """The output layer's input gathered over TP and the vocabulary-parallel loss's sums over TP: the executor's
    blocked loss (a MAX of one fp32 per token, then one SUM of two), or Megatron's (three of one)."""
    if g.tp <= 1:
        return ()
    t, full = g.tokens, g.tokens * g.model.hidden_size * g.act_bytes
    if g.sp:
        gather = (Call("all_gather", "tp", full, F),) + ((Call("all_gather", "tp", full, B),) if g.regather else ())
        gather += (Call("reduce_scatter", "tp", full, B),)
    else:
        gather = (Call("all_reduce", "tp", full, B),)
    if g.megatron_loss:
        loss = (Call("all_reduce", "tp", t * _FP32, F),) * 3
    else:
        loss = Call("all_reduce", "tp", t * _FP32, F), Call("all_reduce", "tp", 2 * t * _FP32, F)
    return gather + loss


def chunk_end_calls(g: Geometry) -> tuple[Call, ...]:
    """Once per pipeline chunk and micro-batch: the router losses' sum over TP (one fp32, for the report)."""
    return (Call("all_reduce", "tp", _FP32, F),) if g.tp > 1 else ()


def dense_layer_calls(g: Geometry) -> tuple[Call, ...]:
    return attention_calls(g) + mlp_calls(g)


def moe_layer_calls(g: Geometry) -> tuple[Call, ...]:
    shared = mlp_calls(g) if g.model.shared_expert_ffn_hidden_size else ()
    return attention_calls(g) + router_calls(g) + dispatch_calls(g) + shared


def recompute_skipped(g: Geometry, moe: bool) -> Call | None:
    """The forward call full recomputation does not re-run (torch's early stop): the layer's last call when
    nothing saves its output, i.e. the last reduce-scatter of the dense MLP, of the shared experts (unless a
    shared-expert gate multiplies, and so saves, it) or of the allgather dispatcher's combine."""
    m = g.model
    if moe and m.shared_expert_ffn_hidden_size:
        calls = () if m.moe_shared_expert_gate else mlp_calls(g)
    elif moe:
        calls = dispatch_calls(g) if g.dispatcher == "allgather" else ()
    else:
        calls = mlp_calls(g)
    forward = [c for c in calls if c.phase == F]
    return forward[-1] if forward and forward[-1].op == "reduce_scatter" else None


def recompute_calls(g: Geometry, moe: bool, modules: tuple[str, ...] | None = None) -> tuple[Call, ...]:
    """A recomputed layer's forward calls again (issued during backward), less :func:`recompute_skipped`: the
    whole layer's (``modules`` None: full recomputation), or those of the selective ``modules`` regions that
    hold collectives ('mlp': the dense MLP; 'moe': router, dispatch and shared experts; 'shared_experts';
    'core_attn' under a ring CP type, whose hops run inside the attention core)."""
    core: tuple[Call, ...] = ()
    if modules is not None and "core_attn" in modules:
        core = tuple(c for c in attention_calls(g) if c.op == "p2p")
    if modules is None:
        region = moe_layer_calls(g) if moe else dense_layer_calls(g)
    elif not moe:
        region = core + (mlp_calls(g) if "mlp" in modules else ())
    elif "moe" in modules:
        region = core + router_calls(g) + dispatch_calls(g) + (
            mlp_calls(g) if g.model.shared_expert_ffn_hidden_size else ())
    else:
        region = core + (mlp_calls(g) if "shared_experts" in modules and g.model.shared_expert_ffn_hidden_size
                         else ())
    calls = [c for c in region if c.phase == F]
    if not calls:
        return ()
    skipped = recompute_skipped(g, moe)
    if skipped is not None:
        calls.pop(len(calls) - 1 - calls[::-1].index(skipped))
    return tuple(Call(c.op, c.group, c.nbytes, "recompute") for c in calls)


def micro_batch_inventory(model: ModelSpec, training: TrainingSpec, config: ParallelConfig,
                          router: RouterOptions | None = None) -> tuple[Call, ...]:
    """Every call one micro-batch issues on a rank of a single-stage layout (pp = 1: embedding, all layers,
    head and loss), phases 'forward', 'backward' and 'recompute' (the forward re-run during backward: full
    recomputation's, of the layers ``recompute_num_layers`` selects, or the selective modules'). MTP depths are
    not listed, nor the K/V gathers that selective 'mla_up_proj' re-runs under CP."""
    if config.pp != 1 or config.vpp != 1:
        raise ValueError("micro_batch_inventory lists single-stage layouts (pp = vpp = 1)")
    g = geometry(model, training, config, router)
    pattern = model.moe_layer_pattern()
    calls = embedding_calls(g)
    for index, moe in enumerate(pattern):
        calls += moe_layer_calls(g) if moe else dense_layer_calls(g)
        full = config.recompute_granularity == "full" and (
            config.recompute_num_layers == 0 or index < config.recompute_num_layers)
        if full:
            calls += recompute_calls(g, bool(moe))
        elif config.recompute_granularity == "selective":
            calls += recompute_calls(g, bool(moe), tuple(config.recompute_modules))
    return calls + head_calls(g) + chunk_end_calls(g)


def grad_sync_calls(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, stage: int = 0) -> tuple[Call, ...]:
    """Once per step: the gradient reduction over DP·CP (dense) and EDP (experts) of pipeline rank ``stage``, one
    call per bucket of :data:`EXECUTOR_BUCKET_BYTES` (buckets counted as if the parameters packed them whole;
    a small model has one): fp32 gradients reduce-scattered and the updated 16-bit parameters all-gathered with
    the distributed optimizer (each bucket padded to a multiple of the group), else all-reduced.
    ``costmodel.step_time`` prices these from the totals (its ``dp_grad``, ``edp_grad``, ``param_gather``)."""
    counts = _params.stage_param_counts(model, config, stage)
    grids = GridSizes.of(config)
    out: tuple[Call, ...] = ()
    for group, n in (("dp_cp", counts.dense), ("edp", counts.expert)):
        size = grids.group(group).size
        if size <= 1 or n <= 0:
            continue
        buckets = max(1, math.ceil(n * training.param_bytes / EXECUTOR_BUCKET_BYTES))
        per_bucket = math.ceil(math.ceil(n / buckets) / size) * size
        if config.use_distributed_optimizer:
            out += (Call("reduce_scatter", group, per_bucket * _FP32, "step"),
                    Call("all_gather", group, per_bucket * training.param_bytes, "step")) * buckets
        else:
            out += (Call("all_reduce", group, per_bucket * _FP32, "step"),) * buckets
    return out


def step_stat_groups(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, stage: int = 0,
                     router: RouterOptions | None = None) -> tuple[tuple[Call, int], ...]:
    """Once per step besides the gradient reduction, on pipeline rank ``stage``, as (call, how many times): the
    TP sum of the gradients of parameters every TP rank holds whole (norms, router, MLA down projections: fp32
    main grads; with the distributed optimizer this rank's shard of them, per bucket), the loss statistics over
    PP and DP·CP, the tokens per expert of every MoE layer over TP, DP·CP and PP, and the expert bias's loads (per MoE layer, over
    TP and DP·CP)."""
    counts = _params.stage_param_counts(model, config, stage)
    grids = GridSizes.of(config)
    out: list[tuple[Call, int]] = []
    if grids.group("tp").size > 1 and counts.dense_replicated:
        partial = counts.dense_replicated
        if config.use_distributed_optimizer:  # the shard's part of them, one call per bucket holding some
            partial = math.ceil(partial / grids.group("dp_cp").size)
        # every layer holds some (its norms), so every bucket of layer parameters does: as many calls as the
        # layers' dense parameters fill buckets (the word embedding and output layer, each bigger than a bucket
        # in a real model, sit alone). An estimate: the executor packs whole tensors (DeepSeek-V2-Lite, 2
        # layers, tp2: 4 buckets hold them, this says 5; the bytes agree).
        vocab = _params.embedding_params(model, config.tp).dense_tp_sharded
        layers = max(counts.dense - 2 * vocab, partial) if counts.dense * training.param_bytes > EXECUTOR_BUCKET_BYTES \
            else 0
        buckets = max(1, math.ceil(layers * training.param_bytes / EXECUTOR_BUCKET_BYTES))
        out.append((Call("all_reduce", "tp", math.ceil(partial / buckets) * _FP32, "step"), buckets))
    out += [(Call("all_reduce", g, _STATS * _FP32, "step"), 1) for g in ("pp", "dp_cp") if grids.group(g).size > 1]
    experts = max(model.num_experts or 0, 1)
    # the executor keeps the counts per MoE layer of the whole model (every rank the same rows, zero where another
    # stage holds the layer): one row per MoE decoder layer and per MoE head block (MTP)
    pattern = model.moe_layer_pattern()
    rows = max(1, sum(pattern) + (head_blocks(model) if pattern and pattern[-1] else 0))
    out += [(Call("all_reduce", g, rows * experts * _INT64, "step"), 1) for g in ("tp", "dp_cp", "pp")
            if grids.group(g).size > 1]
    if model.is_moe and (router or RouterOptions()).resolve(model).moe_router_enable_expert_bias:
        pattern = model.moe_layer_pattern()
        chunks = layer_chunks(model.num_layers, config.pp, config.vpp, config.pipeline_split)[stage]
        moe = sum(pattern[i] for chunk in chunks for i in chunk)
        moe += head_blocks(model) if stage == config.pp - 1 and pattern[-1] else 0  # their layers: the last's kind
        out += [(Call("all_reduce", g, experts * _FP32, "step"), moe) for g in ("tp", "dp_cp")
                if grids.group(g).size > 1]
    return tuple((call, n) for call, n in out if n)


def step_stat_calls(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, stage: int = 0,
                    router: RouterOptions | None = None) -> tuple[Call, ...]:
    """:func:`step_stat_groups`, one entry per call."""
    return tuple(call for call, n in step_stat_groups(model, training, config, stage, router) for _ in range(n))


def step_inventory(model: ModelSpec, training: TrainingSpec, config: ParallelConfig, stage: int = 0,
                   router: RouterOptions | None = None) -> tuple[Call, ...]:
    """Every once-per-step call of pipeline rank ``stage``: :func:`grad_sync_calls` + :func:`step_stat_calls`."""
    return grad_sync_calls(model, training, config, stage) + step_stat_calls(model, training, config, stage, router)
