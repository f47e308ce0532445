"""One rank of a large layout, built and timed on one device: what ``foldtune verify`` measures.

A 1,024-GPU layout cannot be run to check it, but what one of its ranks computes can: its share of the decoder
layers at its local shapes. :func:`measure_slice` builds the executor's own modules (:class:`DecoderLayer`, the
vocabulary-parallel embedding and output head) for one rank of ``config`` on a :func:`slice_state`, whose groups
have their real sizes and members but exchange nothing (:class:`executor.parallel.groups.SlicePeers`). So the
rank holds its real shards (heads/tp, FFN/tp, experts/ep at the expert width/etp), takes its micro-batch and its
sequence shard (seq/cp, and seq/cp/tp between layers under sequence parallelism), runs its recomputation, and
its dispatcher sizes every buffer as on the real world; the collectives themselves are left to the cost model.

Routing is told, not learned (:mod:`spec.routing_scenarios`): the router runs (its GEMM, scores and top-k are
the rank's work), then its choices are replaced by an assignment with the scenario's exact count per expert.
The world is taken to be symmetric, every rank routing as this one, so the rank's local experts receive, from
each of its EP peers and ETP members, what it sends itself: under a hot-expert load the slice of EP rank 0 is
the busiest rank.

What is timed, per layer kind (dense, MoE) on a stack of up to ``cap`` layers of the kind, forward + backward of
one micro-batch (seconds per layer; wall clock on the CPU):

* ``layer_s``: the layers as the layout runs them (its recomputation included, full recomputation on every
  built layer), per routing scenario; on a GPU back to back in steady state
  (:func:`executor.microbench.timing.time_steady`), as a step runs them, the idle gaps after the dispatcher's
  read of its split sizes included;
* ``no_recompute_s``: the same layers without recomputation (layouts that recompute only);
* ``gemm_s``: the layer's dense linears alone at their shapes (Q/K/V as one GEMM where the executor fuses them,
  the output projection, dense or shared-expert MLP; the router's GEMM is left in the layer);
* ``grouped_gemm_s``: the local experts' two grouped GEMMs alone at the rows each expert received;
* ``attention_core_s``: the attention core alone on the rank's queries and (under CP, gathered) keys and values.

The pieces alone are timed as device time with the host ahead on a GPU
(:func:`executor.microbench.timing.time_host_ahead`).
Besides the layers, the first stage's ``embedding_s`` and the last stage's ``head_s`` (final norm, output layer
and loss). Not measured: the collectives, the pipeline schedule (bubble, p2p), the optimizer step and gradient
reduction, multi-token-prediction heads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from executor.kernels import get_backend
from executor.microbench.timing import STEADY, WALL_CLOCK, time_host_ahead, time_steady
from executor.model import DecoderLayer, rank_positions
from executor.optimizer import attach_main_grads
from executor.options import ExecutorOptions, check_model_supported
from executor.parallel.groups import ParallelState, slice_state
from executor.parallel.sharding import ShardInfo, make_param
from executor.parallel.tensor_parallel import enter_tp
from executor.parallel.vocab import embed, output_cross_entropy
from executor.profile import DTYPES, options_for_precision
from executor.router import Routing
from executor.timing import NULL_TIMER
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.rank_groups import FoldedGroups
from spec.routing_scenarios import routed_counts

LAYER_KINDS = ("dense", "moe")


@dataclasses.dataclass(frozen=True)
class SliceTiming:
    """How many calls of each timed closure: ``calls`` back to back per window, the median of ``windows``
    windows, after ``warmup`` untimed calls."""

    calls: int = 8
    windows: int = 3
    warmup: int = 2


class ScenarioRouter(torch.nn.Module):
    """The layer's router, run for its work, its choices replaced by a fixed assignment (``experts_NK``
    [n, k] with ``counts_E`` copies per expert); the probabilities, and their gradient, stay the router's."""

    def __init__(self, router: torch.nn.Module):
        super().__init__()
        self.router = router
        self.experts_NK: torch.Tensor | None = None
        self.counts_E: torch.Tensor | None = None

    def assign(self, experts_NK: torch.Tensor, counts_E: torch.Tensor) -> None:
        self.experts_NK, self.counts_E = experts_NK, counts_E

    def forward(self, x_NH: torch.Tensor, micro_batch_size: int = 1, real=None,
                logits: torch.Tensor | None = None) -> Routing:
        """The real router's losses (``real``, ``logits`` as :meth:`executor.router.Router.forward` takes them)
        with the scenario's assignment and counts."""
        routing = self.router(x_NH, micro_batch_size, real, logits)
        return dataclasses.replace(routing, experts_NK=self.experts_NK, tokens_per_expert=self.counts_E,
                                   real_tokens_per_expert=None)


def assignment(counts: list[int], tokens: int, topk: int, device: torch.device) -> torch.Tensor:
    """[tokens, topk] expert ids with ``counts[e]`` copies of expert e (summing to tokens·topk, each at most
    ``tokens``), no token choosing an expert twice: the ids in expert order, laid out column by column (token t
    takes positions t, t + tokens, ...), so an expert's run of at most ``tokens`` ids meets a token once."""
    ids = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return ids.view(topk, tokens).t().contiguous().to(device)


def slice_rank(config: ParallelConfig) -> int:
    """The global rank a slice stands for: every coordinate 0 (TP, CP, EP, ETP and DP rank 0 of pipeline stage
    0), which holds expert 0, the hot one of :func:`spec.routing_scenarios.hot_expert_load`."""
    return FoldedGroups(config).groups("pp")[0][0]


def _time(op: Callable[[], None], device: torch.device, timing: SliceTiming) -> tuple[float, str]:
    """Seconds per call of a piece that never waits for the device: its device time with the host ahead."""
    timed = time_host_ahead(op, device, calls=timing.calls, windows=timing.windows, warmup=timing.warmup)
    return timed.seconds, timed.method


def _time_steady(op: Callable[[], None], device: torch.device, timing: SliceTiming) -> tuple[float, str]:
    """Seconds per call of a layer stack: back to back behind earlier calls, as in a step. A dispatcher with an
    exchange reads its split sizes back to the host once per layer, so the host cannot queue a window ahead of
    the device (:func:`time_host_ahead` would wait out ever longer sleeps); the idle gaps after those reads
    are in the figure, as they are in a step."""
    for _ in range(max(0, timing.warmup - 1)):  # time_steady runs one untimed call itself
        op()
    if device.type != "cuda":  # synchronous calls: nothing to lead with
        return time_steady(op, device, iters=timing.calls, lead=0, trials=timing.windows), WALL_CLOCK
    return time_steady(op, device, iters=timing.calls, lead=1, trials=timing.windows), STEADY


class _Slice:
    """The rank's modules and inputs for one config (with or without its recomputation)."""

    def __init__(self, model: ModelSpec, config: ParallelConfig, seq_length: int, options: ExecutorOptions,
                 device: torch.device, dtype: torch.dtype):
        self.model, self.config, self.options, self.device, self.dtype = model, config, options, device, dtype
        self.state: ParallelState = slice_state(config, slice_rank(config))
        self.kernels = get_backend(options.kernel_backend)
        tp, cp = self.state.tp.size, self.state["cp"].size
        self.seq_local = seq_length // cp  # this rank's share of the sequence (full after entering TP)
        self.seq_layer = self.seq_local // tp if self.state.sequence_parallel else self.seq_local
        self.mbs = config.micro_batch_size
        self.seq_length = seq_length
        self.gen = torch.Generator(device="cpu").manual_seed(options.seed)

    def randn(self, *shape: int, scale: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) * scale).to(device=self.device, dtype=dtype or self.dtype)

    def layers(self, indices: list[int]) -> tuple[list[DecoderLayer], tuple[torch.Tensor, torch.Tensor]]:
        pattern = self.model.moe_layer_pattern()
        built = [DecoderLayer(self.model, self.options, self.state, i, bool(pattern[i]), self.kernels, self.device,
                              self.dtype, NULL_TIMER) for i in indices]
        for layer in built:
            # full recomputation re-runs every built layer: the cost model scales it to the stage's share
            layer.recompute_layer = self.config.recompute_granularity == "full"
            attach_main_grads(list(layer.parameters()))  # the fp32 gradient hooks are part of the rank's work
            if layer.is_moe:
                layer.mlp.router = ScenarioRouter(layer.mlp.router)
        cos, sin, _ = rank_positions(self.model, self.options, self.state, self.seq_length, built, self.device)
        return built, (cos[: self.seq_local], sin[: self.seq_local])

    def routing(self, layers: list[DecoderLayer], load: tuple[float, ...]) -> None:
        """Every MoE layer of ``layers`` routes by ``load`` (its exact counts over this rank's tokens)."""
        tokens, topk = self.seq_layer * self.mbs, self.model.moe_router_topk
        counts = routed_counts(load, tokens, topk)
        experts = assignment(counts, tokens, topk, self.device)
        counts_E = torch.tensor(counts, dtype=torch.int64, device=self.device)
        for layer in layers:
            if layer.is_moe:
                layer.mlp.router.assign(experts, counts_E)

    def stack_step(self, layers: list[DecoderLayer], rope) -> Callable[[], None]:
        """Forward + backward of one micro-batch through ``layers``, from the rank's layer input."""
        x = self.randn(self.seq_layer, self.mbs, self.model.hidden_size, scale=0.5).requires_grad_(True)
        g = self.randn(self.seq_layer, self.mbs, self.model.hidden_size, scale=1e-3)

        def step() -> None:
            h, losses = x, []
            for layer in layers:
                h, loss = layer(h, rope)
                if loss.requires_grad:  # only with the router's aux/z losses on
                    losses.append(loss)
            torch.autograd.backward([h, *losses], [g, *(torch.ones_like(loss) for loss in losses)])
            x.grad = None
        return step


def _expert_rows(layer: DecoderLayer, step: Callable[[], None]) -> list[int]:
    """Rows each local expert of ``layer`` receives in one ``step`` (read from the dispatcher's hand-over)."""
    seen: list[list[int]] = []

    def hook(_module, args):
        seen.append([int(n) for n in args[1].tolist()])

    handle = layer.mlp.experts.register_forward_pre_hook(hook)
    try:
        step()
    finally:
        handle.remove()
    return seen[0]


def _linears(layer: DecoderLayer, rows_full: int, rows_local: int) -> list[tuple[torch.Tensor, int]]:
    """(weight, input rows) of every dense linear of ``layer`` as the executor runs it: column- and
    row-parallel weights on the rank's whole sequence share, replicated ones on its SP slice; the router's GEMM
    and a 1-wide gate are left to the layer; Q, K and V as one weight where the attention fuses them."""
    fused = getattr(layer.attention, "fuse_qkv", False)
    out, qkv = [], []
    for name, p in layer.named_parameters():
        info = getattr(p, "shard_info", None)
        if p.dim() != 2 or info is None or info.expert or ".router." in info.name or min(p.shape) == 1:
            continue
        if fused and name in ("attention.wq", "attention.wk", "attention.wv"):
            qkv.append(p)
            continue
        out.append((p, rows_full if info.tp_dim is not None else rows_local))
    if qkv:
        out.append((torch.cat([p.detach() for p in qkv]), rows_full))
    return out


def _gemm_step(s: _Slice, layer: DecoderLayer) -> Callable[[], None]:
    rows_full = s.seq_local * s.mbs
    rows_local = s.seq_layer * s.mbs
    work = []
    for weight, rows in _linears(layer, rows_full, rows_local):
        w = weight.detach().clone().requires_grad_(True)  # a leaf without the parameter's gradient hooks
        x = s.randn(rows, w.shape[1], scale=0.5).requires_grad_(True)
        g = s.randn(rows, w.shape[0], scale=1e-3)
        work.append((x, w, g))

    def step() -> None:
        outs = [s.kernels.linear(x, w) for x, w, _ in work]
        torch.autograd.backward(outs, [g for _, _, g in work])
        for x, w, _ in work:
            x.grad = w.grad = None
    return step


def _grouped_step(s: _Slice, layer: DecoderLayer, rows: list[int]) -> Callable[[], None]:
    experts = layer.mlp.experts
    w13 = experts.w13.detach().flatten(1, 2).clone().requires_grad_(True)  # [E_local, 2·F/etp, h]
    w2 = experts.w2.detach().clone().requires_grad_(True)  # [E_local, h, F/etp]
    m = sum(rows)
    x = s.randn(m, w13.shape[2], scale=0.5).requires_grad_(True)
    a = s.randn(m, w2.shape[2], scale=0.5).requires_grad_(True)
    g13, g2 = s.randn(m, w13.shape[1], scale=1e-3), s.randn(m, w2.shape[1], scale=1e-3)
    offs = torch.cumsum(torch.tensor(rows, device=s.device), 0, dtype=torch.int32)
    gmm = experts.kernels.grouped_mm

    def step() -> None:
        torch.autograd.backward([gmm(x, w13, offs), gmm(a, w2, offs)], [g13, g2])
        for t in (x, a, w13, w2):
            t.grad = None
    return step


def _core_step(s: _Slice, layer: DecoderLayer, step: Callable[[], None]) -> tuple[Callable[[], None], dict]:
    """The layer's attention core alone, on fresh tensors of the shapes one ``step`` handed it, and those
    shapes (heads, key/value heads, query and key tokens of the rank)."""
    attention = layer.attention
    core = attention.core_attention
    shapes: list[tuple] = []

    def record(q, k, v, *rest, **options):  # the documents of packed sequences come after q, k, v
        shapes.append((q.shape, k.shape, v.shape))
        return core(q, k, v, *rest, **options)

    attention.core_attention = record  # the instance attribute shadows the method while the step runs
    try:
        step()
    finally:
        del attention.core_attention
    q_shape, k_shape, v_shape = shapes[0]
    q, k, v = (s.randn(*shape, scale=0.5).requires_grad_(True) for shape in (q_shape, k_shape, v_shape))

    def run() -> None:
        o = core(q, k, v)
        o.backward(torch.ones_like(o) * 1e-3)
        q.grad = k.grad = v.grad = None
    return run, {"heads": q_shape[1], "kv_heads": k_shape[1], "q_tokens": q_shape[2], "kv_tokens": k_shape[2],
                 "micro_batch": q_shape[0]}


def _parts(s: _Slice, timing: SliceTiming) -> tuple[dict[str, float], dict[str, str]]:
    """Seconds of the embedding and of the output head with its loss, forward + backward of one micro-batch."""
    model, state, options = s.model, s.state, s.options
    h = model.hidden_size
    padded = model.padded_vocab_size(state.tp.size)

    def vocab_weight(name: str) -> torch.Tensor:
        info = ShardInfo(name, (padded, h), tp_dim=0, rows=model.vocab_size)
        return make_param(info, state, "normal", options.init_method_std, options.seed, s.device, s.dtype)

    table = vocab_weight("embedding.weight")
    norm = make_param(ShardInfo("final_norm.weight", (h,), tp_partial=True), state, "ones", 0.0, options.seed,
                      s.device, s.dtype)
    head = vocab_weight("lm_head.weight")
    attach_main_grads([table, norm, head])
    ids = torch.randint(0, model.vocab_size, (s.seq_local, s.mbs), generator=s.gen).to(s.device)
    g = s.randn(s.seq_layer, s.mbs, h, scale=1e-3)
    x = s.randn(s.seq_layer, s.mbs, h, scale=0.5).requires_grad_(True)

    def embedding() -> None:
        embed(ids, table, padded, state).backward(g)

    def output() -> None:
        y = enter_tp(s.kernels.rms_norm(x, norm, options.norm_epsilon), state)
        output_cross_entropy(y, head, ids, model.vocab_size, padded, state,
                             options.cross_entropy_chunk_logits,
                             options.cross_entropy_keep_logits).mean().backward()
        x.grad = None

    seconds, methods = {}, {}
    for name, op in (("embedding_s", embedding), ("head_s", output)):
        seconds[name], methods[name] = _time(op, s.device, timing)
    return seconds, methods


def measure_slice(model: ModelSpec, config: ParallelConfig, seq_length: int, precision: str,
                  loads: dict[str, tuple[float, ...]], *, layers: dict[str, list[int]] | None = None,
                  cap: int = 2, device: torch.device | str = "cpu", options: ExecutorOptions | None = None,
                  timing: SliceTiming | None = None) -> dict:
    """Time one rank of ``config`` (see the module docstring) on ``device``; seconds per layer per micro-batch.

    ``loads`` names the routing scenarios (name -> expert load, :mod:`spec.routing_scenarios`); ``layers`` the
    decoder layers of each kind to build (default: the model's first ``cap`` of each kind), at most ``cap`` of
    each. Returns a JSON-ready dict: ``rank``, ``device``, ``methods`` (how each figure was timed),
    ``kinds`` ({kind: {layers, shapes, gemm_s, attention_core_s, [grouped_gemm_s, expert_rows,] layer_s,
    [no_recompute_s]}}, the scenario-dependent ones as {scenario: value}; ``shapes`` the rank's local heads, key
    and value heads, query and key tokens, micro-batch, and for MoE its local experts and their FFN width) and
    ``parts`` (embedding_s, head_s).
    """
    check_model_supported(model)
    device = torch.device(device)
    # a slice times the device's terms; CUDA graphs change only how the host launches them (priced apart, by
    # costmodel.host), so a layout's cuda_graphs knob is timed eager, on any device
    config = dataclasses.replace(config, cuda_graphs=False)
    options = options_for_precision(options or ExecutorOptions.for_router(model=model), precision)
    dtype, timing = DTYPES[precision], timing or SliceTiming()
    if layers is None:
        pattern = model.moe_layer_pattern()
        layers = {kind: [i for i, moe in enumerate(pattern) if moe == (kind == "moe")][:cap] for kind in LAYER_KINDS}
    layers = {kind: list(indices)[:cap] for kind, indices in layers.items() if indices}
    try:
        return _measure(model, config, seq_length, loads, layers, device, options, dtype, timing)
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _measure(model, config, seq_length, loads, layers, device, options, dtype, timing) -> dict:
    s = _Slice(model, config, seq_length, options, device, dtype)
    methods: dict[str, str] = {}
    kinds: dict[str, dict] = {}
    without = None
    if config.recompute_granularity != "none":
        without = dataclasses.replace(config, recompute_granularity="none", recompute_modules=(),
                                      recompute_num_layers=0)
    scenarios = list(loads) if model.is_moe else list(loads)[:1]
    for kind, indices in layers.items():
        built, rope = s.layers(indices)
        routed = kind == "moe"
        step = s.stack_step(built, rope)
        if routed:
            s.routing(built, loads[scenarios[0]])
        out: dict = {"layers": indices}
        core, out["shapes"] = _core_step(s, built[0], step)
        out["attention_core_s"], methods["attention_core_s"] = _time(core, device, timing)
        if routed:
            experts = built[0].mlp.experts
            out["shapes"].update(local_experts=experts.w2.shape[0], expert_ffn=experts.w2.shape[2])
        out["gemm_s"], methods["gemm_s"] = _time(_gemm_step(s, built[0]), device, timing)
        if routed:
            out["expert_rows"], out["grouped_gemm_s"] = {}, {}
            for name in scenarios:
                s.routing(built, loads[name])
                rows = out["expert_rows"][name] = _expert_rows(built[0], step)
                out["grouped_gemm_s"][name], methods["grouped_gemm_s"] = _time(_grouped_step(s, built[0], rows),
                                                                               device, timing)
        out["layer_s"] = _per_layer(s, built, step, loads, scenarios, routed, device, timing, methods)
        del built, step
        if without is not None:
            plain = _Slice(model, without, seq_length, options, device, dtype)
            built, rope = plain.layers(indices)
            step = plain.stack_step(built, rope)
            out["no_recompute_s"] = _per_layer(plain, built, step, loads, scenarios, routed, device, timing, {})
            del built, step
        kinds[kind] = out
        if device.type == "cuda":
            torch.cuda.empty_cache()
    parts, part_methods = _parts(s, timing)
    methods.update(part_methods)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"rank": slice_rank(config), "device": name, "layout": config.label(), "seq_length": seq_length,
            "micro_batch_size": config.micro_batch_size, "scenarios": scenarios, "methods": methods,
            "kinds": kinds, "parts": parts}


def _per_layer(s: _Slice, built: list[DecoderLayer], step: Callable[[], None], loads: dict, scenarios: list[str],
               routed: bool, device: torch.device, timing: SliceTiming, methods: dict) -> dict[str, float]:
    """{scenario: seconds per layer of the stack's step}; a dense stack, which routes nothing, is timed once."""
    out: dict[str, float] = {}
    for name in scenarios:
        if not routed and out:
            out[name] = next(iter(out.values()))
            continue
        if routed:
            s.routing(built, loads[name])
        seconds, methods["layer_s"] = _time_steady(step, device, timing)
        out[name] = seconds / len(built)
    return out
