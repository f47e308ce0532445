"""Fine-grained MoE on one GPU: what a rank holding many small experts pays, measured at real widths.

Three measurements per fine-grained model (``costmodel.finegrained.routed_proxy``: one MoE layer at the model's
widths and routing rule, no shared expert), each returning raw seconds that ``costmodel.calibrate.finegrained``
turns into profile fields and ``bench/finegrained_moe.py`` prints against the cost model:

* :func:`measure_point`: the rank of an EP layout holding ``local_experts`` experts (EP = experts / local), built
  on a one-rank slice state (:func:`executor.parallel.groups.slice_state`: groups of their real sizes whose
  collectives move nothing) with the router's choices replaced by even routing over all experts
  (:class:`executor.slices.ScenarioRouter`), ``tokens`` tokens. One forward + backward of the layer cut into
  its phases by the layer's own markers (:class:`executor.timing.PhaseTimer`: router, dispatch, ep_alltoall,
  experts, combine, other), each step queued behind a short GPU sleep so the host is ahead at the start, as in
  a step where earlier layers keep the GPU busy (median of ``steps``); the phase ``ep_alltoall`` is the
  exchange stub: its split-size read (a host sync) and receive buffers, no bytes cross a link. Also the layer's
  steady seconds per step, back to back.
* :func:`measure_router`: the router alone (GEMM over all experts, scores, top-k, aux loss), forward +
  backward, device time with the host ahead (:func:`executor.microbench.timing.time_host_ahead`).
* :func:`measure_host`: the host's seconds to issue one forward + backward (no synchronisation inside) of (a)
  the executor's MoE layer with ``local_experts`` experts on one rank (ep 1, grouped GEMMs) and (b) the same
  experts run as a loop of one GEMM launch per expert and pass (fc1 and fc2 forward, their input and weight
  gradients backward: 6 per expert, as Transformer Engine's GroupedLinear on Hopper), at ``tokens`` tokens
  (few: the host, not the device, is what is timed). The slope over the local experts is the host's seconds
  per local expert.

On the CPU (tests) every figure is wall clock and the shapes are whatever the caller passes.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F

from executor.kernels import get_backend
from executor.microbench.moe_bar import layer_fwd_bwd, moe_spec
from executor.microbench.timing import (sleep_cycles_per_second, synchronize, time_host_ahead, time_host_issue_idle,
                                         time_steady)
from executor.moe import MoELayer, expert_swiglu
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state, slice_state
from executor.router import Router
from executor.slices import ScenarioRouter, assignment
from executor.timing import PhaseTimer
from spec.model_spec import ModelSpec
from spec.parallel_config import ParallelConfig
from spec.routing_scenarios import even_load, routed_counts

#: GPU seconds each in-step sample is queued behind, so the host has issued the router and the permutation
#: (about a hundred kernels, well under a millisecond to issue) before the GPU reaches them
LEAD_SLEEP_S = 3e-3
#: the phases of the permutation (the dispatcher's own work around the exchange) and of the exchange stub
PERMUTATION_PHASES = ("dispatch", "combine")
EXCHANGE_PHASES = ("ep_alltoall",)


def _randn(*shape: int, device: torch.device, dtype: torch.dtype, scale: float = 1.0, grad: bool = False):
    t = (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)
    return t.requires_grad_(grad)


def slice_layer(spec: ModelSpec, local_experts: int, tokens: int, device: torch.device, dtype: torch.dtype,
                timer: PhaseTimer) -> MoELayer:
    """The MoE layer of the rank holding experts 0..local_experts-1 of ``spec`` at EP = experts / local (alltoall
    dispatcher, one-rank slice state), routing ``tokens`` tokens evenly over all the experts."""
    experts = spec.num_experts or 1
    ep = experts // local_experts
    config = ParallelConfig(world_size=ep, ep=ep, micro_batch_size=1, moe_token_dispatcher_type="alltoall")
    options = ExecutorOptions.for_router(model=spec)
    layer = MoELayer(spec, options, slice_state(config, 0), 0, get_backend(options.kernel_backend), device, dtype,
                     timer)
    router = ScenarioRouter(layer.router)
    topk = spec.moe_router_topk
    counts = routed_counts(even_load(experts), tokens, topk)
    router.assign(assignment(counts, tokens, topk, device), torch.tensor(counts, dtype=torch.int64, device=device))
    layer.router = router
    return layer


def _phase_samples(step, timer: PhaseTimer, device: torch.device, steps: int) -> dict[str, float]:
    """Median seconds per phase over ``steps`` steps, each queued behind LEAD_SLEEP_S of GPU sleep on CUDA.

    The sleep only has to outlast the host's issue of the forward up to the dispatcher's split-size read (the
    step's one host sync, which then waits for it): the router and the permutation. The host probe times the
    issue of the whole forward + backward (:func:`measure_host`), an upper bound to compare with."""
    per: dict[str, list[float]] = {}
    cycles = int(sleep_cycles_per_second(device) * LEAD_SLEEP_S) if device.type == "cuda" else 0
    for _ in range(steps):
        synchronize(device)
        if cycles:
            torch.cuda._sleep(cycles)
        timer.start_step()
        step()
        for name, seconds in timer.end_step().items():
            per.setdefault(name, []).append(seconds)
    return {name: statistics.median(v) for name, v in per.items()}


def measure_point(spec: ModelSpec, local_experts: int, tokens: int, device: torch.device | str,
                  dtype: torch.dtype = torch.bfloat16, steps: int = 5, warmup: int = 2) -> dict:
    """One rank holding ``local_experts`` of ``spec``'s experts on ``tokens`` tokens (module docstring): phase
    seconds of one forward + backward (``phases_s``; ``permutation_s`` and ``exchange_stub_s`` their sums of
    PERMUTATION_PHASES and EXCHANGE_PHASES), the steady step seconds (``step_s``) and the rows the local
    experts received."""
    device = torch.device(device)
    timer = PhaseTimer(enabled=True, device=device)
    layer = slice_layer(spec, local_experts, tokens, device, dtype, timer)
    x = _randn(tokens, 1, spec.hidden_size, device=device, dtype=dtype, scale=0.5, grad=True)
    gy = _randn(tokens, 1, spec.hidden_size, device=device, dtype=dtype, scale=1e-3)
    step = layer_fwd_bwd(layer, x, gy)
    timer.enabled = False
    for _ in range(max(1, warmup)):
        step()
    synchronize(device)
    received = _received_rows(layer, step)
    timer.enabled = True
    phases = _phase_samples(step, timer, device, steps)
    timer.enabled = False
    steady = time_steady(step, device, iters=max(2, steps), lead=1 if device.type == "cuda" else 0, trials=3)
    out = {"model": spec.name, "local_experts": local_experts, "ep": (spec.num_experts or 1) // local_experts,
           "tokens": tokens, "received_rows": received, "phases_s": phases,
           "permutation_s": sum(phases.get(p, 0.0) for p in PERMUTATION_PHASES),
           "exchange_stub_s": sum(phases.get(p, 0.0) for p in EXCHANGE_PHASES),
           "router_phase_s": phases.get("router", 0.0), "experts_phase_s": phases.get("experts", 0.0),
           "step_s": steady, "lead_sleep_s": LEAD_SLEEP_S if device.type == "cuda" else 0.0}
    del layer, step, x, gy
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _received_rows(layer: MoELayer, step) -> int:
    """Rows the local experts receive in one ``step`` (read from the experts' input)."""
    seen: list[int] = []
    handle = layer.experts.register_forward_pre_hook(lambda _m, args: seen.append(int(args[0].shape[0])))
    try:
        step()
    finally:
        handle.remove()
    return seen[0]


def measure_router(spec: ModelSpec, tokens: int, device: torch.device | str,
                   dtype: torch.dtype = torch.bfloat16) -> dict:
    """The router of ``spec`` alone on ``tokens`` tokens: forward + backward seconds with the host ahead (its
    GEMM over all experts, scores, top-k, the aux loss where the model's router options train with one)."""
    device = torch.device(device)
    router = Router(spec, ExecutorOptions.for_router(model=spec), single_process_state(), 0, device, dtype)
    x = _randn(tokens, spec.hidden_size, device=device, dtype=dtype, scale=0.5, grad=True)
    g = torch.rand(tokens, spec.moe_router_topk, device=device).to(router(x).probs_NK.dtype)

    def fwd_bwd() -> None:
        router.zero_grad(set_to_none=True)
        x.grad = None
        r = router(x)
        outs, grads = [r.probs_NK], [g]
        if r.loss.requires_grad:
            outs.append(r.loss)
            grads.append(torch.ones_like(r.loss))
        torch.autograd.backward(outs, grads)

    timed = time_host_ahead(fwd_bwd, device, calls=8 if device.type == "cuda" else 2,
                            windows=3 if device.type == "cuda" else 1, warmup=2)
    del router
    return {"model": spec.name, "tokens": tokens, "router_s": timed.seconds, "method": timed.method}


class ExpertLoop(torch.nn.Module):
    """``experts`` SwiGLU experts run with one GEMM launch per expert and pass, as a runtime without grouped
    kernels does: fc1 per expert, the activation once over all rows, fc2 per expert (their input and weight
    gradients per expert backward). Weights are one parameter per expert, as TE's GroupedLinear holds them."""

    def __init__(self, experts: int, hidden: int, ffn: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.fc1 = torch.nn.ParameterList(
            _randn(2 * ffn, hidden, device=device, dtype=dtype, scale=0.02, grad=True) for _ in range(experts))
        self.fc2 = torch.nn.ParameterList(
            _randn(hidden, ffn, device=device, dtype=dtype, scale=0.02, grad=True) for _ in range(experts))

    def forward(self, x_MH: torch.Tensor, rows: list[int]) -> torch.Tensor:
        h = torch.cat([F.linear(part, w) for part, w in zip(x_MH.split(rows), self.fc1)])
        a = expert_swiglu(h)
        return torch.cat([F.linear(part, w) for part, w in zip(a.split(rows), self.fc2)])


def measure_host(hidden: int, ffn: int, topk: int, local_experts: int, tokens: int, device: torch.device | str,
                 dtype: torch.dtype = torch.bfloat16, repeats: int = 7) -> dict:
    """Host seconds to issue one forward + backward of the executor's MoE layer with ``local_experts`` experts of
    width ``hidden`` x ``ffn`` (top-min(topk, local_experts), ep 1) and of :class:`ExpertLoop` over the same rows
    (the layer's top-k copies of ``tokens`` tokens, spread evenly)."""
    device = torch.device(device)
    k = min(topk, local_experts)
    spec = moe_spec(hidden, ffn, local_experts, k)
    layer = MoELayer(spec, ExecutorOptions(), single_process_state(), 0, get_backend("torch"), device, dtype)
    x = _randn(tokens, 1, hidden, device=device, dtype=dtype, scale=0.5, grad=True)
    gy = _randn(tokens, 1, hidden, device=device, dtype=dtype, scale=1e-3)
    step = layer_fwd_bwd(layer, x, gy)
    for _ in range(2):
        step()
    layer_s = time_host_issue_idle(step, device, repeats)
    del layer, step

    rows_total = tokens * k
    rows = [rows_total // local_experts + (1 if e < rows_total % local_experts else 0) for e in range(local_experts)]
    loop = ExpertLoop(local_experts, hidden, ffn, device, dtype)
    xr = _randn(rows_total, hidden, device=device, dtype=dtype, scale=0.5, grad=True)
    gr = _randn(rows_total, hidden, device=device, dtype=dtype, scale=1e-3)

    def loop_step() -> None:
        loop.zero_grad(set_to_none=True)
        xr.grad = None
        loop(xr, rows).backward(gr)

    for _ in range(2):
        loop_step()
    loop_s = time_host_issue_idle(loop_step, device, repeats)
    del loop
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"hidden": hidden, "ffn": ffn, "topk": k, "local_experts": local_experts, "tokens": tokens,
            "layer_host_s": layer_s, "loop_host_s": loop_s, "loop_gemm_launches": 6 * local_experts}


@dataclasses.dataclass(frozen=True)
class FinePlan:
    """What one run measures: per model (``costmodel.finegrained.routed_proxy`` specs), every local-expert count
    at every token count (points), the router at every token count, and the host at ``host_tokens``."""

    specs: tuple[ModelSpec, ...]
    local_experts: tuple[int, ...]
    tokens: tuple[int, ...]
    host_tokens: int
    steps: int = 5
    host_repeats: int = 7


def _attempt(out: dict, what: str, measure, device: torch.device):
    """``measure()``, or None with ``what`` and the error listed in ``out['skipped']`` where it raised (out of
    memory, a kernel the device refuses): one failed point does not lose the run."""
    try:
        return measure()
    except (RuntimeError, ValueError) as exc:
        out["skipped"].append(f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None


def run_plan(plan: FinePlan, device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
             progress=print, budget_s: float | None = None) -> dict:
    """Every measurement of ``plan`` on ``device``: {'points': [...], 'router': [...], 'host': [...], 'skipped':
    [...]}. The cheap ones first (per model: the host probe at every local-expert count, the router at every token
    count), then the points; once ``budget_s`` seconds have passed no further point starts (each is listed in
    'skipped', as is a measurement that raised). ``progress(line)`` after each measurement."""
    device = torch.device(device)
    started = time.perf_counter()
    out: dict[str, list] = {"points": [], "router": [], "host": [], "skipped": []}

    def say(line: str) -> None:
        progress(f"[{time.perf_counter() - started:6.1f} s] {line}")

    fits = [(spec, n) for spec in plan.specs for n in plan.local_experts if (spec.num_experts or 1) % n == 0]
    out["skipped"] += [f"{spec.name}: {n} local experts do not divide {spec.num_experts}"
                       for spec in plan.specs for n in plan.local_experts if (spec.num_experts or 1) % n]
    for spec in plan.specs:
        for _, n in (f for f in fits if f[0] is spec):
            h = _attempt(out, f"host {spec.name}, {n} local experts", lambda: measure_host(
                spec.hidden_size, spec.expert_ffn_hidden_size, spec.moe_router_topk, n, plan.host_tokens, device,
                dtype, plan.host_repeats), device)
            if h is not None:
                out["host"].append({"model": spec.name, **h})
                say(f"host {spec.name}, {n} local experts, {plan.host_tokens} tokens: executor layer "
                    f"{h['layer_host_s'] * 1e3:.3f} ms, per-expert launches {h['loop_host_s'] * 1e3:.3f} ms")
        for tokens in plan.tokens:
            r = _attempt(out, f"router {spec.name}, {tokens} tokens",
                         lambda: measure_router(spec, tokens, device, dtype), device)
            if r is not None:
                out["router"].append(r)
                say(f"router {spec.name}, {tokens} tokens: {r['router_s'] * 1e3:.3f} ms ({r['method']})")
    for spec, n in fits:
        for tokens in plan.tokens:
            what = f"{spec.name}: {n} local experts, {tokens} tokens"
            if budget_s is not None and time.perf_counter() - started > budget_s:
                out["skipped"].append(f"{what} (past the {budget_s:.0f} s budget)")
                continue
            p = _attempt(out, what, lambda: measure_point(spec, n, tokens, device, dtype, plan.steps), device)
            if p is None:
                say(f"point {what}: failed ({out['skipped'][-1]})")
                continue
            out["points"].append(p)
            say(f"point {spec.name}, {n} local experts (EP {p['ep']}), {tokens} tokens: step "
                f"{p['step_s'] * 1e3:.3f} ms, router phase {p['router_phase_s'] * 1e3:.3f}, permutation "
                f"{p['permutation_s'] * 1e3:.3f}, experts {p['experts_phase_s'] * 1e3:.3f}, exchange stub "
                f"{p['exchange_stub_s'] * 1e3:.3f} ms")
    return out
