"""Context parallelism priced as the executor runs it: chunked causal attention and the K/V all-gather.

The executor (``executor/parallel/context_parallel.py``) cuts the sequence into ``2·cp`` chunks of
``c = seq / (2·cp)`` tokens; CP rank i holds chunks i and ``2·cp−1−i``. It all-gathers K and V over the CP
group (backward: a reduce-scatter of their gradients), on the compute stream before the attention, so
nothing hides the exchange. Each local query chunk j then runs one flash kernel of ``c`` queries against
the first ``(j+1)·c`` keys, causal with the diagonal bottom-right (:func:`chunk_kernels`).

Named quantities (all per rank, per layer, per micro-batch):

- :func:`chunk_kernels`: the kernels one CP rank runs: query rows, key length, causal work share.
- :func:`chunk_attention_time`: one kernel's seconds, at the attention efficiency of its OWN key length
  (``costmodel.compute.attention_efficiency``: the calibrated curve of key length, or the default
  saturation), plus one kernel's fixed cost per direction.
- :data:`CP_FLASH_KERNEL_SLOWDOWN`: the chunks run on PyTorch's flash kernel
  (``aten._scaled_dot_product_flash_attention``, the one that aligns a chunk's causal diagonal bottom-right
  and takes GQA natively), while the calibrated curve and the non-CP path time SDPA's default kernel
  (cuDNN on Hopper). Measured on one H200 with ``bench/cp_attention_check.py`` (docs/benchmarks.md, "CP
  attention"): causal attention over s = 4096, 32/8 heads, d 128, bf16, fwd+bwd, the flash kernel 0.939 ms
  per 1/2 of the sequence against cuDNN SDPA 0.587: 1.60x. A kernel microbenchmark ratio, not a fit to
  training steps. ``bench/cp_dispatch_gpu.py`` (CP1 against CP2 at 2k/4k/8k) checks it: the growth of the
  CP2 core from seq 4096 to 8192, over the growth of the chunk kernels' FLOP price at slowdown 1 in the same
  span, cancels any per-chunk cost that does not scale with the FLOPs and comes out within 4 % of the
  kernel ratio (docs/benchmarks.md, "CP flash-kernel slowdown against the CP bench"). Seq 2048 is left out
  of that check: its CP2 core is the chunk calls' floor below, not their FLOPs.
- per-chunk floor: ``ComputeRates.cp_chunk_floor`` (``HardwareProfile.cp_chunk_floor_s``): the least
  seconds one chunk call takes forward + backward, however short its kernel, because the device waits for
  the host issuing the call (the executor's chunk path: a Python autograd Function, chunk views, one flash
  call each way). Measured by ``foldtune calibrate`` on two or more ranks from the executor's own
  ``cp_attention`` at a short sequence; 0 when not measured. Each direction of each chunk costs
  ``max(its kernel's seconds, floor / 2)``: a floor, not an addition, because a long chunk's kernel runs
  while the host issues the next call. The same bench shows it: at seq 4096 and 8192 the CP2 core exceeds
  its priced kernels by 0.31 and 0.35 ms, less than the 0.86 ms it exceeds them by at 2048.
- :func:`cp_attention_time`: the attention core of the busiest CP rank (the sum over its chunks). Its
  FLOPs equal the non-CP causal attention's divided by cp (every rank holds the same causal work); what CP
  changes is the key length each kernel runs at (shorter, so less efficient where the curve has not
  saturated) and the number of kernels (two per rank instead of one).
- :func:`kv_exchange_bytes`: bytes of K and V this rank contributes (the all-gather's input; the gathered
  buffer is cp times that).
- :func:`kv_exchange_time`: ring all-gather forward, ring reduce-scatter of the gradients backward, over
  the CP group's placement, both exposed. The exchange's per-call cost beyond that
  (``costmodel.fixed_costs``) is added by the caller, half each way.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from costmodel.comm import LinkRates, Placement, ring_time
from costmodel.compute import ComputeRates, attention_efficiency
from spec.flops import ATTENTION_BWD_FLOP_RATIO, attention_fwd_flops


CP_FLASH_KERNEL_SLOWDOWN = 0.939 / 0.587


@dataclass(frozen=True)
class ChunkKernel:
    """One flash kernel of a CP rank: ``queries`` query rows (per sequence) against the first ``keys`` keys,
    causal with the diagonal bottom-right; ``work`` the share of the queries x keys scores computed,
    ``1 − queries / (2·keys)`` (the last ``queries`` keys form the causal triangle; the model's causal
    convention, 1/2 for a square)."""

    queries: int
    keys: int

    @property
    def work(self) -> float:
        return 1.0 - self.queries / (2.0 * self.keys)


def chunk_kernels(seq_length: int, cp: int, rank: int) -> tuple[ChunkKernel, ...]:
    """The attention kernels CP rank ``rank`` runs per direction: cp = 1 one causal kernel over the whole
    sequence; cp > 1 one per local chunk j ∈ {rank, 2·cp−1−rank}: c queries against (j+1)·c keys."""
    if cp <= 1:
        return (ChunkKernel(seq_length, seq_length),)
    c = seq_length // (2 * cp)
    return tuple(ChunkKernel(c, (j + 1) * c) for j in (rank, 2 * cp - 1 - rank))


def chunk_attention_time(rates: ComputeRates, micro_batch: int, chunk: ChunkKernel, heads: int, qk_dim: int,
                         v_dim: int, slowdown: float = 1.0, floor: float = 0.0) -> tuple[float, float]:
    """(forward, backward) seconds of one chunk kernel over ``micro_batch`` sequences and ``heads`` local
    heads: its FLOPs (``2·q·k·heads·(qk+v)·work`` forward, ``ATTENTION_BWD_FLOP_RATIO`` times that
    backward) at the efficiency of its own key length, times ``slowdown`` (the kernel's time over the
    calibrated kernel's at the same work), plus one kernel's launch overhead; each direction at least
    ``floor`` seconds (the host-bound floor of a CP chunk call, per direction)."""
    flops = attention_fwd_flops(micro_batch * chunk.queries, chunk.keys, heads, qk_dim, v_dim, False) * chunk.work
    fwd_eff, bwd_eff = attention_efficiency(rates, chunk.keys, qk_dim != v_dim)
    return (max(floor, slowdown * flops / (rates.bf16_peak * fwd_eff) + rates.kernel_overhead),
            max(floor, slowdown * ATTENTION_BWD_FLOP_RATIO * flops / (rates.bf16_peak * bwd_eff)
                + rates.kernel_overhead))


@lru_cache(maxsize=4096)
def cp_attention_time(rates: ComputeRates, micro_batch: int, seq_length: int, cp: int, heads: int, qk_dim: int,
                      v_dim: int) -> tuple[float, float]:
    """(forward, backward) seconds of the flash attention core of the busiest CP rank (the rank whose
    fwd+bwd is longest), ``heads`` local heads: its chunk kernels on the flash kernel
    (:data:`CP_FLASH_KERNEL_SLOWDOWN`), each direction at least half of ``rates.cp_chunk_floor``. cp = 1:
    one causal kernel over the sequence, SDPA's default, no chunk floor."""
    best = (0.0, 0.0)
    slowdown = CP_FLASH_KERNEL_SLOWDOWN if cp > 1 else 1.0
    floor = rates.cp_chunk_floor / 2 if cp > 1 else 0.0
    for rank in range(max(1, cp)):
        times = [chunk_attention_time(rates, micro_batch, ch, heads, qk_dim, v_dim, slowdown, floor)
                 for ch in chunk_kernels(seq_length, cp, rank)]
        total = (sum(t[0] for t in times), sum(t[1] for t in times))
        if sum(total) > sum(best):
            best = total
    return best


def kv_exchange_bytes(tokens_local: float, kv_heads: float, head_dims: float, act_bytes: int) -> float:
    """Bytes of K and V this CP rank holds and contributes to the all-gather: ``tokens_local`` (micro-batch x
    seq / cp) x ``kv_heads`` local K/V heads x ``head_dims`` (K's plus V's head dim) x ``act_bytes``."""
    return tokens_local * kv_heads * head_dims * act_bytes


def kv_exchange_time(link: LinkRates, local_bytes: float, place: Placement) -> tuple[float, float]:
    """(forward, backward) seconds of the K/V exchange over the CP group: a ring all-gather of the gathered
    buffer (``cp x local_bytes``; each rank sends ``(cp−1) x local_bytes``) forward and a ring
    reduce-scatter of the gradients, the same volume, backward."""
    if place.size <= 1 or local_bytes <= 0:
        return 0.0, 0.0
    gathered = place.size * local_bytes
    return (ring_time(link, "all_gather", gathered, place), ring_time(link, "reduce_scatter", gathered, place))
