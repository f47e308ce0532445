"""Where an MoE layer's forward+backward time goes: each sub-step timed on its own, on the device.

``breakdown(spec)`` (bench/executor_gpu.py part ``moe_breakdown``) runs the layer the bar measures
(``MoELayer`` of a one-layer ModelSpec, one GPU, bf16) cut into the stages it is made of — router, permute
(the dispatcher), the two grouped GEMMs (gate and up fused as ``gemm_w13``, N = 2·f; down as ``gemm_w2``),
SwiGLU, combine, and the shared expert where the model has one (``shared``: its three dense GEMMs and SwiGLU
on the layer's tokens, added to the combined output) — and their backward passes (each GEMM's backward is its
dgrad and wgrad), once with the real (random-weight) router and once with a round-robin router (perfect
balance). Each stage is reported twice:

- ``device_s``: the stage replayed back to back while a spin kernel (``torch.cuda._sleep``) holds the
  stream, so every launch is queued before the GPU starts: pure device time, launch latency hidden.
  ``hidden`` is False when the spin ran out before the host had queued everything (then the figure may
  include launch gaps).
- ``inline_s``: the stages run once in order with CUDA events between them, as a step does (median over
  steps): device time plus the gaps where the GPU waited for the host. Its sum is one stage-by-stage step.

Next to the stages: the whole layer step (steady state as the bar times it, isolated wall from an idle
device, device-only, host issue time), the ideal (:class:`SeparateGateUpExperts`: three separate grouped
GEMMs — gate, up, down — + SwiGLU fwd+bwd on pre-permuted balanced rows; it keeps this definition although
the layer now fuses gate and up; with a shared expert the ideal adds that expert's three dense GEMMs and
SwiGLU fwd+bwd on the layer's tokens, :class:`SharedExpertIdeal`), and the same ideal on pre-permuted rows
with the random router's uneven group sizes, which separates what uneven groups cost the grouped GEMM itself
(tile quantisation, no dispatcher can remove it) from the layer's own overheads. ``ratio`` is ideal / layer in
steady state (the bar's definition, see :func:`steady_seconds`), ``isolated_ratio`` the same from an idle
device (:func:`wall_seconds`); ``ratio_vs_uneven_ideal`` is uneven-ideal / layer in steady state.
On CPU (smoke runs) device times fall back to wall clocks.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from executor.kernels import get_backend, triton_permute, triton_router, triton_swiglu
from executor.moe import MoELayer
from executor.moe import expert_swiglu
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from executor.router import Router, Routing
from spec.model_spec import ModelSpec

SPIN_CYCLES_PER_S: list[float] = []  # measured once per process


class BalancedRouter(torch.nn.Module):
    """Stand-in router: token t takes experts (t·k + j) mod E with probability 1/k (perfect balance)."""

    def __init__(self, tokens: int, experts: int, topk: int, dev: torch.device):
        super().__init__()
        self.experts_NK = (torch.arange(tokens * topk, device=dev) % experts).view(tokens, topk)
        self.probs_NK = torch.full((tokens, topk), 1.0 / topk, device=dev, requires_grad=True)
        self.counts_E = torch.full((experts,), tokens * topk // experts, device=dev)

    def forward(self, x_NH, micro_batch_size: int = 1):
        return Routing(self.experts_NK, self.probs_NK, x_NH.new_zeros((), dtype=torch.float32), self.counts_E)


def _swiglu_pair(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up of two separate [rows, f] tensors: the fused kernel where it passed its self-check."""
    if triton_swiglu.available(gate) and triton_swiglu.swiglu_checked(gate.dtype, gate.device):
        return triton_swiglu.swiglu_pair(gate, up)
    return torch.nn.functional.silu(gate) * up


class SeparateGateUpExperts(torch.nn.Module):
    """The ideal expert FFN: gate (w1), up (w3) and down (w2) as three separate grouped GEMMs with the fused
    SwiGLU between, as the layer ran before gate and up were fused into one GEMM (``w13``).

    The ideal of the MoE bar is defined with three GEMMs; it keeps that definition so that fusing makes
    the layer faster, not the ideal. Its weights are copies of ``experts``' (same values, each contiguous
    on its own, as the separate parameters were)."""

    def __init__(self, experts):
        super().__init__()
        self.grouped_mm = experts.kernels.grouped_mm
        w13 = experts.w13.detach()
        self.w1 = torch.nn.Parameter(w13[:, 0].clone(memory_format=torch.contiguous_format))
        self.w3 = torch.nn.Parameter(w13[:, 1].clone(memory_format=torch.contiguous_format))
        self.w2 = torch.nn.Parameter(experts.w2.detach().clone())

    def forward(self, x_MH: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
        gate, up = self.grouped_mm(x_MH, self.w1, offs), self.grouped_mm(x_MH, self.w3, offs)
        return self.grouped_mm(_swiglu_pair(gate, up), self.w2, offs)


class SharedExpertIdeal(torch.nn.Module):
    """The ideal of a shared expert: its three dense GEMMs (gate, up, down) with the fused SwiGLU between, on
    the layer's tokens [tokens, h]; weights are copies of the layer's shared expert (a ``SwiGLUMLP``)."""

    def __init__(self, shared):
        super().__init__()
        self.linear = shared.kernels.linear
        self.w1, self.w3, self.w2 = (torch.nn.Parameter(w.detach().clone()) for w in (shared.w1, shared.w3, shared.w2))

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        return self.linear(_swiglu_pair(self.linear(x_TH, self.w1), self.linear(x_TH, self.w3)), self.w2)


# The router's rule as a model defines it (Megatron's names): what a bar layer copies from its catalog model.
ROUTING_FIELDS = ("moe_router_score_function", "moe_router_pre_softmax", "moe_router_num_groups",
                  "moe_router_group_topk", "moe_router_topk_scaling_factor")


def moe_spec(h: int, f: int, experts: int, topk: int, shared: int | None = None, like: ModelSpec | None = None):
    """A one-layer ModelSpec of the benchmarked MoE shape: hidden ``h``, expert FFN ``f``, ``experts`` experts,
    top-``topk``, a shared expert of FFN ``shared`` (None: none), and the routing rule (score function,
    pre-softmax, group-limited top-k, top-k scaling: :data:`ROUTING_FIELDS`) of the model ``like`` (None: a
    plain softmax top-k)."""
    routing = {name: getattr(like, name) for name in ROUTING_FIELDS} if like is not None else {}
    return ModelSpec(name=f"moe-h{h}-f{f}-e{experts}-k{topk}" + (f"-s{shared}" if shared else ""), num_layers=1,
                     hidden_size=h, num_attention_heads=16, ffn_hidden_size=f, vocab_size=32000,
                     num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=f,
                     moe_shared_expert_intermediate_size=shared, **routing)


@dataclasses.dataclass
class SharedBar:
    """The shared expert's part of the ideal: :class:`SharedExpertIdeal` on random tokens ``x`` [tokens, h]
    with output gradient ``gy``."""

    ideal: SharedExpertIdeal
    x: torch.Tensor
    gy: torch.Tensor


@dataclasses.dataclass
class BarInputs:
    """What the MoE bar runs: a one-GPU MoE layer on random tokens ``x`` [seq, mbs, h] with output gradient
    ``gy``, and its ideal (the same weights as three separate expert GEMMs) on random pre-permuted rows
    ``xs`` [seq·mbs·topk, h] with gradient ``gs``; ``balanced`` is the ideal's rows per expert; ``shared`` the
    shared expert's part of the ideal (None when the model has no shared expert)."""

    layer: torch.nn.Module
    x: torch.Tensor
    gy: torch.Tensor
    ideal: SeparateGateUpExperts
    xs: torch.Tensor
    gs: torch.Tensor
    balanced: torch.Tensor
    shared: SharedBar | None = None

    def ideal_step(self, group_rows: torch.Tensor | None = None):
        """A call that runs one fwd+bwd of the whole ideal (experts in groups of ``group_rows`` rows, default
        balanced, plus the shared expert's part)."""
        return ideal_fwd_bwd(self.ideal, self.xs, self.gs, self.balanced if group_rows is None else group_rows,
                             self.shared)


def bar_inputs(spec: ModelSpec, seq: int, mbs: int, dev: torch.device, dtype: torch.dtype,
               options=None) -> BarInputs:
    """The MoE layer of the one-layer ``spec`` (:func:`moe_spec`; ``options``: ExecutorOptions, default ones)
    and its ideal, on random data: ``seq·mbs`` tokens."""
    layer = MoELayer(spec, options or ExecutorOptions(), single_process_state(), 0, get_backend("torch"), dev, dtype)
    h, experts, tokens = spec.hidden_size, spec.num_experts, seq * mbs
    rows = tokens * spec.moe_router_topk
    shared = None
    if layer.shared is not None:
        shared = SharedBar(SharedExpertIdeal(layer.shared),
                           torch.randn(tokens, h, device=dev, dtype=dtype, requires_grad=True),
                           torch.randn(tokens, h, device=dev, dtype=dtype))
    return BarInputs(layer, torch.randn(seq, mbs, h, device=dev, dtype=dtype, requires_grad=True),
                     torch.randn(seq, mbs, h, device=dev, dtype=dtype), SeparateGateUpExperts(layer.experts),
                     torch.randn(rows, h, device=dev, dtype=dtype, requires_grad=True),
                     torch.randn(rows, h, device=dev, dtype=dtype),
                     torch.full((experts,), rows // experts, device=dev, dtype=torch.long), shared)


def layer_fwd_bwd(layer: torch.nn.Module, x: torch.Tensor, gy: torch.Tensor):
    """A call that runs one fwd+bwd of the MoE ``layer`` on ``x`` with output gradient ``gy``, as in a
    training step (grads set to None first, so the backward writes them afresh)."""
    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        y, _ = layer(x)
        y.backward(gy)
    return step


def ideal_fwd_bwd(ideal: SeparateGateUpExperts, xs: torch.Tensor, gs: torch.Tensor, group_rows: torch.Tensor,
                  shared: SharedBar | None = None):
    """A call that runs one fwd+bwd of the ideal experts on the pre-permuted rows ``xs`` in groups of
    ``group_rows`` (rows per expert), output gradient ``gs``, and of the ``shared`` expert's ideal if given."""
    def step():
        ideal.zero_grad(set_to_none=True)
        xs.grad = None
        outs, grads = [ideal(xs, group_rows)], [gs]
        if shared is not None:
            shared.ideal.zero_grad(set_to_none=True)
            shared.x.grad = None
            outs.append(shared.ideal(shared.x))
            grads.append(shared.gy)
        torch.autograd.backward(outs, grads)
    return step


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _spin_cycles_per_s() -> float:
    """Clock of torch.cuda._sleep (cycles per second), measured with events."""
    if not SPIN_CYCLES_PER_S:
        cycles = 20_000_000
        torch.cuda._sleep(1000)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        stop.record()
        torch.cuda.synchronize()
        SPIN_CYCLES_PER_S.append(cycles / (start.elapsed_time(stop) / 1e3))
    return SPIN_CYCLES_PER_S[0]


def device_seconds(fn, dev: torch.device, trials: int = 5) -> tuple[float, bool]:
    """(median device seconds per call of ``fn`` with its launches queued ahead, whether they all were).

    A spin kernel holds the stream while ``reps`` calls are queued; the events around the calls then
    time device work only. ``reps`` is sized so the timed span is about 5 ms (2..20 calls)."""
    fn()
    _sync(dev)
    if dev.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - t0) / 3, True
    t0 = time.perf_counter()
    fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    torch.cuda.synchronize()
    one = start.elapsed_time(stop) / 1e3
    reps = int(min(20, max(2, 5e-3 / max(one, 1e-7))))
    spin_s = 2 * host * reps + 2e-3
    times, hidden = [], True
    for _ in range(trials):
        torch.cuda._sleep(int(spin_s * _spin_cycles_per_s()))
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        hidden = hidden and not start.query()  # start done already: the GPU caught up with the host
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / 1e3 / reps)
    return statistics.median(times), hidden


def wall_seconds(fn, dev: torch.device, warmup: int = 3, iters: int = 10) -> float:
    """Median seconds per call from an idle device (how bench/executor_gpu.py times the bar)."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    times = []
    for _ in range(iters):
        if dev.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def steady_seconds(fn, dev: torch.device, iters: int = 20, lead: int = 3, trials: int = 3) -> float:
    """Seconds per call in steady state: ``iters`` calls back to back between one pair of events, no sync
    inside (median over ``trials``).

    In a training step the host runs ahead of the GPU, so a layer's launch latency (router, sort, permute
    issued before the first big GEMM) hides behind the previous layer's kernels; :func:`wall_seconds`
    starts every call from an idle device and exposes it. Here ``lead`` unsynchronised calls go first, so
    the GPU is busy when the start event is recorded and every timed call is queued behind work, as inside
    a step. If issuing a call takes the host longer than the device needs to run it, the GPU drains and the
    figure is the host's rate (compare :func:`host_seconds`)."""
    fn()
    _sync(dev)
    return statistics.median(steady_window(fn, dev, iters, lead) for _ in range(trials))


def steady_window(fn, dev: torch.device, iters: int, lead: int) -> float:
    """Seconds per call of ``iters`` calls back to back after ``lead`` unsynchronised ones (one window of
    :func:`steady_seconds`): events on a GPU, wall clock on the CPU."""
    for _ in range(lead):
        fn()
    if dev.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / 1e3 / iters


def paired_steady(fn_a, fn_b, dev: torch.device, rounds: int = 6, iters: int = 20, lead: int = 3) -> dict:
    """``fn_a`` and ``fn_b`` in alternating steady-state windows (``iters`` calls back to back after ``lead``
    unsynchronised ones, as :func:`steady_seconds`), ``rounds`` times, the order flipped every round.

    Two steady timings taken one after the other differ by the card's clock as well as by the code: under
    seconds of tensor-core load a Hopper card lowers its SM clock at its power limit, and the clock wanders
    while it does (bench/power_probe.py: 1380-1530 MHz on an H100 within 3 s). Windows taken in turn see the
    same drift, so each round's ratio compares the two at one clock. Returns ``a_s``/``b_s`` (medians of
    seconds per call) and ``ratio`` (median over rounds of b / a) with ``ratio_by_round``."""
    fn_a()
    fn_b()
    _sync(dev)

    def window(fn) -> float:
        return steady_window(fn, dev, iters, lead)

    a, b = [], []
    for r in range(rounds):
        if r % 2 == 0:
            a.append(window(fn_a))
            b.append(window(fn_b))
        else:
            b.append(window(fn_b))
            a.append(window(fn_a))
    ratios = [y / x for x, y in zip(a, b)]
    return {"a_s": statistics.median(a), "b_s": statistics.median(b), "ratio": statistics.median(ratios),
            "ratio_by_round": ratios}


def host_seconds(fn, dev: torch.device, iters: int = 10) -> float:
    """Host seconds to issue one call (no synchronisation between calls)."""
    fn()
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) / iters
    _sync(dev)
    return host


def _grad(outs, ins, grads):
    """Gradients of the outputs that require grad w.r.t. ``ins`` (None where unused); keeps the graph."""
    pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
    return torch.autograd.grad([o for o, _ in pairs], ins, [g for _, g in pairs], retain_graph=True,
                               allow_unused=True)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_()


class StagedLayer:
    """``MoELayer.forward`` and its backward cut into stages that can run alone (same calls as the layer).

    State lives in ``self.s``; each stage reads the previous stage's outputs as fresh leaves, so its
    backward is only its own. ``x_grad_add`` is the sum autograd does where a tensor feeds two stages
    (tokens → router and permute, and the shared expert where there is one); the expert rows feed one GEMM
    (``gemm_w13``), so they need none. ``shared`` (layers with a shared expert only) runs the shared expert on
    the tokens and adds its output to the combined one; its backward is the shared expert's."""

    FWD = ("router", "permute", "gemm_w13", "swiglu", "gemm_w2", "combine")
    BWD = ("combine", "gemm_w2", "swiglu", "gemm_w13", "permute", "router", "x_grad_add")

    def __init__(self, layer, x_NH: torch.Tensor, gy_NH: torch.Tensor):
        self.layer, self.gmm, self.ex = layer, layer.experts.kernels.grouped_mm, layer.experts
        self.s = {"x": x_NH, "gy": gy_NH}
        if layer.shared is not None:  # the shared expert runs after the combine, as MoELayer.forward adds it
            self.FWD = self.FWD + ("shared",)
            self.BWD = ("shared",) + self.BWD

    # forward stages
    def f_router(self):
        s = self.s
        s["x_r"] = _leaf(s["x"])
        s["routing"] = self.layer.router(s["x_r"])

    def f_permute(self):
        s = self.s
        s["x_p"], s["probs"] = _leaf(s["x"]), _leaf(s["routing"].probs_NK)
        s["d"] = self.layer.dispatcher.dispatch(s["x_p"], dataclasses.replace(s["routing"], probs_NK=s["probs"]))

    def f_gemm_w13(self):
        s = self.s
        s["rows"] = _leaf(s["d"].x_MH)
        s["offs"] = torch.cumsum(s["d"].tokens_per_expert, 0, dtype=torch.int32)
        s["h13"] = self.gmm(s["rows"], self.ex.w13.flatten(1, 2), s["offs"])

    def f_swiglu(self):
        s = self.s
        s["h13l"] = _leaf(s["h13"])
        s["a"] = expert_swiglu(s["h13l"])

    def f_gemm_w2(self):
        s = self.s
        s["al"] = _leaf(s["a"])
        s["y"] = self.gmm(s["al"], self.ex.w2, s["offs"])

    def f_combine(self):
        s = self.s
        s["yl"] = _leaf(s["y"])
        s["out"] = self.layer.dispatcher.combine(s["yl"], s["d"])

    def f_shared(self):
        s = self.s
        s["x_s"] = _leaf(s["x"])
        n, h = s["x_s"].shape
        s["ys"] = self.layer.shared(s["x_s"].view(n, 1, h)).view(n, h)
        s["out_total"] = s["out"] + s["ys"]

    # backward stages
    def b_shared(self):
        s = self.s
        s["g_xs"] = _grad([s["ys"]], [s["x_s"], *self.layer.shared.parameters()], [s["gy"]])[0]

    def b_combine(self):
        s = self.s
        s["g_y"], s["g_probs"] = _grad([s["out"]], [s["yl"], s["probs"]], [s["gy"]])

    def b_gemm_w2(self):
        s = self.s
        s["g_a"], _ = _grad([s["y"]], [s["al"], self.ex.w2], [s["g_y"]])

    def b_swiglu(self):
        s = self.s
        (s["g_h13"],) = _grad([s["a"]], [s["h13l"]], [s["g_a"]])

    def b_gemm_w13(self):
        s = self.s
        s["g_rows"], _ = _grad([s["h13"]], [s["rows"], self.ex.w13], [s["g_h13"]])

    def b_permute(self):
        s = self.s
        (s["g_xp"],) = _grad([s["d"].x_MH], [s["x_p"]], [s["g_rows"]])

    def b_router(self):
        s = self.s
        r = s["routing"]
        s["g_xr"] = _grad([r.probs_NK, r.loss], [s["x_r"], *self.layer.router.parameters()],
                          [s["g_probs"], torch.ones_like(r.loss)])[0]

    def b_x_grad_add(self):
        s = self.s
        s["g_x"] = s["g_xp"] if s["g_xr"] is None else s["g_xp"] + s["g_xr"]
        if s.get("g_xs") is not None:
            s["g_x"] = s["g_x"] + s["g_xs"]

    def step(self, mark=None) -> None:
        """Every stage once, forward then backward; ``mark(name)`` before each (and 'end')."""
        mark = mark or (lambda name: None)
        for name in self.FWD:
            mark(name)
            getattr(self, "f_" + name)()
        for name in self.BWD:
            mark(name + "_bwd")
            getattr(self, "b_" + name)()
        mark("end")


def inline_seconds(staged: StagedLayer, dev: torch.device, iters: int = 10) -> dict[str, float]:
    """Median seconds per stage between consecutive markers of a stage-by-stage step (gaps included)."""
    per: dict[str, list[float]] = {}
    for i in range(iters + 2):
        marks: list[tuple[str, object]] = []

        def mark(name):
            if dev.type == "cuda":
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                marks.append((name, ev))
            else:
                marks.append((name, time.perf_counter()))

        _sync(dev)
        staged.step(mark)
        _sync(dev)
        if i < 2:  # warm-up
            continue
        for (name, a), (_, b) in zip(marks, marks[1:]):
            per.setdefault(name, []).append(a.elapsed_time(b) / 1e3 if dev.type == "cuda" else b - a)
    return {name: statistics.median(v) for name, v in per.items()}


def stage_device_seconds(staged: StagedLayer, dev: torch.device) -> tuple[dict[str, float], bool]:
    """Device seconds of each stage replayed alone (forward stages, then backward stages)."""
    staged.step()
    out, all_hidden = {}, True
    for name in staged.FWD:
        out[name], hidden = device_seconds(getattr(staged, "f_" + name), dev)
        all_hidden = all_hidden and hidden
    staged.step()  # fresh, consistent graph for the backward replays
    for name in staged.BWD:
        out[name + "_bwd"], hidden = device_seconds(getattr(staged, "b_" + name), dev)
        all_hidden = all_hidden and hidden
    return out, all_hidden


def fused_paths() -> dict[str, bool]:
    """Which fused Triton paths passed their one-time self-check in this process (key → on)."""
    caches = (triton_router._CHECKED, triton_permute._CHECKED, triton_swiglu._CHECKED)
    return {str(key): ok for cache in caches for key, ok in cache.items()}


def _m_tiles(counts: torch.Tensor, tile: int = 128) -> int:
    """Row tiles the grouped GEMM runs at a ``tile``-row M tile (each group rounds up)."""
    return int(((counts + tile - 1) // tile).sum())


def breakdown(spec: ModelSpec, tokens: int = 4096, dev: torch.device | None = None,
              dtype: torch.dtype = torch.bfloat16, options: ExecutorOptions | None = None) -> dict:
    """The stage table of the MoE layer of the one-layer ``spec`` (:func:`moe_spec`) under ``options``
    (default ones) on ``tokens`` tokens (see the module docstring); seconds everywhere."""
    dev = dev or torch.device("cuda", 0)
    h, f, experts, topk = spec.hidden_size, spec.expert_ffn_hidden_size, spec.num_experts, spec.moe_router_topk
    bar = bar_inputs(spec, tokens, 1, dev, dtype, options)
    layer, x, gy, state = bar.layer, bar.x, bar.gy, single_process_state()
    layer_step = layer_fwd_bwd(layer, x, gy)
    ideal = bar.ideal_step

    result: dict = {"shape": {"hidden": h, "ffn": f, "experts": experts, "topk": topk, "tokens": tokens,
                              "shared": spec.shared_expert_ffn_hidden_size,
                              "score_function": spec.moe_router_score_function,
                              "num_groups": spec.moe_router_num_groups, "group_topk": spec.moe_router_group_topk}}
    real_router = layer.router
    for mode in ("random", "balanced"):
        layer.router = real_router if mode == "random" else BalancedRouter(tokens, experts, topk, dev)
        layer_step()
        counts = layer.last_tokens_per_expert.clone()
        staged = StagedLayer(layer, x.detach().view(tokens, h), gy.view(tokens, h))
        stages_dev, hidden = stage_device_seconds(staged, dev)
        layer_dev, layer_hidden = device_seconds(layer_step, dev)
        result[mode] = {
            "layer_steady_s": steady_seconds(layer_step, dev),
            "layer_wall_s": wall_seconds(layer_step, dev), "layer_device_s": layer_dev,
            "host_issue_s": host_seconds(layer_step, dev),
            "stages_device_s": stages_dev, "stages_device_sum_s": sum(stages_dev.values()),
            "stages_inline_s": inline_seconds(staged, dev), "hidden": hidden and layer_hidden,
            "counts": {"min": int(counts.min()), "max": int(counts.max()), "mean": float(counts.float().mean()),
                       "m_tiles_128": _m_tiles(counts), "m_tiles_64": _m_tiles(counts, 64)},
        }
        if mode == "random":
            uneven = counts
        del staged
    layer.router = real_router

    for name, counts in (("ideal", bar.balanced), ("ideal_uneven", uneven)):
        dev_s, hid = device_seconds(ideal(counts), dev)
        result[name] = {"steady_s": steady_seconds(ideal(counts), dev),
                        "wall_s": wall_seconds(ideal(counts), dev), "device_s": dev_s, "hidden": hid,
                        "host_issue_s": host_seconds(ideal(counts), dev)}

    # The router with Megatron's aux loss and z-loss on (the bar's layer has them off, as the defaults).
    lossy = Router(spec, dataclasses.replace(options or ExecutorOptions(), moe_aux_loss_coeff=1e-2,
                                             moe_z_loss_coeff=1e-3), state, 0, dev, dtype)
    x_r = x.detach().view(tokens, h).requires_grad_()
    routing = lossy(x_r)
    g_probs = torch.randn_like(routing.probs_NK)
    result["router_with_losses"] = {
        "fwd_device_s": device_seconds(lambda: lossy(x_r), dev)[0],
        "bwd_device_s": device_seconds(lambda: _grad([routing.probs_NK, routing.loss], [x_r, lossy.weight],
                                                     [g_probs, torch.ones_like(routing.loss)]), dev)[0],
    }

    ideal, uneven = result["ideal"], result["ideal_uneven"]
    for mode in ("random", "balanced"):
        r = result[mode]
        r["ratio"] = ideal["steady_s"] / r["layer_steady_s"]  # the bar's definition
        r["isolated_ratio"] = ideal["wall_s"] / r["layer_wall_s"]  # from an idle device (launches exposed)
        r["ratio_device"] = ideal["device_s"] / r["layer_device_s"]
        r["ratio_vs_uneven_ideal"] = uneven["steady_s"] / r["layer_steady_s"]
        r["ratio_vs_uneven_ideal_device"] = uneven["device_s"] / r["layer_device_s"]
    # what uneven groups cost the GEMMs alone
    result["uneven_ideal_over_ideal"] = uneven["steady_s"] / ideal["steady_s"]
    result["isolated_uneven_ideal_over_ideal"] = uneven["wall_s"] / ideal["wall_s"]
    result["fused_paths"] = fused_paths()
    return result


def format_table(name: str, r: dict) -> str:
    """Milliseconds per stage (device alone | inline in a step), both routings, and the headline ratios."""
    lines = [f"{name}: {r['shape']}",
             f"  {'stage':<20}{'rand dev':>10}{'rand inl':>10}{'bal dev':>10}{'bal inl':>10}   (ms)"]
    a, b = r["random"], r["balanced"]
    for stage in a["stages_device_s"]:
        lines.append(f"  {stage:<20}{a['stages_device_s'][stage] * 1e3:>10.3f}"
                     f"{a['stages_inline_s'].get(stage, float('nan')) * 1e3:>10.3f}"
                     f"{b['stages_device_s'][stage] * 1e3:>10.3f}"
                     f"{b['stages_inline_s'].get(stage, float('nan')) * 1e3:>10.3f}")
    for key in ("stages_device_sum_s", "layer_device_s", "layer_steady_s", "layer_wall_s", "host_issue_s"):
        lines.append(f"  {key:<20}{a[key] * 1e3:>10.3f}{'':>10}{b[key] * 1e3:>10.3f}")
    for key in ("ratio", "isolated_ratio", "ratio_device", "ratio_vs_uneven_ideal", "ratio_vs_uneven_ideal_device"):
        lines.append(f"  {key:<30}{a[key]:>8.3f} random {b[key]:>8.3f} balanced")
    i, u = r["ideal"], r["ideal_uneven"]
    lines.append(f"  ideal steady/wall/device {i['steady_s'] * 1e3:.3f}/{i['wall_s'] * 1e3:.3f}/"
                 f"{i['device_s'] * 1e3:.3f} ms, uneven {u['steady_s'] * 1e3:.3f}/{u['wall_s'] * 1e3:.3f}/"
                 f"{u['device_s'] * 1e3:.3f} ms (x{r['uneven_ideal_over_ideal']:.3f}); counts {a['counts']}")
    rl = r["router_with_losses"]
    lines.append(f"  router with aux+z losses: fwd {rl['fwd_device_s'] * 1e3:.3f} ms, "
                 f"bwd {rl['bwd_device_s'] * 1e3:.3f} ms (device)")
    lines.append(f"  fused Triton paths (self-checked): {r['fused_paths']}")
    return "\n".join(lines)
