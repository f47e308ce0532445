"""CUDA graphs of a decoder layer's static part (``ParallelConfig.cuda_graphs``; ``ExecutorOptions.cuda_graphs``
overrides it).

The static part of a layer is what :func:`spec.validity.cuda_graph_scope` names: the attention block (input
RMSNorm, Q/K/V projections, RoPE, SDPA, output projection), the residual add and the MLP's input RMSNorm, and in
an MoE layer the router's logits (its linear layer, before top-k) and the shared experts (their GEMMs do not
depend on the routing). Its shapes depend only on the micro-batch shape, so its forward and its backward are each
captured once per input shape into a CUDA graph and replayed: one launch instead of the forward's and the
backward's kernel launches, which matters where the host, not the GPU, is the limit (small micro-batches,
short sequences, many small kernels).

The rest of the MoE block is never captured: in dropless routing its expert token counts change every step (the
grouped GEMMs' group sizes, the permutation's length), and the top-k feeds them; it stays eager and takes the
replayed logits and shared-expert output as inputs.

Replays reuse static buffers: the forward's outputs (and the activations its backward reads) are overwritten
by the next forward replay of the same layer, so a layer must run its backward before its next forward, as
one micro-batch after another does. :func:`refusal` says where that or the capture itself does not hold: the
rule book's cuda_graphs rules (``spec.validity.cuda_graphs_rejections``) and what only the executor's options
decide (the device, the kernel backend).
Gradients handed back are copies (a parameter's ``.grad`` must not alias a buffer the next replay rewrites).
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from spec.parallel_config import ParallelConfig
from spec.validity import cuda_graphs_rejections
from executor.timing import NULL_TIMER

#: Warm-up iterations on a side stream before capture (lazy initialisation, Triton compiles, cuBLAS handles).
WARMUP_ITERS = 3
#: Input shapes captured per layer; a layer that sees more falls back to eager for the new ones.
MAX_SHAPES = 4


def refusal(config: ParallelConfig, kernel_backend: str, device: torch.device,
            precision: str | None = None) -> str | None:
    """Why CUDA graphs cannot run ``config`` here (one readable sentence), or None when they can: the device and
    the kernel backend (the executor's options), then the rule book's cuda_graphs rules."""
    if torch.device(device).type != "cuda":
        return f"cuda_graphs needs a CUDA device; this executor runs on {torch.device(device).type}"
    if kernel_backend != "torch":
        return f"cuda_graphs needs the 'torch' kernels (the {kernel_backend!r} backend caches quantised weights between replays)"
    found = cuda_graphs_rejections(config.replace(cuda_graphs=True), precision)
    return "; ".join(str(r) for r in found) if found else None


class StaticHalf(torch.nn.Module):
    """The part of a decoder layer captured in a graph: (x + attention(x), h = rms_norm(that)), then in an MoE
    layer the router's logits of h ([s·b, experts]) when ``router`` is given and the shared experts' output of h
    ([s, b, h]) when ``shared`` is (a callable module of h, e.g. :class:`SharedExperts`)."""

    def __init__(self, attention: torch.nn.Module, mlp_norm: torch.nn.Parameter, rms_norm, eps: float,
                 router: torch.nn.Module | None = None, shared: torch.nn.Module | None = None):
        super().__init__()
        self.attention, self.mlp_norm, self.rms_norm, self.eps = attention, mlp_norm, rms_norm, eps
        self.router, self.shared = router, shared

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = x + self.attention(x, (cos, sin))
        h = self.rms_norm(x, self.mlp_norm, self.eps)
        out = (x, h)
        if self.router is not None:
            out += (self.router.logits(h.reshape(-1, h.shape[-1])),)
        if self.shared is not None:
            out += (self.shared(h),)
        return out


class SharedExperts(torch.nn.Module):
    """An MoE layer's shared experts (with their gate) as a module of their own, for :class:`StaticHalf`."""

    def __init__(self, moe: torch.nn.Module):
        super().__init__()
        self.shared, self.shared_gate = moe.shared, moe.shared_gate
        self._run = moe._shared_experts

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self._run(h)


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
    """A layer's static part run from CUDA graphs, captured on first use per (shape, dtype, x needs grad).

    Called with grad mode off (evaluation) it runs eagerly: the graphs hold a training forward and backward."""

    def __init__(self, half: StaticHalf):
        self.half = half
        self.graphs: dict[tuple, _Captured] = {}
        self._warned = False

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
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
