"""Time of the compute kernels of a training step: GEMMs, grouped GEMMs, attention, memory-bound ops.

Every function returns seconds on one GPU. Rates come from :func:`compute_rates`, which starts from the
GPU's datasheet peaks and the default efficiencies below, and prefers the measured curves a calibrated
:class:`~spec.hardware.HardwareProfile` carries (``gemm_efficiency``, ``gemm_bwd_efficiency`` for a
linear's backward GEMMs, ``grouped_gemm_efficiency``, ``hbm_efficiency``, and per memory-bound op class
``memory_bound_efficiency``).

Default efficiencies are hardware microbenchmark ceilings (measured on an H200, whose dense bf16/fp8
peaks equal the H100's), never fits to end-to-end training results:

* bf16 GEMM 783 of 989 TFLOP/s            -> 0.791 of peak
* fp8 GEMM 1421 of 1979 TFLOP/s           -> 0.718 of peak
* torch._grouped_mm at Mixtral expert shapes 755 of 989 TFLOP/s -> 0.763 of peak (bf16)
* torch._scaled_grouped_mm (fp8, per-row scales) at the same shapes ran 1.55x torch._grouped_mm on one H100
  (forward fc1/fc2 1043/1084 against 694/678 TFLOP/s, 1024 rows an expert; bench/fp8_bound.py,
  docs/benchmarks.md): 1.55 x 755 = 1170 of 1979 TFLOP/s -> 0.591 of the fp8 peak. (Not the dense
  grouped/GEMM ratio applied to the fp8 GEMM ceiling, 0.693: that prices them 17 % faster than the kernel runs.)
* HBM copy 4.2 of 4.8 TB/s                -> 0.875 of datasheet bandwidth

Memory-bound ops (:func:`memory_time`) are priced per op class (``spec.hardware.MEMORY_OP_CLASSES``): a
calibrated profile carries, per class, a curve of bytes per kernel (as this model counts an op's bytes) ->
achieved / datasheet bandwidth, timed on the machine with the executor's own ops, forward and backward
(``executor/microbench/memory_bound.py``, ``costmodel/calibrate/memory_bound.py``): small kernels reach less
of the bandwidth because their fixed cost (launch, dispatch, autograd) weighs more, and a kernel smaller than
the smallest measured takes that one's seconds (the fixed cost is a floor). A class the profile did not
measure takes its 'elementwise' curve; a profile without any takes the copy bandwidth (``hbm_efficiency``,
else the default below) plus ``KERNEL_OVERHEAD_S`` per kernel.

Attention's defaults are assumptions recorded in ``docs/time-model.md`` (flash-attention-class kernels on
Hopper); a calibrated profile's measured curves (``attention_fwd_efficiency``/``attention_bwd_efficiency``)
replace them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from spec.flops import ATTENTION_BWD_FLOP_RATIO, attention_fwd_flops
from spec.hardware import HardwareProfile, MeasuredCurve, expert_shape

# ---- defaults (see the module docstring and docs/time-model.md for where each comes from) ---------
GEMM_EFFICIENCY = {"bf16": 783.0 / 989.4, "fp16": 783.0 / 989.4, "fp32": 783.0 / 989.4,
                   "fp8": 1421.0 / 1978.9}
GROUPED_GEMM_EFFICIENCY_BF16 = 755.0 / 989.4
GROUPED_FP8_OVER_BF16 = (1043.0 + 1084.0) / (694.0 + 678.0)  # achieved FLOP/s, fp8 over bf16 grouped GEMMs
HBM_EFFICIENCY = 4.2 / 4.8
# Assumptions, for profiles without measured attention curves (foldtune calibrate measures them): flash
# attention reaches a lower fraction of peak than a GEMM, backward lower than forward; short key sequences
# lose efficiency to tile edges and the causal mask.
ATTENTION_FWD_EFFICIENCY = 0.60
ATTENTION_BWD_EFFICIENCY = 0.45
ATTENTION_HALF_SEQ = 512  # key length at which attention runs at half its asymptotic efficiency
# Fixed cost of one kernel (launch gap, prologue/epilogue, partial last wave); makes tiny ops cost more
# than their FLOPs or bytes say. An assumption of a few microseconds, replaced by measured curves.
KERNEL_OVERHEAD_S = 3e-6


@dataclass(frozen=True, eq=False)  # hashed by identity: it keys the per-shape caches below
class ComputeRates:
    """What one GPU achieves, resolved for one training precision (one instance per hardware and precision).

    ``gemm_peak``/``gemm_eff_max`` price the GEMMs that run in the training precision (fp8 linears under
    fp8); ``bf16_peak``/``bf16_eff_max`` price those that stay in 16 bits (logits, router, attention).
    ``gemm_curve``/``grouped_curve`` are measured efficiency curves that replace the defaults.
    """

    gemm_peak: float  # FLOP/s
    gemm_eff_max: float
    gemm_elem_bytes: int  # bytes of one GEMM input element (1 for fp8)
    grouped_eff_max: float
    bf16_peak: float  # FLOP/s
    bf16_eff_max: float
    hbm_bandwidth: float  # achievable bytes/s (datasheet x efficiency)
    attn_fwd_eff: float
    attn_bwd_eff: float
    kernel_overhead: float  # seconds
    gemm_curve: MeasuredCurve | None = None
    gemm_bwd_curve: MeasuredCurve | None = None  # forward FLOPs -> backward GEMMs' achieved / peak (measured)
    grouped_curve: MeasuredCurve | None = None
    # (weights of one expert GEMM = hidden x ffn, its curve of tokens per expert), by size (measured shapes)
    grouped_shape_curves: tuple[tuple[float, MeasuredCurve], ...] = ()
    attn_fwd_curve: MeasuredCurve | None = None  # key length -> achieved / bf16 peak (measured)
    attn_bwd_curve: MeasuredCurve | None = None
    attn_mla_fwd_curve: MeasuredCurve | None = None  # the same for query/key heads wider than value heads (MLA)
    attn_mla_bwd_curve: MeasuredCurve | None = None
    fp32_peak: float = 0.0  # FLOP/s of fp32 GEMMs without TF32 (the executor's fp32 attention with sinks)
    # measured grouped curves are bf16 kernels' achieved / bf16 peak (an fp8 calibration reads its bf16 rows so):
    # times this they are achieved / gemm_peak of this precision (fp8: the fp8/bf16 speed over the peak ratio,
    # one measured constant, or the peak ratio alone where ``grouped_fp8_ratio_curves`` carry the speed)
    grouped_curve_scale: float = 1.0
    # fp8 with a calibrated fp8 grouped GEMM (HardwareProfile.grouped_gemm_fp8_over_bf16): (weights of one
    # expert GEMM, its curve of tokens per expert -> fp8 speed / bf16 speed), by size; the measured grouped
    # curves times this times ``grouped_curve_scale`` (then the peak ratio alone) are achieved / fp8 peak
    grouped_fp8_ratio_curves: tuple[tuple[float, MeasuredCurve], ...] = ()
    # fp8 with a calibrated dense linear (HardwareProfile.dense_fp8_over_bf16): forward FLOPs -> bf16 seconds /
    # fp8 seconds of a dense linear's forward + backward, quantisation included
    dense_fp8_ratio_curve: MeasuredCurve | None = None
    # least seconds of one CP chunk attention call, forward + backward (measured, else 0): a short chunk's
    # kernel waits for the host issuing it (costmodel.context_parallel: half of it a floor each way)
    cp_chunk_floor: float = 0.0
    # memory-bound op class -> measured curve of bytes per kernel -> achieved / ``hbm_datasheet``; a class not
    # here takes the 'elementwise' curve, and with none memory_time prices at hbm_bandwidth + kernel_overhead
    memory_curves: dict[str, MeasuredCurve] = field(default_factory=dict)
    hbm_datasheet: float = 0.0  # bytes/s

    def __post_init__(self) -> None:
        if self.memory_curves and "elementwise" not in self.memory_curves:  # fallback of unmeasured classes
            curves = {**self.memory_curves, "elementwise": next(iter(self.memory_curves.values()))}
            object.__setattr__(self, "memory_curves", curves)


@lru_cache(maxsize=64)
def compute_rates(hardware: HardwareProfile, precision: str) -> ComputeRates:
    """Resolve datasheet peaks, default efficiencies and any measured curves for ``precision``."""
    gpu = hardware.gpu
    fp8 = precision == "fp8" and "fp8" in dict(gpu.peak_flops)
    gemm_dtype = "fp8" if fp8 else ("bf16" if precision == "fp8" else precision)
    bf16_eff = GEMM_EFFICIENCY["bf16"]
    gemm_eff = GEMM_EFFICIENCY.get(gemm_dtype, bf16_eff)
    curve_scale = 1.0
    ratio_curves = _by_weight_size(hardware.grouped_gemm_fp8_over_bf16) if fp8 else ()
    if fp8:  # the measured fp8/bf16 speed of the grouped kernels, as a share of the fp8 peak
        curve_scale = GROUPED_FP8_OVER_BF16 * gpu.peak("bf16") / gpu.peak("fp8")
        if ratio_curves:  # calibrated per shape and tokens: the ratio curves carry the fp8/bf16 speed
            curve_scale = gpu.peak("bf16") / gpu.peak("fp8")
        grouped = GROUPED_GEMM_EFFICIENCY_BF16 * curve_scale
    else:
        grouped = GROUPED_GEMM_EFFICIENCY_BF16 * gemm_eff / bf16_eff
    hbm_eff = hardware.hbm_efficiency if hardware.hbm_efficiency else HBM_EFFICIENCY
    # the efficiency curves are timed in short bursts at the boost clock; a step loads the tensor cores for
    # seconds, at the (measured) lower clock of the card's power limit
    clock = hardware.sustained_clock_factor or 1.0
    return ComputeRates(
        gemm_peak=gpu.peak(gemm_dtype) * clock, gemm_eff_max=gemm_eff, gemm_elem_bytes=1 if fp8 else 2,
        grouped_eff_max=grouped, bf16_peak=gpu.peak("bf16") * clock, bf16_eff_max=bf16_eff,
        hbm_bandwidth=gpu.hbm_bandwidth * hbm_eff, attn_fwd_eff=ATTENTION_FWD_EFFICIENCY,
        attn_bwd_eff=ATTENTION_BWD_EFFICIENCY, kernel_overhead=KERNEL_OVERHEAD_S,
        gemm_curve=hardware.gemm_efficiency, gemm_bwd_curve=hardware.gemm_bwd_efficiency,
        grouped_curve=hardware.grouped_gemm_efficiency,
        grouped_shape_curves=_by_weight_size(hardware.grouped_gemm_shape_efficiency),
        attn_fwd_curve=hardware.attention_fwd_efficiency, attn_bwd_curve=hardware.attention_bwd_efficiency,
        attn_mla_fwd_curve=hardware.attention_mla_fwd_efficiency,
        attn_mla_bwd_curve=hardware.attention_mla_bwd_efficiency,
        fp32_peak=dict(gpu.peak_flops).get("fp32", gpu.peak("bf16") / 16) * clock,
        cp_chunk_floor=hardware.cp_chunk_floor_s or 0.0, grouped_curve_scale=curve_scale,
        grouped_fp8_ratio_curves=ratio_curves,
        dense_fp8_ratio_curve=hardware.dense_fp8_over_bf16 if fp8 else None,
        memory_curves=dict(hardware.memory_bound_efficiency), hbm_datasheet=gpu.hbm_bandwidth)


def _by_weight_size(shape_curves: tuple[tuple[str, MeasuredCurve], ...]) -> tuple[tuple[float, MeasuredCurve], ...]:
    """'<hidden>x<ffn>' -> curve, as (weight elements of that expert GEMM, curve) sorted by size."""
    sized = []
    for key, curve in shape_curves:
        hidden, ffn = expert_shape(key)  # HardwareProfile refuses malformed keys
        sized.append((float(hidden * ffn), curve))
    return tuple(sorted(sized, key=lambda size_curve: size_curve[0]))


def _roofline(flops: float, nbytes: float, peak: float, eff: float, rates: ComputeRates) -> float:
    return max(flops / (peak * eff), nbytes / rates.hbm_bandwidth) + rates.kernel_overhead


@lru_cache(maxsize=65536)
def gemm_time(rates: ComputeRates, m: int, n: int, k: int, low_precision: bool = True) -> float:
    """Seconds for one ``(m x k) @ (k x n)`` GEMM.

    ``low_precision`` True runs it in the training precision (fp8 under fp8 training), False in bf16.
    Default model: a roofline (FLOPs at ``eff_max`` x peak, or operand bytes at achievable HBM bandwidth,
    whichever is slower) plus a fixed per-kernel cost, which makes efficiency saturate with FLOPs. A
    measured ``gemm_efficiency`` curve (FLOPs -> achieved/peak) replaces it for training-precision GEMMs.
    """
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    flops = 2.0 * m * n * k
    if low_precision or rates.gemm_elem_bytes == 2:  # 16-bit training: every GEMM is a training-precision one
        if rates.gemm_curve is not None:
            return flops / (rates.gemm_peak * rates.gemm_curve(flops))
        nbytes = (m * k + k * n) * rates.gemm_elem_bytes + 2 * m * n
        return _roofline(flops, nbytes, rates.gemm_peak, rates.gemm_eff_max, rates)
    nbytes = 2.0 * (m * k + k * n + m * n)
    return _roofline(flops, nbytes, rates.bf16_peak, rates.bf16_eff_max, rates)


def gemm_fwd_bwd(rates: ComputeRates, m: int, n: int, k: int, low_precision: bool = True) -> tuple[float, float]:
    """(forward, backward) seconds of a linear layer whose forward GEMM is ``(m x k) @ (k x n)``.

    The backward is the input-gradient GEMM ``(m x n) @ (n x k)`` plus the weight-gradient GEMM
    ``(k x m) @ (m x n)``: twice the forward FLOPs. With a measured ``gemm_bwd_efficiency`` curve (for GEMMs
    in the training precision, which the curve is timed in) both run at its efficiency for this forward's
    FLOPs; without one, each is priced like a forward GEMM of its own shape.
    """
    fwd = gemm_time(rates, m, n, k, low_precision)
    if (low_precision or rates.gemm_elem_bytes == 2) and rates.gemm_bwd_curve is not None and m > 0 and n > 0 \
            and k > 0:
        flops = 2.0 * m * n * k
        return fwd, 2.0 * flops / (rates.gemm_peak * rates.gemm_bwd_curve(flops))
    return fwd, gemm_time(rates, m, k, n, low_precision) + gemm_time(rates, k, n, m, low_precision)


@lru_cache(maxsize=65536)
def grouped_gemm_time(rates: ComputeRates, num_groups: int, tokens_per_group: float, n: int, k: int) -> float:
    """Seconds for one grouped GEMM: ``num_groups`` independent ``(t x k) @ (k x n)`` products, one kernel.

    ``tokens_per_group`` is the row count t of each group (the busiest expert's tokens on this rank).
    Default model: a roofline per group at the grouped-GEMM ceiling (small t makes it weight-bandwidth
    bound) plus one kernel's fixed cost. A measured ``grouped_gemm_efficiency`` curve (tokens per expert
    -> achieved/peak) replaces it; curves measured at several expert shapes replace that, read at this
    GEMM's weight size ``n·k`` (interpolated in log size between the two nearest measured shapes). The curves
    are bf16 measurements: under fp8 they are scaled by ``rates.grouped_curve_scale`` and, where the profile
    has them, by the calibrated fp8/bf16 speed at this weight size and ``tokens_per_group`` (which scales the
    default model's ceiling too).
    """
    if num_groups <= 0 or tokens_per_group <= 0 or n <= 0 or k <= 0:
        return 0.0
    flops = 2.0 * tokens_per_group * n * k * num_groups
    ratio = 1.0
    if rates.grouped_fp8_ratio_curves:
        ratio = _shape_efficiency(rates.grouped_fp8_ratio_curves, float(n * k), tokens_per_group)
    scale = rates.grouped_curve_scale * ratio
    if rates.grouped_shape_curves:
        return flops / (rates.gemm_peak * scale
                        * _shape_efficiency(rates.grouped_shape_curves, float(n * k), tokens_per_group))
    if rates.grouped_curve is not None:
        return flops / (rates.gemm_peak * scale * rates.grouped_curve(tokens_per_group))
    nbytes = num_groups * ((tokens_per_group * k + k * n) * rates.gemm_elem_bytes + 2 * tokens_per_group * n)
    return _roofline(flops, nbytes, rates.gemm_peak, rates.grouped_eff_max * ratio, rates)


def _shape_efficiency(curves: tuple[tuple[float, MeasuredCurve], ...], weights: float, tokens: float) -> float:
    """Efficiency at ``tokens`` per expert for an expert GEMM of ``weights`` elements, from curves measured
    at other weight sizes: linear in log size between the nearest two, the end curve outside them."""
    if weights <= curves[0][0] or len(curves) == 1:
        return curves[0][1](tokens)
    if weights >= curves[-1][0]:
        return curves[-1][1](tokens)
    i = next(j for j, (size, _) in enumerate(curves) if size >= weights)
    (w0, c0), (w1, c1) = curves[i - 1], curves[i]
    frac = (math.log(weights) - math.log(w0)) / (math.log(w1) - math.log(w0))
    return c0(tokens) + frac * (c1(tokens) - c0(tokens))


def grouped_gemm_fwd_bwd(rates: ComputeRates, num_groups: int, tokens_per_group: float, n: int,
                         k: int, wgrad_rates: ComputeRates | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of a grouped linear layer; backward = dgrad + wgrad grouped GEMMs, the
    wgrad at ``wgrad_rates`` where given (fp8 training runs the expert wgrad in bf16 by default)."""
    fwd = grouped_gemm_time(rates, num_groups, tokens_per_group, n, k)
    # dgrad has the forward's shape transposed (same t); wgrad reduces over t: both priced at t.
    dgrad = grouped_gemm_time(rates, num_groups, tokens_per_group, k, n)
    wgrad = dgrad if wgrad_rates is None else grouped_gemm_time(wgrad_rates, num_groups, tokens_per_group, k, n)
    return fwd, dgrad + wgrad


def attention_efficiency(rates: ComputeRates, key_length: float, mla: bool = False) -> tuple[float, float]:
    """(forward, backward) achieved fraction of the 16-bit peak of a flash attention kernel whose queries see
    ``key_length`` keys: the measured curves of key length when the profile has them (causal attention at
    that length, ``foldtune calibrate``), else the default efficiencies times their saturation
    ``L / (L + ATTENTION_HALF_SEQ)``. ``mla``: query/key heads wider than the value heads, which SDPA cannot
    run on its flash kernel: the profile's MLA curves where it has them."""
    if mla and rates.attn_mla_fwd_curve is not None and rates.attn_mla_bwd_curve is not None:
        return rates.attn_mla_fwd_curve(key_length), rates.attn_mla_bwd_curve(key_length)
    if rates.attn_fwd_curve is not None and rates.attn_bwd_curve is not None:
        return rates.attn_fwd_curve(key_length), rates.attn_bwd_curve(key_length)
    saturation = key_length / (key_length + ATTENTION_HALF_SEQ)
    return rates.attn_fwd_eff * saturation, rates.attn_bwd_eff * saturation


@lru_cache(maxsize=4096)
def attention_time(rates: ComputeRates, batch_queries: int, seq_kv: int, heads: int, qk_dim: int,
                   v_dim: int, causal: bool = True, flash: bool = True, dropout: bool = False,
                   steps: int = 1) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core (scores, softmax, weighted values) on one GPU.

    ``batch_queries`` = micro-batch x local query length (queries this rank owns), ``seq_kv`` the full
    key length each query may see, ``heads`` the local heads. Runs in 16-bit. ``steps`` > 1 prices ring
    attention: the keys arrive in ``steps`` blocks of ``seq_kv / steps``, each a separate kernel whose
    efficiency follows its own (shorter) key length (the executor's CP is priced by
    :mod:`costmodel.context_parallel`, not by this).

    Flash (fused) attention: forward FLOPs 2·q·kv·heads·(qk+v), halved by a causal mask; the backward
    does 2.5x the forward's matmul FLOPs; both at the attention efficiencies: measured curves of key-block
    length when the profile has them (``foldtune calibrate``), else the default assumptions with their
    saturation in the key length. Unfused attention (Megatron
    before flash attention) computes the whole score matrix with two batched GEMMs and writes it to HBM:
    a scale-mask-softmax pass (read and write 2 bytes per score), an optional dropout pass (read, write,
    mask: 5 bytes), and their backward passes.
    """
    if batch_queries <= 0 or heads <= 0:
        return 0.0, 0.0
    if flash:
        fwd_flops = attention_fwd_flops(batch_queries, seq_kv, heads, qk_dim, v_dim, causal)
        fwd_eff, bwd_eff = attention_efficiency(rates, seq_kv / steps, qk_dim != v_dim)
        fwd = fwd_flops / (rates.bf16_peak * fwd_eff) + steps * rates.kernel_overhead
        bwd = ATTENTION_BWD_FLOP_RATIO * fwd_flops / (rates.bf16_peak * bwd_eff) + steps * rates.kernel_overhead
        return fwd, bwd
    scores = float(batch_queries) * seq_kv * heads
    qk_fwd, qk_bwd = _batched_gemm(rates, heads, batch_queries, seq_kv, qk_dim)
    pv_fwd, pv_bwd = _batched_gemm(rates, heads, batch_queries, v_dim, seq_kv)
    passes_fwd, passes_bwd = 4.0, 6.0  # softmax: read+write scores; backward reads probs and grad, writes grad
    if dropout:
        passes_fwd += 5.0
        passes_bwd += 5.0
    kernels = 2 if dropout else 1
    fwd = qk_fwd + pv_fwd + memory_time(rates, passes_fwd * scores, kernels)
    bwd = qk_bwd + pv_bwd + memory_time(rates, passes_bwd * scores, kernels)
    return fwd, bwd


def _batched_gemm(rates: ComputeRates, batch: int, m: int, n: int, k: int, fp32: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of ``batch`` independent ``(m x k) @ (k x n)`` GEMMs in one kernel, 16-bit
    (or fp32 without TF32 at the fp32 peak)."""
    flops = 2.0 * batch * m * n * k
    peak, width = (rates.fp32_peak or rates.bf16_peak / 16, 4.0) if fp32 else (rates.bf16_peak, 2.0)
    fwd = _roofline(flops, width * batch * (m * k + k * n + m * n), peak, rates.bf16_eff_max, rates)
    return fwd, 2.0 * fwd


# HBM bytes per fp32 score of the executor's sink attention (executor/attention_core.py: sink_attention).
# Forward: scale, masked_fill, the concatenated sink column and the softmax each read and write the score
# matrix (4 kernels x 8 B). Backward: the slice's zero-padded gradient, softmax backward (reads probabilities
# and gradient, writes one), the concatenation's slice, masked_fill and scale (5 kernels, 44 B).
SINK_SCORE_BYTES_FWD, SINK_KERNELS_FWD = 32.0, 4
SINK_SCORE_BYTES_BWD, SINK_KERNELS_BWD = 44.0, 5


@lru_cache(maxsize=4096)
def sink_attention_time(rates: ComputeRates, batch_queries: int, seq_kv: int, heads: int,
                        head_dim: int) -> tuple[float, float]:
    """(forward, backward) seconds of the executor's explicit attention with sinks on one GPU: two fp32
    batched GEMMs over every (query, key) pair (no causal or window skipping: the mask is applied to the
    scores) and the memory-bound passes over the fp32 score matrix. Arguments as :func:`attention_time`."""
    if batch_queries <= 0 or heads <= 0:
        return 0.0, 0.0
    scores = float(batch_queries) * (seq_kv + 1) * heads
    qk_fwd, qk_bwd = _batched_gemm(rates, heads, batch_queries, seq_kv, head_dim, fp32=True)
    pv_fwd, pv_bwd = _batched_gemm(rates, heads, batch_queries, head_dim, seq_kv, fp32=True)
    fwd = qk_fwd + pv_fwd + memory_time(rates, SINK_SCORE_BYTES_FWD * scores, SINK_KERNELS_FWD)
    bwd = qk_bwd + pv_bwd + memory_time(rates, SINK_SCORE_BYTES_BWD * scores, SINK_KERNELS_BWD)
    return fwd, bwd


def memory_time(rates: ComputeRates, nbytes: float, kernels: int = 1, op: str = "elementwise") -> float:
    """Seconds for ``kernels`` memory-bound kernels of class ``op`` (``spec.hardware.MEMORY_OP_CLASSES``) moving
    ``nbytes`` bytes of HBM traffic in total, split evenly: on the class's measured curve where the profile has
    one (see the module docstring), else the bytes at ``hbm_bandwidth`` plus ``kernel_overhead`` per kernel."""
    curve = rates.memory_curves.get(op) or rates.memory_curves.get("elementwise")
    if curve is None:
        return nbytes / rates.hbm_bandwidth + kernels * rates.kernel_overhead
    if kernels <= 0:  # bytes only (folded into other kernels): at the largest measured kernels' bandwidth
        return nbytes / (rates.hbm_datasheet * curve.points[-1][1])
    per_kernel = max(nbytes / kernels, curve.points[0][0])  # below the smallest measured: its seconds, a floor
    return kernels * per_kernel / (rates.hbm_datasheet * curve(per_kernel))
