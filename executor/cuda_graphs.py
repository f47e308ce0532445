"""CUDA graphs of a decoder layer's static half (``ExecutorOptions.cuda_graphs``, off by default).

The static half of a layer is everything before its MLP/MoE: the attention block (input RMSNorm, Q/K/V
projections, RoPE, SDPA, output projection), the residual add and the MLP's input RMSNorm. Its shapes depend
only on the micro-batch shape, so its forward and its backward are each captured once per input shape into
a CUDA graph and replayed: one launch instead of ~30 forward and ~40 backward kernel launches, which matters
where the host, not the GPU, is the limit (small micro-batches, short sequences).

The MoE part is never captured: in dropless routing its expert token counts change every step (the grouped
GEMMs' group sizes, the permutation's length), and the router's top-k feeds them; it stays eager.

Replays reuse static buffers: the forward's outputs (and the activations its backward reads) are overwritten
by the next forward replay of the same layer, so a layer must run its backward before its next forward, as
one micro-batch after another does. :func:`refusal` says where that or the capture itself does not hold.
Gradients handed back are copies (a parameter's ``.grad`` must not alias a buffer the next replay rewrites).
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from spec.attention_kinds import GQA
from spec.parallel_config import ParallelConfig
from executor.timing import NULL_TIMER

#: Warm-up iterations on a side stream before capture (lazy initialisation, Triton compiles, cuBLAS handles).
WARMUP_ITERS = 3
#: Input shapes captured per layer; a layer that sees more falls back to eager for the new ones.
MAX_SHAPES = 4


def refusal(config: ParallelConfig, kernel_backend: str, attention_kind: str, device: torch.device) -> str | None:
    """Why ``cuda_graphs`` cannot run here (one readable sentence), or None when it can."""
    if torch.device(device).type != "cuda":
        return f"cuda_graphs needs a CUDA device; this executor runs on {torch.device(device).type}"
    if config.tp > 1 or config.cp > 1:
        return (f"cuda_graphs captures the attention block without its collectives: needs tp = cp = 1 "
                f"(got tp {config.tp}, cp {config.cp})")
    if config.pp > 1:
        return ("cuda_graphs replays static buffers, which hold one micro-batch per layer: pipeline schedules "
                f"run several forwards before their backwards (pp {config.pp})")
    if config.recompute_granularity == "full":
        return "cuda_graphs does not capture recomputation (recompute_granularity 'full')"
    captured = sorted({"core_attn", "layernorm"} & set(config.recompute_modules))
    if config.recompute_granularity == "selective" and captured:
        return f"cuda_graphs does not capture recomputation inside the attention half (recompute_modules {captured})"
    moved = sorted({"core_attn", "layernorm"} & set(config.activation_offload_modules))
    if moved:
        return f"cuda_graphs does not capture activation offload inside the attention half (activation_offload {moved})"
    if config.overlap_param_gather and config.use_distributed_optimizer and config.world_size > 1:
        return ("cuda_graphs skips the forward hooks that wait for overlapped parameter gathers: turn "
                "overlap_param_gather off")
    if kernel_backend != "torch":
        return f"cuda_graphs needs the 'torch' kernels (the {kernel_backend!r} backend caches quantised weights between replays)"
    if attention_kind != GQA.label:
        return f"cuda_graphs covers the {GQA.label} attention block only (got {attention_kind})"
    return None


class StaticHalf(torch.nn.Module):
    """(x + attention(x), rms_norm(that)): the part of a decoder layer captured in a graph."""

    def __init__(self, attention: torch.nn.Module, mlp_norm: torch.nn.Parameter, rms_norm, eps: float):
        super().__init__()
        self.attention, self.mlp_norm, self.rms_norm, self.eps = attention, mlp_norm, rms_norm, eps

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attention(x, (cos, sin))
        return x, self.rms_norm(x, self.mlp_norm, self.eps)


@contextlib.contextmanager
def _untimed(module: torch.nn.Module):
    """Phase markers record events: keep them out of warm-up and capture (the caller marks the whole half)."""
    saved = [(m, m.timer) for m in module.modules() if hasattr(m, "timer")]
    for m, _ in saved:
        m.timer = NULL_TIMER
    try:
        yield
    finally:
        for m, timer in saved:
            m.timer = timer


class _Captured:
    """One input shape's forward and backward graphs of a :class:`StaticHalf`."""

    def __init__(self, half: StaticHalf, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        self.params = tuple(p for p in half.parameters() if p.requires_grad)
        self.x_grad = x.requires_grad
        self.static_in = (x.detach().clone().requires_grad_(x.requires_grad), cos.detach().clone(),
                          sin.detach().clone())
        wrt = ((self.static_in[0],) if self.x_grad else ()) + self.params
        with _untimed(half):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_ITERS):
                    out = half(*self.static_in)
                    torch.autograd.grad(out, wrt, grad_outputs=[torch.ones_like(o) for o in out], allow_unused=True)
                del out
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            pool = torch.cuda.graph_pool_handle()
            self.fwd = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.fwd, pool=pool):
                self.static_out = half(*self.static_in)
            self.static_grad_out = tuple(torch.empty_like(o) for o in self.static_out)
            self.bwd = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.bwd, pool=pool):
                self.static_grad_in = torch.autograd.grad(self.static_out, wrt, grad_outputs=self.static_grad_out,
                                                          allow_unused=True)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        for static, given in zip(self.static_in, inputs):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given)
        self.fwd.replay()
        return tuple(o.detach() for o in self.static_out)

    def backward(self, grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        for static, given in zip(self.static_grad_out, grads):
            if given is None:
                static.zero_()
            elif static.data_ptr() != given.data_ptr():
                static.copy_(given)
        self.bwd.replay()
        got = [g.clone() if g is not None else None for g in self.static_grad_in]
        x_grad = got.pop(0) if self.x_grad else None
        return (x_grad, None, None, *got)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, captured: _Captured, x, cos, sin, *params):
        ctx.captured = captured
        return captured.forward((x, cos, sin))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        return (None, *ctx.captured.backward(grads))


class GraphedStaticHalf:
    """A layer's static half run from CUDA graphs, captured on first use per (shape, dtype, x needs grad).

    Called with grad mode off (evaluation) it runs eagerly: the graphs hold a training forward and backward."""

    def __init__(self, half: StaticHalf):
        self.half = half
        self.graphs: dict[tuple, _Captured] = {}
        self._warned = False

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not torch.is_grad_enabled():
            return self.half(x, cos, sin)
        key = (tuple(x.shape), x.dtype, x.requires_grad, tuple(cos.shape))
        captured = self.graphs.get(key)
        if captured is None:
            if len(self.graphs) >= MAX_SHAPES:
                if not self._warned:
                    warnings.warn(f"cuda_graphs: more than {MAX_SHAPES} input shapes for one layer; "
                                  "new shapes run eagerly", stacklevel=2)
                    self._warned = True
                return self.half(x, cos, sin)
            captured = self.graphs[key] = _Captured(self.half, x, cos, sin)
        return _Replay.apply(captured, x, cos, sin, *captured.params)
