"""The MoE layer bar: one GPU's MoE layer fwd+bwd against its ideal expert FFN, at the shapes of catalog models.

The ideal (:class:`SeparateGateUpExperts`) is three separate grouped GEMMs (gate, up, down) with SwiGLU
between, on pre-permuted, perfectly balanced rows; with a shared expert it adds that expert's three dense GEMMs
and SwiGLU on the layer's tokens (:class:`SharedExpertIdeal`). :func:`moe_bar` times the layer and the ideal
in alternated steady-state windows (:func:`executor.microbench.timing.time_paired_steady`) and reports
ideal / layer; ``bench/executor_gpu.py`` prints it against the bar of each :data:`MOE_SHAPES` entry.
"""

from __future__ import annotations

import dataclasses

import torch

from executor.kernels import get_backend, triton_permute, triton_router, triton_swiglu
from executor.microbench.timing import time_device, time_host_issue, time_paired_steady, time_steady
from executor.moe import MoELayer
from executor.options import ExecutorOptions
from executor.parallel.groups import single_process_state
from spec.catalog import get_model
from spec.model_spec import ModelSpec

# The router's rule as a model defines it (Megatron's names): what a bar layer copies from its catalog model.
ROUTING_FIELDS = ("moe_router_score_function", "moe_router_pre_softmax", "moe_router_num_groups",
                  "moe_router_group_topk", "moe_router_topk_scaling_factor")


def moe_spec(h: int, f: int, experts: int, topk: int, shared: int | None = None,
             like: ModelSpec | None = None) -> ModelSpec:
    """A one-layer ModelSpec of the benchmarked MoE shape: hidden ``h``, expert FFN ``f``, ``experts`` experts,
    top-``topk``, a shared expert of FFN ``shared`` (None: none), and the routing rule (score function,
    pre-softmax, group-limited top-k, top-k scaling: :data:`ROUTING_FIELDS`) of the model ``like`` (None: a
    plain softmax top-k)."""
    routing = {name: getattr(like, name) for name in ROUTING_FIELDS} if like is not None else {}
    return ModelSpec(name=f"moe-h{h}-f{f}-e{experts}-k{topk}" + (f"-s{shared}" if shared else ""), num_layers=1,
                     hidden_size=h, num_attention_heads=16, ffn_hidden_size=f, vocab_size=32000,
                     num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=f,
                     moe_shared_expert_intermediate_size=shared, **routing)


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """One MoE layer of the bar: its one-layer ModelSpec (sizes, the router's rule and the shared expert of the
    catalog model it stands for), whether its router carries DeepSeek-V3's expert bias (aux-loss-free
    balancing, an executor option), and its bar on ideal / layer (None: reported without a bar)."""

    spec: ModelSpec
    bar: float | None
    expert_bias: bool = False

    def options(self, **overrides) -> ExecutorOptions:
        """The layer's ExecutorOptions: the expert bias as the model trains with it, plus ``overrides``."""
        return ExecutorOptions(moe_router_enable_expert_bias=self.expert_bias, **overrides)


# DeepSeek-V3 on one GPU: 32 of its 256 experts, the share of one rank at EP8. The router keeps the model's
# rule: 8 groups (here of 4 experts; on a real EP8 rank its 32 experts are one whole group), the best 4 groups
# by the sum of their top-2 scores, sigmoid scores, scaling 2.5, expert bias. At seq 4096 the 32 experts get
# 4096·8/32 = 1024 rows each, as each expert of an EP8 rank does when 8 ranks of 4096 tokens send it
# 8·4096·8/256 rows: the same grouped GEMMs (32 groups × 1024 rows × h7168 × f2048) and the same 32768 rows to
# permute and combine per rank, and the shared expert runs on the rank's own 4096 tokens in both. What one GPU
# leaves out is the EP all-to-all and the router's 256-wide logits and top-k (a 4096 × 7168 × 256 GEMM, 0.5 %
# of the expert GEMMs' FLOPs).
DEEPSEEK_V3_EXPERTS = 32
_DSV3 = get_model("deepseek-v3")
# The bar's MoE layers and the sequence of one micro-batch.
MOE_SHAPES = {
    "mixtral": MoEShape(moe_spec(4096, 14336, 8, 2, like=get_model("mixtral-8x7b")), 0.95),
    "qwen3-30b-a3b": MoEShape(moe_spec(2048, 768, 128, 8, like=get_model("qwen3-30b-a3b")), 0.90),
    "deepseek-v3": MoEShape(moe_spec(_DSV3.hidden_size, _DSV3.expert_ffn_hidden_size, DEEPSEEK_V3_EXPERTS,
                                     _DSV3.moe_router_topk, _DSV3.shared_expert_ffn_hidden_size, like=_DSV3),
                            0.90, expert_bias=True),
}
SEQ = 4096
# The same code paths at shapes a CPU runs in seconds (dims multiples of 8 for the grouped GEMM); the tiny
# DeepSeek-V3 keeps 8 groups (of 2 experts), 4 of them chosen, for a top-4
TINY_MOE_SHAPES = {
    "mixtral": MoEShape(moe_spec(64, 96, 8, 2), 0.95),
    "qwen3-30b-a3b": MoEShape(moe_spec(32, 16, 16, 4, like=get_model("qwen3-30b-a3b")), 0.90),
    "deepseek-v3": MoEShape(moe_spec(32, 16, 16, 4, 24, like=_DSV3), 0.90, expert_bias=True),
}
TINY_SEQ = 64


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
               options: ExecutorOptions | None = None) -> BarInputs:
    """The MoE layer of the one-layer ``spec`` (:func:`moe_spec`; ``options`` default ones) and its ideal, on
    random data: ``seq·mbs`` tokens."""
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


def fused_paths() -> dict[str, bool]:
    """Which fused Triton paths passed their one-time self-check in this process (key → on)."""
    caches = (triton_router._CHECKED, triton_permute._CHECKED, triton_swiglu._CHECKED)
    return {str(key): ok for cache in caches for key, ok in cache.items()}


def _timings(step, dev: torch.device, steady_iters: int) -> dict[str, float]:
    """Seconds per call of ``step``: steady state (back to back, the bar), isolated (idle device before each
    call, median of 10) and the host's issue time."""
    return {"steady": time_steady(step, dev, iters=steady_iters),
            "isolated": time_device(step, dev, warmup=3, repeats=10), "host": time_host_issue(step, dev)}


def moe_bar(shape: MoEShape, seq: int, mbs: int, dev: torch.device, dtype: torch.dtype, steady_iters: int = 20,
            paired_rounds: int = 6) -> dict:
    """MoE layer fwd+bwd of ``shape`` vs the ideal on ``seq·mbs`` tokens: seconds per fwd+bwd, ratios ideal / layer.

    The bar (``ratio``, ``layer_s``, ``ideal_s``): the layer with its router's load balancing forced
    (``moe_router_force_load_balancing``: logits, softmax and probabilities computed as always, the experts
    assigned round-robin; Megatron's --moe-router-force-load-balancing, the convention of its published
    MoE-layer baselines) against the ideal on balanced rows, in ``paired_rounds`` alternated steady windows of
    ``steady_iters`` calls: what routing, permutation and combine cost. ``random_*``: the same layer with the
    random-weight router's own choices. Their uneven expert groups also cost the grouped GEMM itself (a group
    whose rows are not a multiple of the kernel's tile pays a partial tile), which no dispatcher removes:
    ``uneven_ideal_over_ideal`` is the ideal's seconds on those same group sizes over its seconds on balanced
    groups (≥ 1), and ``random_vs_uneven_ideal`` compares the layer with it. ``sequential_*`` and
    ``isolated_*`` are the forced layer timed back to back (layer's windows, then the ideal's) and from an idle
    device (sync per call); ``*host_issue_s``: host seconds to issue one fwd+bwd. With a shared expert both
    ideals include its dense GEMMs on the same tokens."""
    spec = shape.spec
    h, f, experts, topk = spec.hidden_size, spec.expert_ffn_hidden_size, spec.num_experts, spec.moe_router_topk
    shared_f = spec.shared_expert_ffn_hidden_size
    tokens = seq * mbs
    bar = bar_inputs(spec, seq, mbs, dev, dtype, shape.options(moe_router_force_load_balancing=True))
    layer = bar.layer
    random_layer = MoELayer(spec, shape.options(), single_process_state(), 0, get_backend("torch"), dev, dtype)
    random_layer.load_state_dict(layer.state_dict())

    layer_step, random_step = layer_fwd_bwd(layer, bar.x, bar.gy), layer_fwd_bwd(random_layer, bar.x, bar.gy)
    random_step()
    counts = random_layer.last_tokens_per_expert
    rows = tokens * topk
    # the ideal keeps three separate GEMMs, though the layer fuses gate+up
    ideal_step = ideal_fwd_bwd(bar.ideal, bar.xs, bar.gs, bar.balanced, bar.shared)
    uneven_ideal_step = ideal_fwd_bwd(bar.ideal, bar.xs, bar.gs, counts.clone(), bar.shared)
    t_layer, t_random, t_ideal = (_timings(step, dev, steady_iters) for step in (layer_step, random_step, ideal_step))

    def paired(a, b):
        return time_paired_steady(a, b, dev, rounds=paired_rounds, iters=steady_iters)

    forced, by_random = paired(layer_step, ideal_step), paired(random_step, ideal_step)
    uneven, uneven_vs_ideal = paired(random_step, uneven_ideal_step), paired(ideal_step, uneven_ideal_step)
    flops = 3 * 3 * 2 * (rows * h * f + tokens * h * shared_f)  # fwd+bwd of three GEMMs, experts and shared
    return {"shape": {"hidden": h, "ffn": f, "experts": experts, "topk": topk, "tokens": tokens, "seq": seq,
                      "mbs": mbs, "shared_ffn": shared_f, "score_function": spec.moe_router_score_function,
                      "num_groups": spec.moe_router_num_groups, "group_topk": spec.moe_router_group_topk,
                      "topk_scaling_factor": spec.moe_router_topk_scaling_factor, "expert_bias": shape.expert_bias},
            "timing": f"ratio: ideal / layer (router load balancing forced) in {paired_rounds} alternated "
                      f"steady-state windows of {steady_iters} fwd+bwd each (median of the rounds' ratios; the "
                      "windows share the card's power-limited clock); random_*: the random-weight router's own "
                      f"choices; sequential_*: {steady_iters} back to back, layer then ideal, median of 3; "
                      "isolated_*: sync before each fwd+bwd, median of 10",
            "layer_s": forced.a_s, "ideal_s": forced.b_s, "ratio": forced.ratio,
            "ratio_by_round": forced.ratio_by_round,
            "random_layer_s": by_random.a_s, "random_ratio": by_random.ratio,
            "random_ratio_by_round": by_random.ratio_by_round,
            "random_vs_uneven_ideal": uneven.ratio, "uneven_ideal_over_ideal": uneven_vs_ideal.ratio,
            "imbalance_max_over_mean": float(counts.float().max() / counts.float().mean()),
            "sequential_layer_s": t_layer["steady"], "sequential_ideal_s": t_ideal["steady"],
            "sequential_ratio": t_ideal["steady"] / t_layer["steady"],
            "sequential_random_ratio": t_ideal["steady"] / t_random["steady"],
            "isolated_layer_s": t_layer["isolated"], "isolated_ideal_s": t_ideal["isolated"],
            "isolated_ratio": t_ideal["isolated"] / t_layer["isolated"],
            "isolated_random_ratio": t_ideal["isolated"] / t_random["isolated"],
            "host_issue_s": t_layer["host"], "random_host_issue_s": t_random["host"],
            "ideal_host_issue_s": t_ideal["host"],
            "layer_tflops": flops / forced.a_s / 1e12, "ideal_tflops": flops / forced.b_s / 1e12,
            "fused_paths": fused_paths()}
