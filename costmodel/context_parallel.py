"""Context parallelism priced as the executor runs it, per CP communication type (``spec.cp_comm_types``): one
:class:`CpPricing` per type in :data:`CP_PRICING`, each pricing the attention core and the exchange from the
message sizes ``costmodel.collective_inventory.cp_calls`` lists and the calibrated attention and collective
curves.

allgather (below: :func:`cp_attention_time`, :func:`kv_exchange_time`): the executor
(``executor/parallel/context_parallel.py``) cuts the sequence into ``2·cp`` chunks of ``c = seq / (2·cp)`` tokens; CP rank i holds chunks i and ``2·cp−1−i``. It all-gathers K and V over the CP
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

p2p (:func:`ring_price`): the ring of ``n`` ranks runs ``n`` blocks per direction (:func:`ring_blocks`: its own
causal 2c x 2c pair, then ``n − 1`` full blocks of 2c x c or c x 2c, c = seq / (2n)), each on the flash kernel
(:data:`CP_FLASH_KERNEL_SLOWDOWN`, the chunk floor per block as for allgather's chunks) where K and V are as wide
as Q, else as unfused attention (the executor's matmul blocks, multi-latent attention). A hop sends one K/V pair
(:func:`costmodel.comm.p2p_time`, the ring crossing nodes at the network's rate). Forward, the hop started before
block i hides behind it: exposed ``Σ_{i<n−1} max(0, hop − block_i)``, hidden the rest. Backward, block i hides
the next pair's hop (i < n−1) and the previous block's dK/dV hop (i > 0) together, and the last dK/dV hop stays
exposed. The busiest rank (its blocks plus exposed hops) sets the time.

Packed documents (``TrainingSpec.document_lengths``): allgather, p2p and a2a+p2p's ring skip the chunk pairs of
their split that no document spans and compute the others whole, so their core is priced at
``spec.documents.chunk_pair_share`` (:meth:`CpPricing.skip_chunks`); a2a's whole sequences at the documents' own
share, as without CP.

a2a: four all-to-alls each way (q, k, v, the output; ``cp_calls``' sizes), exposed, plus a copy of each exchanged
tensor into or out of the sequence order each way; the core is causal attention over the whole sequence with
heads/cp of the TP rank's heads (one kernel, SDPA's default). a2a+p2p: the all-to-alls over the sub-group of
``a`` ranks, then the ring of ``p`` ranks on heads/a at chunks of seq / (2p).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from typing import Any

from costmodel.comm import LinkRates, Placement, call_time, p2p_time, ring_time
from costmodel.compute import ComputeRates, attention_efficiency, attention_time
from costmodel.terms import LAYER_SLOT
from spec.errors import InvalidConfigError
from spec.flops import ATTENTION_BWD_FLOP_RATIO, attention_fwd_flops
from spec.registry import Registry


CP_FLASH_KERNEL_SLOWDOWN = 0.939 / 0.587


@dataclass(frozen=True)
class ChunkKernel:
    """One flash kernel of a CP rank: ``queries`` query rows (per sequence) against the first ``keys`` keys,
    causal with the diagonal bottom-right; ``work`` the share of the queries x keys scores computed,
    ``1 − queries / (2·keys)`` (the last ``queries`` keys form the causal triangle; the model's causal
    convention, 1/2 for a square); ``causal`` False: a full block (a ring's), work 1."""

    queries: int
    keys: int
    causal: bool = True

    @property
    def work(self) -> float:
        return 1.0 - self.queries / (2.0 * self.keys) if self.causal else 1.0


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


# ---- the ring (p2p, and a2a+p2p's ring) --------------------------------------------------------------------------
def ring_blocks(seq_length: int, ring: int, rank: int) -> tuple[ChunkKernel, ...]:
    """The blocks ring rank ``rank`` of ``ring`` computes per direction, in step order: its own chunk pair causal
    (2c x 2c, half the scores), then per other rank j a full block, 2c queries x c keys (j < rank: both its chunks
    see j's early chunk) or c x 2c (j > rank: its late chunk sees both of j's); c = seq / (2·ring)."""
    c = seq_length // (2 * ring)
    out = [ChunkKernel(2 * c, 2 * c)]
    for step in range(1, ring):
        out.append(ChunkKernel(2 * c, c, False) if (rank - step) % ring < rank else ChunkKernel(c, 2 * c, False))
    return tuple(out)


@dataclass(frozen=True)
class RingPrice:
    """Seconds (forward, backward) of the busiest ring rank per layer and micro-batch: its blocks (``core``), the
    hops they do not hide (``exposed``) and those they hide (``hidden``)."""

    core: tuple[float, float]
    exposed: tuple[float, float]
    hidden: tuple[float, float]


def ring_overlap(hop: float, fwd: list[float], bwd: list[float]) -> tuple[tuple[float, float], tuple[float, float]]:
    """((exposed forward, exposed backward), (hidden forward, hidden backward)) seconds of a ring's hops of ``hop``
    seconds beside blocks of ``fwd`` / ``bwd`` seconds (module docstring: forward the hop of step i behind block i,
    i < n−1; backward the next pair's hop and the previous dK/dV hop behind block i, the last dK/dV hop exposed)."""
    n = len(fwd)
    if n <= 1 or hop <= 0.0:
        return (0.0, 0.0), (0.0, 0.0)
    exposed_f = sum(max(0.0, hop - f) for f in fwd[:n - 1])
    hidden_f = sum(min(hop, f) for f in fwd[:n - 1])
    sends = [(hop if i < n - 1 else 0.0) + (hop if i > 0 else 0.0) for i in range(n)]
    exposed_b = sum(max(0.0, t - b) for t, b in zip(sends, bwd)) + hop
    hidden_b = sum(min(t, b) for t, b in zip(sends, bwd))
    return (exposed_f, exposed_b), (hidden_f, hidden_b)


@lru_cache(maxsize=4096)
def ring_price(rates: ComputeRates, link: LinkRates, place: Placement, micro_batch: int, seq_length: int,
               heads: int, qk_dim: int, v_dim: int, pair_bytes: float) -> RingPrice:
    """The ring over ``place`` (``place.size`` ranks) for ``heads`` local heads: each rank's blocks
    (:func:`ring_blocks`) on the flash kernel where ``qk_dim == v_dim`` (:data:`CP_FLASH_KERNEL_SLOWDOWN`, each
    direction at least half the chunk floor), else unfused; hops of ``pair_bytes`` (one K/V pair) at
    :func:`costmodel.comm.p2p_time`; the rank with the longest blocks plus exposed hops."""
    n = place.size
    hop = p2p_time(link, pair_bytes, place.crosses_nodes) if n > 1 else 0.0
    floor = rates.cp_chunk_floor / 2

    def seconds(block: ChunkKernel) -> tuple[float, float]:
        if qk_dim == v_dim:
            return chunk_attention_time(rates, micro_batch, block, heads, qk_dim, v_dim, CP_FLASH_KERNEL_SLOWDOWN,
                                        floor)
        f, b = attention_time(rates, micro_batch * block.queries, block.keys, heads, qk_dim, v_dim, block.causal,
                              False)
        return max(floor, f), max(floor, b)

    # three kinds of block (ring_blocks): the own pair, then early ranks' (2c x c) and late ranks' (c x 2c); rank r
    # meets r early ones then n−1−r late ones, so ring_overlap's sums come in closed form, O(1) per rank
    c = seq_length // (2 * n)
    own, early, late = (seconds(b) for b in (ChunkKernel(2 * c, 2 * c), ChunkKernel(2 * c, c, False),
                                             ChunkKernel(c, 2 * c, False)))
    best: RingPrice | None = None
    for rank in range(n):
        core = tuple(own[d] + rank * early[d] + (n - 1 - rank) * late[d] for d in (0, 1))
        if n == 1:
            price = RingPrice(core, (0.0, 0.0), (0.0, 0.0))
        else:
            n_early, n_late = min(rank, n - 2), max(0, n - 2 - rank)  # of steps 1..n−2
            last = early if rank == n - 1 else late  # step n−1
            exposed_f = max(0.0, hop - own[0]) + n_early * max(0.0, hop - early[0]) + n_late * max(0.0, hop - late[0])
            hidden_f = min(hop, own[0]) + n_early * min(hop, early[0]) + n_late * min(hop, late[0])
            exposed_b = (max(0.0, hop - own[1]) + n_early * max(0.0, 2 * hop - early[1])
                         + n_late * max(0.0, 2 * hop - late[1]) + max(0.0, hop - last[1]) + hop)
            hidden_b = (min(hop, own[1]) + n_early * min(2 * hop, early[1]) + n_late * min(2 * hop, late[1])
                        + min(hop, last[1]))
            price = RingPrice(core, (exposed_f, exposed_b), (hidden_f, hidden_b))
        if best is None or sum(price.core) + sum(price.exposed) > sum(best.core) + sum(best.exposed):
            best = price
    assert best is not None
    return best


# ---- pricing per CP communication type ---------------------------------------------------------------------------
_CP = LAYER_SLOT["cp_comm"]


class CpPricing:
    """The cost model's side of one CP communication type. ``parts`` is costmodel.step_time's layer pricer (its
    rates, link, micro-batch, sequence, cp, the CP groups' placements ``cp_places``, the layer's calls, the
    ``elementwise`` pass, ``cp_fixed``); ``heads`` are this TP rank's query heads, ``qk``/``v`` the head dims."""

    name = ""

    def skip_chunks(self, parts: Any) -> int | None:
        """Chunks of the split whose chunk pairs the executor skips when no packed document spans both
        (``spec.documents.chunk_pair_share``); None where the core sees whole sequences (the documents' own
        share then)."""
        return 2 * parts.cp

    def core(self, parts: Any, heads: int, qk: int, v: int) -> tuple[float, float]:
        """(forward, backward) seconds of the flash attention core of one layer and micro-batch."""
        raise NotImplementedError

    def comm(self, parts: Any, block: Any, reorder: bool, heads: int, qk: int, v: int) -> None:
        """Add the exchange's exposed seconds (and hidden ones, ``block.cp_hidden``) to ``block``."""
        raise NotImplementedError


def _cp_calls(parts: Any) -> list:
    return [c for c in parts.layer_calls if c.group.startswith("cp")]


class AllGatherPricing(CpPricing):
    """K/V all-gathered before the attention: nothing hides the exchange (module docstring)."""

    name = "allgather"

    def core(self, parts, heads, qk, v):
        return cp_attention_time(parts.rates, parts.mbs, parts.seq, parts.cp, heads, qk, v)

    def comm(self, parts, block, reorder, heads, qk, v):
        place = parts.cp_places["cp"]
        for call in _cp_calls(parts):
            if call.phase != "forward":
                continue
            local = call.nbytes / place.size  # the call's gathered buffer holds every CP rank's part
            fwd, bwd = kv_exchange_time(parts.link, local, place)
            block.add(_CP, fwd, bwd)
            if reorder:
                parts.elementwise(block, 2 * call.nbytes, "core_attn", bwd_bytes=2 * call.nbytes)
        block.add(_CP, parts.cp_fixed / 2, parts.cp_fixed / 2)


class RingPricing(CpPricing):
    """The ring over the CP group (``ring_group``), ``a2a`` ranks of all-to-all ahead of it (1: none)."""

    name, ring_group = "p2p", "cp"

    def skip_chunks(self, parts):
        return 2 * (parts.cp // parts.cp_split[0])  # the ring's split: 2 chunks per ring rank

    def _price(self, parts, heads: int, qk: int, v: int) -> RingPrice:
        a2a = parts.cp_split[0]
        pair = next(c.nbytes for c in _cp_calls(parts) if c.op == "p2p")
        return ring_price(parts.rates, parts.link, parts.cp_places[self.ring_group], parts.mbs, parts.seq,
                          max(1, heads // a2a), qk, v, pair)

    def core(self, parts, heads, qk, v):
        return self._price(parts, heads, qk, v).core

    def comm(self, parts, block, reorder, heads, qk, v):
        price = self._price(parts, heads, qk, v)
        block.add(_CP, *price.exposed, "core_attn")  # the hops run inside the core, which core_attn re-runs
        block.cp_hidden += sum(price.hidden)


class AllToAllPricing(CpPricing):
    """Ulysses over the CP group (``a2a_group``): exposed all-to-alls around attention over whole sequences."""

    name, a2a_group = "a2a", "cp"

    def skip_chunks(self, parts):
        return None

    def core(self, parts, heads, qk, v):
        return cp_attention_time(parts.rates, parts.mbs, parts.seq, 1, max(1, heads // parts.cp), qk, v)

    def comm(self, parts, block, reorder, heads, qk, v):
        place = parts.cp_places[self.a2a_group]
        moved = 0.0
        for call in _cp_calls(parts):
            if call.op != "all_to_all":
                continue
            seconds = call_time(parts.link, call, place)
            block.add(_CP, *((seconds, 0.0) if call.phase == "forward" else (0.0, seconds)))
            moved += call.nbytes if call.phase == "forward" else 0.0
        # each exchanged tensor copied into (q, k, v) or out of (the output) the split's order, each way
        parts.elementwise(block, 2 * moved, bwd_bytes=2 * moved)


class HierarchicalPricing(AllToAllPricing, RingPricing):
    """a2a+p2p: the all-to-alls over cp_a2a, the ring over cp_p2p on heads/a."""

    name, a2a_group, ring_group = "a2a+p2p", "cp_a2a", "cp_p2p"

    def skip_chunks(self, parts):
        return RingPricing.skip_chunks(self, parts)

    def core(self, parts, heads, qk, v):
        return RingPricing.core(self, parts, heads, qk, v)

    def comm(self, parts, block, reorder, heads, qk, v):
        AllToAllPricing.comm(self, parts, block, reorder, heads, qk, v)
        RingPricing.comm(self, parts, block, reorder, heads, qk, v)


#: CP communication type name -> its pricing; ``tests/executor/test_cp_comm_types.py`` checks these are exactly
#: spec.cp_comm_types.CP_COMM_TYPES
CP_PRICING: Registry[CpPricing] = Registry("CP communication pricing")
for _pricing in (AllGatherPricing(), RingPricing(), AllToAllPricing(), HierarchicalPricing()):
    CP_PRICING.add(_pricing.name, _pricing)


def cp_pricing(name: str) -> CpPricing:
    """The pricing of CP communication type ``name``; InvalidConfigError for one the cost model cannot price."""
    return CP_PRICING.require(name, "the cost model has no pricing of CP communication type", "priced")
