"""The decoder stack's speed switches side by side: one stack of Mixtral-shaped decoder layers per variant
(:data:`VARIANTS`: ExecutorOptions overrides and how the gradients are handled), all on the same parameter
tensors, each timed isolated (sync before each fwd+bwd), in steady windows alternated between the variants (so
that every variant sees the same card clock) and by the host's issue time; the top device kernels of a variant
and, on a GPU, its device timeline (idle gaps, their host events, the host ops that launched small kernels).
``bench/stack_profile.py`` runs it against the dense GEMM and prints the table.
"""

from __future__ import annotations

import dataclasses
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from executor.attention import rope_tables
from executor.kernels import get_backend
from executor.microbench.device_timeline import device_timeline, kernel_launchers
from executor.microbench.timing import time_device, time_host_issue, time_steady_window
from executor.model import DecoderLayer
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from executor.timing import NULL_TIMER
from spec.flops import flops_per_token
from spec.model_spec import ModelSpec

_UNFUSED = {"fused_qkv": False, "fused_rope": False, "fused_rms_norm": False}
#: name -> (ExecutorOptions overrides, gradient handling: 'accumulate' keeps .grad, 'none' sets it to None)
VARIANTS: dict[str, tuple[dict, str]] = {
    "before": (_UNFUSED, "accumulate"),
    "grads_none": (_UNFUSED, "none"),
    "qkv": ({"fused_rope": False, "fused_rms_norm": False}, "none"),
    "rope": ({"fused_rms_norm": False}, "none"),
    "after": ({}, "none"),
    "cudnn": ({"attention_backend": "cudnn"}, "none"),
    "graphs": ({"cuda_graphs": True}, "none"),
    "cudnn_graphs": ({"attention_backend": "cudnn", "cuda_graphs": True}, "none"),
    # diagnostic, no bar: the router's load balancing forced (Megatron's benchmark setting, as the MoE bar)
    "after_balanced": ({"moe_router_force_load_balancing": True}, "none"),
}
TOP = 15


@dataclasses.dataclass
class Stack:
    """One variant's decoder layers on shared parameters, its input and output gradient, and its step."""

    name: str
    options: ExecutorOptions
    grads: str
    layers: torch.nn.ModuleList
    x: torch.Tensor
    gy: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]

    def step(self) -> None:
        """One fwd+bwd of the layers (gradients set to None first where ``grads`` is 'none')."""
        if self.grads == "none":
            for p in self.layers.parameters():
                p.grad = None
            self.x.grad = None
        y = self.x
        for layer in self.layers:
            y, _ = layer(y, self.rope)
        y.backward(self.gy)


@dataclasses.dataclass
class GemmLoop:
    """The dense GEMM as one more entry of the alternated steady windows: ``reps`` back-to-back n × n × n
    products per step, about one stack step long, so that it runs at the clock the stack runs at (a card at
    its power cap lowers its clock within a window; the headline GEMM is timed in short bursts)."""

    name: str
    a: torch.Tensor
    b: torch.Tensor
    reps: int

    def step(self) -> None:
        """``reps`` products."""
        for _ in range(self.reps):
            self.a @ self.b

    def tflops(self, seconds_per_step: float) -> float:
        """TFLOP/s of a step that took ``seconds_per_step``."""
        return self.reps * 2 * self.a.shape[0] ** 3 / seconds_per_step / 1e12


def share_parameters(dst: torch.nn.Module, src: torch.nn.Module) -> None:
    """Make every parameter of ``dst`` the same tensor as ``src``'s of that name (variants share weights and
    the GPU's memory holds one copy)."""
    for name, module in dst.named_modules():
        source = src.get_submodule(name)
        for pname in list(module._parameters):
            module._parameters[pname] = source._parameters[pname]


def build_stack(name: str, spec: ModelSpec, seq: int, mbs: int, dev: torch.device, dtype: torch.dtype,
                base: torch.nn.ModuleList | None) -> Stack:
    """Variant ``name``'s stack; on ``base``'s parameters when given. SpecError where the options are refused."""
    overrides, grads = VARIANTS[name]
    options = ExecutorOptions(**overrides)
    kernels = get_backend("torch")
    state = single_process_state()
    layers = torch.nn.ModuleList(DecoderLayer(spec, options, state, i, True, kernels, dev, dtype, NULL_TIMER)
                                 for i in range(spec.num_layers))
    if base is not None:
        for layer, source in zip(layers, base):
            share_parameters(layer, source)
            if layer.graphed is not None:  # its captured part must hold the shared mlp_norm (and gate) too
                layer.graphed.half.mlp_norm = layer.mlp_norm
                if layer.graphed.half.shared is not None:
                    layer.graphed.half.shared.shared_gate = layer.mlp.shared_gate
    generator = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(seq, mbs, spec.hidden_size, device=dev, dtype=dtype, generator=generator).requires_grad_(True)
    gy = torch.randn(seq, mbs, spec.hidden_size, device=dev, dtype=dtype, generator=generator)
    return Stack(name, options, grads, layers, x, gy, rope_tables(seq, spec.rotary_head_dim, options.rotary_base, dev))


def stack_flops(spec: ModelSpec, seq: int, mbs: int) -> float:
    """Megatron FLOPs of the layers' fwd+bwd: flops_per_token without the logits, times the tokens."""
    per_token = flops_per_token(spec, seq) - 3 * 2 * spec.hidden_size * spec.padded_vocab_size()
    return per_token * seq * mbs


def gemm_tflops(dev: torch.device, dtype: torch.dtype, n: int) -> dict:
    """The dense n × n × n GEMM from an idle device (median of 20 after 5 warm-up calls): seconds, TFLOP/s."""
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    t = time_device(lambda: a @ b, dev, 5, 20)
    return {"shape": [n, n, n], "seconds": t, "tflops": 2 * n**3 / t / 1e12}


def top_kernels(stack: Stack, dev: torch.device, steps: int) -> tuple[list[dict], dict | None]:
    """The ``TOP`` device kernels (CPU ops on a CPU run) with the largest total time over ``steps`` steps, and
    on a GPU the same steps' device timeline (:func:`device_timeline`)."""
    cuda = dev.type == "cuda"
    for _ in range(2):
        stack.step()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            stack.step()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages():
        if cuda:
            if evt.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
        else:
            us = evt.self_cpu_time_total
        rows.append((evt.key, evt.count, us))
    if cuda and not any(us for _, _, us in rows):  # no kernel-level rows: the ops' own device time
        rows = [(evt.key, evt.count, getattr(evt, "self_device_time_total", 0)) for evt in prof.key_averages()]
    total = sum(us for _, _, us in rows) or 1.0
    rows.sort(key=lambda r: -r[2])
    top = [{"name": key[:120], "calls": count / steps, "ms": us / steps / 1e3, "pct": 100 * us / total}
           for key, count, us in rows[:TOP]]
    if not cuda:
        return top, None
    events = prof.events()
    timeline = device_timeline(events, steps)
    timeline["launchers"] = kernel_launchers(events, steps)
    return top, timeline


def time_variants(stacks: list[Stack], dev: torch.device, rounds: int, iters: int) -> dict[str, dict]:
    """isolated, steady (alternated windows, order flipped every round) and host seconds per variant."""
    out = {s.name: {"isolated_s": time_device(s.step, dev, 2, 8), "host_s": time_host_issue(s.step, dev, 3)}
           for s in stacks}
    windows: dict[str, list[float]] = {s.name: [] for s in stacks}
    for r in range(rounds):
        for s in (stacks if r % 2 == 0 else stacks[::-1]):
            windows[s.name].append(time_steady_window(s.step, dev, iters, lead=2))
    for name, times in windows.items():
        out[name]["steady_s"] = statistics.median(times)
        out[name]["steady_windows_s"] = times
    return out
