"""Where an MoE layer's forward+backward time goes: each sub-step timed on its own, on the device.

:func:`breakdown` runs the layer of the MoE bar (:mod:`executor.microbench.moe_bar`: ``MoELayer`` of a
one-layer ModelSpec, one device) cut into the stages it is made of (:class:`StagedLayer`) — router, permute
(the dispatcher), the two grouped GEMMs (gate and up fused as ``gemm_w13``, N = 2·f; down as ``gemm_w2``),
SwiGLU, combine, and the shared expert where the model has one (``shared``: its three dense GEMMs and SwiGLU
on the layer's tokens, added to the combined output) — and their backward passes (each GEMM's backward is its
dgrad and wgrad), once with the real (random-weight) router and once with a round-robin router (perfect
balance). Each stage is reported twice:

- ``device_s``: the stage replayed in windows queued while the GPU is held busy
  (:func:`executor.microbench.timing.time_host_ahead`): device time, launch latency hidden. ``hidden`` is
  False when a window could not be queued ahead of the GPU (then the figure may include launch gaps).
- ``inline_s``: the stages run once in order with CUDA events between them, as a step does (median over
  steps): device time plus the gaps where the GPU waited for the host. Its sum is one stage-by-stage step.

Next to the stages: the whole layer step (steady state as the bar times it, isolated from an idle device,
device-only, host issue time), the ideal, and the same ideal on pre-permuted rows with the random router's
uneven group sizes, which separates what uneven groups cost the grouped GEMM itself (tile quantisation, no
dispatcher can remove it) from the layer's own overheads. ``ratio`` is ideal / layer in steady state (the
bar's definition), ``isolated_ratio`` the same from an idle device; ``ratio_vs_uneven_ideal`` is uneven-ideal /
layer in steady state. On the CPU (smoke runs) device times are wall clocks.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from executor.moe import expert_swiglu
from executor.microbench.moe_bar import bar_inputs, fused_paths, layer_fwd_bwd
from executor.microbench.timing import (HOST_AHEAD, WALL_CLOCK, synchronize, time_device, time_host_ahead,
                                        time_host_issue, time_steady)
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from executor.router import Router, Routing
from spec.model_spec import ModelSpec

class BalancedRouter(torch.nn.Module):
    """Stand-in router: token t takes experts (t·k + j) mod E with probability 1/k (perfect balance)."""

    def __init__(self, tokens: int, experts: int, topk: int, dev: torch.device):
        super().__init__()
        self.experts_NK = (torch.arange(tokens * topk, device=dev) % experts).view(tokens, topk)
        self.probs_NK = torch.full((tokens, topk), 1.0 / topk, device=dev, requires_grad=True)
        self.counts_E = torch.full((experts,), tokens * topk // experts, device=dev)

    def forward(self, x_NH, micro_batch_size: int = 1, real=None, logits=None):
        """The balanced assignment whatever the tokens (``real`` and ``logits``: the router's signature, unused)."""
        return Routing(self.experts_NK, self.probs_NK, x_NH.new_zeros((), dtype=torch.float32), self.counts_E)


def device_seconds(fn, dev: torch.device) -> tuple[float, bool]:
    """(device seconds per call of ``fn`` with its launches queued ahead of the GPU, whether every window
    was): :func:`executor.microbench.timing.time_host_ahead` over 5 windows of 8 calls on a GPU; on the CPU,
    where calls are synchronous and the figures only smoke-test the table, one window of 3."""
    calls, windows = (8, 5) if dev.type == "cuda" else (3, 1)
    timed = time_host_ahead(fn, dev, calls=calls, windows=windows, warmup=1)
    return timed.seconds, timed.method.startswith((HOST_AHEAD, WALL_CLOCK))


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

        synchronize(dev)
        staged.step(mark)
        synchronize(dev)
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


def _m_tiles(counts: torch.Tensor, tile: int = 128) -> int:
    """Row tiles the grouped GEMM runs at a ``tile``-row M tile (each group rounds up)."""
    return int(((counts + tile - 1) // tile).sum())


def breakdown(spec: ModelSpec, tokens: int = 4096, dev: torch.device | None = None,
              dtype: torch.dtype = torch.bfloat16, options: ExecutorOptions | None = None) -> dict:
    """The stage table of the MoE layer of the one-layer ``spec`` (:func:`executor.microbench.moe_bar.moe_spec`)
    under ``options`` (default ones) on ``tokens`` tokens (see the module docstring); seconds everywhere."""
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
            "layer_steady_s": time_steady(layer_step, dev),
            "layer_wall_s": time_device(layer_step, dev, warmup=3, repeats=10), "layer_device_s": layer_dev,
            "host_issue_s": time_host_issue(layer_step, dev),
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
        result[name] = {"steady_s": time_steady(ideal(counts), dev),
                        "wall_s": time_device(ideal(counts), dev, warmup=3, repeats=10), "device_s": dev_s,
                        "hidden": hid, "host_issue_s": time_host_issue(ideal(counts), dev)}

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
