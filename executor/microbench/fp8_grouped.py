"""foldtune's grouped fp8 GEMM (:mod:`executor.kernels.fp8.grouped_gemm`) against torch's kernels at a model's
expert shapes: the measurement core of ``bench/fp8_grouped_gemm.py``.

Per model, the routed rows of one micro-batch (``tokens`` · top-k, split evenly over the experts, as a
balanced router gives them) through both expert weights, ``w13`` (gate and up fused: N = 2·ffn, K = hidden)
and ``w2`` (N = hidden, K = ffn), each in its three products: forward [T, K]·w[g]ᵀ, dgrad [T, N]·w[g] and
wgrad dyᵀ·x per expert (the contraction over the expert's tokens). Each product is timed as device time with
the host ahead (:func:`executor.microbench.timing.time_host_ahead`) in:

- ``bf16``: ``torch._grouped_mm`` in bf16 (the executor's bf16 path);
- ``torch_fp8``: ``torch._scaled_grouped_mm`` with rowwise scales, the wgrad in its padded per-expert layout
  (:mod:`executor.microbench.fp8_gemms`, as the executor's 'torch' fp8 path calls it);
- ``dense_fp8``: one ``torch._scaled_mm`` of the same FLOPs (all rows against one weight): the rate a grouped
  kernel is measured against;
- ``rowwise`` / ``blockwise``: foldtune's kernel on operands quantised beforehand (the kernel alone), its
  config tuned on the first call (:func:`executor.kernels.fp8.grouped_gemm.tuned`).

Per product also the relative Frobenius error of each fp8 result against the bf16 one (e4m3's band is
about 0.03-0.04; a wrong kernel shows far outside it), and per weight the linear layer's three products
plus the quantisation of its two activations (x in the forward, dy in the backward, each into both forms)
against bf16's three products: what a layer gains.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from executor.kernels.fp8 import grouped_gemm as gg, grouped_quant as gq
from executor.microbench.fp8_gemms import GemmShape, bf16_op, fp8_op, offsets
from executor.microbench.timing import time_host_ahead
from spec.model_spec import ModelSpec

PRODUCTS = ("fwd", "dgrad", "wgrad")
KINDS = ("bf16", "torch_fp8", "dense_fp8", "rowwise", "blockwise")


@dataclass(frozen=True, kw_only=True)
class Product(GemmShape):
    """One grouped GEMM of ``model``'s experts (:class:`executor.microbench.fp8_gemms.GemmShape`): the rows
    split evenly over ``groups`` experts; a wgrad (``wgrad``) contracts k, the rows, per expert into
    [groups, m, n]. ``weight`` 'w13' or 'w2', ``product`` one of PRODUCTS, ``tokens`` the micro-batch's
    tokens (before top-k routing) it was made for."""

    model: str
    weight: str
    product: str
    tokens: int = 0

    @property
    def name(self) -> str:
        return f"{self.weight} {self.product}"


def products(name: str, model: ModelSpec, tokens: int) -> list[Product]:
    """The six expert GEMMs of one micro-batch of ``tokens`` tokens of ``model``."""
    rows = tokens * model.moe_router_topk
    g, h, f = model.num_experts, model.hidden_size, model.expert_ffn_hidden_size
    out = []
    for weight, n, k in (("w13", 2 * f, h), ("w2", h, f)):
        at = dict(model=name, weight=weight, tokens=tokens)
        out += [Product(rows, n, k, g, False, product="fwd", **at),
                Product(rows, k, n, g, False, product="dgrad", **at),
                Product(n, k, rows, g, True, product="wgrad", **at)]
    return out


def _operands(p: Product, device: torch.device):
    """bf16 operands of ``p`` and the experts' offsets: (a [m, k], w [G, n, k]) for fwd/dgrad, (dy [rows, m],
    x [rows, n]) for wgrad."""
    gen = torch.Generator(device=device).manual_seed(0)
    bf = dict(device=device, dtype=torch.bfloat16)
    if p.wgrad:
        return (torch.randn(p.k, p.m, generator=gen, **bf), torch.randn(p.k, p.n, generator=gen, **bf),
                offsets(p.k, p.groups, device))
    return (torch.randn(p.m, p.k, generator=gen, **bf), torch.randn(p.groups, p.n, p.k, generator=gen, **bf),
            offsets(p.m, p.groups, device))


def ours_op(p: Product, scaling: str, device: torch.device, kernel: bool, fast_accum: bool = False):
    """(call, quantisation call): foldtune's kernel for ``p`` on operands quantised beforehand, and the
    quantisation of the activation (both forms) that feeds it; ``fast_accum``: a rowwise forward or dgrad
    without promotion (the wgrad always promotes)."""
    a, b, offs = _operands(p, device)
    if p.wgrad:
        (_, ta), (_, tb) = (gq.quantize_activation(t, offs, scaling, rows=False, tokens=True, kernel=kernel)
                            for t in (a, b))
        return (lambda: gg.k_grouped(ta, tb, offs, scaling, kernel),
                lambda: gq.quantize_activation(a, offs, scaling, rows=True, tokens=True, kernel=kernel))
    rows, _ = gq.quantize_activation(a, offs, scaling, kernel=kernel)
    fwd, _ = gq.quantize_weight(b, scaling, kernel)
    fast = fast_accum and scaling == "rowwise"
    return (lambda: gg.m_grouped(rows, fwd, offs, scaling, kernel, fast_accum=fast),
            lambda: gq.quantize_activation(a, offs, scaling, rows=True, tokens=True, kernel=kernel))


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _bf16_result(p: Product, device: torch.device) -> torch.Tensor:
    """``p`` on its bf16 operands: torch._grouped_mm on a GPU, per expert in fp32 elsewhere."""
    a, b, offs = _operands(p, device)
    if device.type == "cuda":
        return torch._grouped_mm(a.t(), b, offs=offs) if p.wgrad else torch._grouped_mm(a, b.transpose(-2, -1),
                                                                                        offs=offs)
    bounds = [0, *offs.tolist()]
    spans = list(enumerate(zip(bounds, bounds[1:])))
    if p.wgrad:
        return torch.stack([a[lo:hi].float().t() @ b[lo:hi].float() for _, (lo, hi) in spans])
    return torch.cat([a[lo:hi].float() @ b[g].float().t() for g, (lo, hi) in spans])


class WrongResult(AssertionError):
    """An fp8 product off its bf16 result by more than e4m3's rounding explains: a wrong kernel, not timed."""


def measure(items: list[Product], device: torch.device, kernel: bool, scalings=gq.SCALINGS, calls: int = 8,
            progress: Callable[[str], object] = print, fast_accum: bool = False,
            max_rel_err: float | None = None) -> list[dict]:
    """Per product: its fields, each kind's device seconds and TFLOP/s (``{kind}_s``, ``{kind}_tflops``;
    torch's kinds only on a CUDA GPU), foldtune's kernel's fraction of the dense fp8 rate
    (``{scaling}_of_dense``), its tuned config (``{scaling}_config``), the activation quantisation's seconds
    (``{scaling}_quant_s``) and the result's relative error against bf16 (``{scaling}_rel_err``);
    ``kernel``: foldtune's Triton kernels (else their emulation); ``fast_accum``: :func:`ours_op`'s;
    ``max_rel_err``: raise :class:`WrongResult` before timing a product whose fp8 result is further than
    this (relative Frobenius) from bf16's."""
    out = []
    for p in items:
        row = asdict(p) | {"name": p.name, "flops": p.flops}
        ops: dict[str, Callable] = {}
        if device.type == "cuda":
            ops = {"bf16": bf16_op(p, device), "torch_fp8": fp8_op(p, device),
                   "dense_fp8": fp8_op(p, device, grouped_as_dense=True)}
        want = _bf16_result(p, device)
        for scaling in scalings:
            call, quant = ours_op(p, scaling, device, kernel, fast_accum)
            row[f"{scaling}_rel_err"] = _rel_err(call(), want)  # the first call tunes the config
            if max_rel_err is not None and not row[f"{scaling}_rel_err"] <= max_rel_err:
                raise WrongResult(f"{p.model} {p.name} at {p.tokens} tokens, {scaling}: relative error "
                                  f"{row[f'{scaling}_rel_err']:.4f} against bf16 > {max_rel_err}")
            config = gg.last_config("k" if p.wgrad else "m")
            row[f"{scaling}_config"] = config.label() if kernel and config else "emulated"
            ops[scaling] = call
            row[f"{scaling}_quant_s"] = time_host_ahead(quant, device, calls=calls, windows=3).seconds
        del want
        for kind, op in ops.items():
            seconds = time_host_ahead(op, device, calls=calls, windows=5).seconds
            row[f"{kind}_s"], row[f"{kind}_tflops"] = seconds, p.flops / seconds / 1e12
        for scaling in scalings:
            if "dense_fp8_s" in row:
                row[f"{scaling}_of_dense"] = row["dense_fp8_s"] / row[f"{scaling}_s"]
        progress("  " + "  ".join([f"{p.model:16s} {p.tokens:6d} {p.name:10s}"] + [
            f"{kind} {row[kind + '_tflops']:5.0f}" for kind in KINDS if kind + "_tflops" in row]) + " TFLOP/s")
        out.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def layer_rows(rows: list[dict], scalings=gq.SCALINGS) -> list[dict]:
    """Per (model, weight, tokens): bf16's three products against foldtune's three plus two activation
    quantisations (x in the forward, dy in the backward), seconds and the quotient."""
    layers: dict[tuple, dict] = {}
    for r in rows:
        at = (r["model"], r["weight"], r.get("tokens", 0))
        layer = layers.setdefault(at, {"model": r["model"], "weight": r["weight"], "tokens": at[2],
                                       "flops": 0, "bf16_s": 0.0})
        layer["flops"] += r["flops"]
        if "bf16_s" in r:
            layer["bf16_s"] += r["bf16_s"]
        for scaling in scalings:
            quant = r[f"{scaling}_quant_s"] if r["product"] in ("fwd", "dgrad") else 0.0
            layer[f"{scaling}_s"] = layer.get(f"{scaling}_s", 0.0) + r[f"{scaling}_s"] + quant
    for layer in layers.values():
        for scaling in scalings:
            layer[f"{scaling}_speedup"] = layer["bf16_s"] / layer[f"{scaling}_s"] if layer["bf16_s"] else None
    return list(layers.values())
