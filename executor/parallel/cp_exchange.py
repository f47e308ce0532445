"""The CP communication types on the executor's side (``spec.cp_comm_types``): how a layer's queries, under
context parallelism, meet the other CP ranks' keys and values, one :class:`CpExchange` per type registered in
:data:`CP_EXCHANGES`.

All of them start from Megatron's load-balanced split (CP rank i holds chunks i and 2·cp−1−i; queries, keys and
values computed on its own tokens, RoPE at their global positions) and end with this rank's output at the same
positions:

- allgather: K/V all-gathered (:mod:`executor.parallel.context_parallel`), the chunks attend on the flash path or
  under the layer's [s/cp, s] mask; a packed micro-batch's query chunks each attend only to the gathered key
  chunks one of their documents spans (:func:`document_chunk_attention`);
- p2p: the ring (:mod:`executor.parallel.ring_attention`);
- a2a: an all-to-all per q, k, v (:func:`heads_to_sequence`) leaves each rank heads/cp of its heads over the whole
  sequence, in global order, so the layer's own attention runs on it (causal kernels, or its [s, s] mask with
  windows and its share of the sinks); one all-to-all brings the output back (:func:`sequence_to_heads`);
- a2a+p2p: the all-to-all inside the ``cp_a2a`` sub-group, whose members' chunks then form the two chunks of one
  rank of the coarser split the ring over ``cp_p2p`` expects.
"""

from __future__ import annotations

import torch

from executor import recompute
from executor.attention_core import special_attention
from executor.parallel.collectives import all_to_all
from executor.parallel.context_parallel import (all_positions, count_chunk_pair, cp_attention, cp_positions,
                                                gather_kv)
from executor.parallel.groups import Group
from executor.parallel.ring_attention import ring_attention
from executor.timing import NULL_TIMER
from spec.errors import InvalidConfigError
from spec.registry import Registry


def heads_to_sequence(x_BHSD: torch.Tensor, group: Group) -> torch.Tensor:
    """All-to-all over ``group`` (n ranks, each holding chunks i and 2n−1−i of a 2n-chunk split): this rank's
    positions of every head [b, heads, 2c, d] → its 1/n of the heads (the group rank's share, in order) at every
    member's positions [b, heads/n, 2n·c, d], in the split's order (chunks 0..2n−1: members' first chunks in
    member order, then their second chunks in reverse member order). Backward: the inverse exchange."""
    n = group.size
    b, h, s, d = x_BHSD.shape
    x = x_BHSD.permute(1, 2, 0, 3).reshape(h, s, b, d)  # rows by head: member i gets head rows i·h/n ..
    y = all_to_all(x, [h // n] * n, [h // n] * n, group).view(n, h // n, 2, s // 2, b, d)
    ordered = torch.stack([y[:, :, 0], y.flip(0)[:, :, 1]])  # [2, n, h/n, c, b, d]: chunk 2n−1−i is member i's
    return ordered.permute(4, 2, 0, 1, 3, 5).reshape(b, h // n, n * s, d)


def sequence_to_heads(o_BHSD: torch.Tensor, group: Group) -> torch.Tensor:
    """The inverse of :func:`heads_to_sequence`: [b, heads/n, 2n·c, d] in the split's order → this rank's
    positions of every head [b, heads, 2c, d]."""
    n = group.size
    b, hn, s_all, d = o_BHSD.shape
    c = s_all // (2 * n)
    z = o_BHSD.reshape(b, hn, 2, n, c, d).permute(2, 3, 1, 4, 0, 5)  # [2, n, h/n, c, b, d]
    y = torch.stack([z[0], z[1].flip(0)], dim=2).reshape(n * hn, 2 * c, b, d)  # member i's positions, in order
    return all_to_all(y, [hn] * n, [hn] * n, group).permute(2, 0, 1, 3)


def _gathered_chunk(slot: int, cp: int) -> int:
    """The global chunk index of the gathered keys' ``slot``-th chunk (rank order: rank i's chunks i, 2cp−1−i)."""
    rank, second = divmod(slot, 2)
    return 2 * cp - 1 - rank if second else rank


def _chunk_selection(mask: torch.Tensor, cp: int, rank: int) -> list[tuple[torch.Tensor | None, list[bool]]]:
    """For each of this rank's two query chunks: the gathered key columns of the chunks a document spans under
    ``mask`` [b, 1, 2c, 2cp·c] (None: every column), and the causal chunk pairs' spanned flags."""
    c = mask.shape[2] // 2
    out = []
    for half, chunk in enumerate((rank, 2 * cp - 1 - rank)):
        rows = mask[:, :, half * c:(half + 1) * c]
        keep, flags = [], []
        for slot in range(2 * cp):
            if _gathered_chunk(slot, cp) > chunk:  # a later key chunk: no causal pair
                continue
            spanned = bool(rows[..., slot * c:(slot + 1) * c].any())
            flags.append(spanned)
            if spanned:
                keep.append(torch.arange(slot * c, (slot + 1) * c, device=mask.device))
        out.append((torch.cat(keep), flags))
    return out


def document_chunk_attention(q_BHSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, mask: torch.Tensor,
                             cp: int, rank: int, sinks: torch.Tensor | None, cache: dict | None = None
                             ) -> torch.Tensor:
    """This CP rank's queries [b, heads, 2c, d] (chunks rank and 2cp−1−rank) against the gathered keys and values
    [b, kv_heads, 2cp·c, d] (rank order) under a packed micro-batch's ``mask`` [b, 1, 2c, 2cp·c]: each query
    chunk attends to the key chunks at most as late as itself that a document spans (the rest are all masked for
    it, so leaving them out changes nothing), one masked attention per query chunk.
    ``cache``: where the choice of chunks is kept for ``mask`` (every layer shares it)."""
    c = q_BHSD.shape[2] // 2
    key = id(mask)
    selection = cache.get(key) if cache is not None else None
    if selection is None:
        selection = _chunk_selection(mask, cp, rank)
        if cache is not None:
            cache[key] = selection
    outs = []
    for half, (cols, flags) in enumerate(selection):
        for spanned in flags:
            count_chunk_pair(spanned)
        rows = slice(half * c, (half + 1) * c)
        outs.append(special_attention(q_BHSD[:, :, rows], k_BKSD[:, :, cols], v_BKSD[:, :, cols],
                                      mask[:, :, rows][..., cols], sinks))
    return torch.cat(outs, dim=2)


class CpExchange:
    """The executor's side of one CP communication type: ``before`` (the exchange ahead of the attention core,
    under the timer phase ``phase``), ``core`` (the core itself, what core_attn recomputation and offload wrap),
    ``after`` (the exchange of the output). ``layer`` is the attention module: its ``state``, ``cp`` group,
    ``plain`` (causal kernels take it), ``mask``, ``sinks``, ``core_attention`` (which calls ``core`` under CP)
    and ``local_core`` (its attention without CP).
    ``exchanges_inputs`` / ``exchanges_output``: whether ``before`` / ``after`` communicate (the timer marks them)."""

    name = ""
    phase = ""
    exchanges_inputs = exchanges_output = False

    def mask_positions(self, seq_length: int, cp: Group, device: torch.device):
        """(query positions, key positions) of the boolean mask the layers of this type attend under where the
        causal kernels do not serve (windows, sinks), in global token positions; None where no layer needs one
        (the rule book keeps the ring types to plain causal attention)."""
        return None

    def before(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        return q, k, v

    def core(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
             docs=None):
        """The attention core; ``docs`` (:class:`executor.documents.Documents`): a packed micro-batch, whose
        tokens attend within their documents only."""
        raise NotImplementedError

    def document_mask(self, layer, docs) -> torch.Tensor:
        """``docs``' mask [b, 1, s_q, s_k] at this type's :meth:`mask_positions` (cached per shape and rank)."""
        cache = self.__dict__.setdefault("_positions", {})
        device = docs.segments.device
        key = (docs.seq_length, layer.cp.size, layer.cp.rank, str(device))
        if key not in cache:
            cache[key] = self.mask_positions(docs.seq_length, layer.cp, device)
        return docs.mask(*cache[key], layer.window)

    def after(self, layer, o: torch.Tensor) -> torch.Tensor:
        return o


class AllGatherExchange(CpExchange):
    """K/V all-gathered over CP; the load-balanced chunks attend on the flash path or under the layer's mask."""

    name, phase, exchanges_inputs = "allgather", "cp_allgather", True

    def mask_positions(self, seq_length, cp, device):
        return cp_positions(seq_length, cp.size, cp.rank, device), all_positions(seq_length, cp.size, device)

    def before(self, layer, q, k, v):
        return q, gather_kv(k, layer.cp), gather_kv(v, layer.cp)

    def core(self, layer, q, k, v, sinks, docs=None):
        if docs is not None:  # the masked path, chunk by chunk: the flash chunks know no documents
            return document_chunk_attention(q, k, v, self.document_mask(layer, docs), layer.cp.size, layer.cp.rank,
                                            sinks, docs.__dict__.setdefault("_chunk_selection", {}))
        if not layer.plain:
            return special_attention(q, k, v, layer.mask, sinks)
        return cp_attention(q, k, v, layer.mask, layer.cp.size, layer.cp.rank)


class RingExchange(CpExchange):
    """The ring over the whole CP group (:mod:`executor.parallel.ring_attention`): the exchange runs inside the
    core, beside the attention of each step's block."""

    name, phase = "p2p", "cp_p2p"

    def core(self, layer, q, k, v, sinks, docs=None):
        return ring_attention(q, k, v, layer.cp, None if docs is None else docs.segments)


class AllToAllExchange(CpExchange):
    """Ulysses: heads scattered and the sequence gathered over ``group`` (the CP group, or under a2a+p2p its
    all-to-all sub-group); the core sees whole sequences (a2a) or the ring's chunk pairs (a2a+p2p)."""

    name, phase, group = "a2a", "cp_a2a", "cp"
    exchanges_inputs = exchanges_output = True

    def mask_positions(self, seq_length, cp, device):
        every = torch.arange(seq_length, device=device)  # whole sequences, in global order
        return every, every

    def before(self, layer, q, k, v):
        group = layer.state[self.group]
        return heads_to_sequence(q, group), heads_to_sequence(k, group), heads_to_sequence(v, group)

    def core(self, layer, q, k, v, sinks, docs=None):
        if sinks is not None:  # this rank's share of the heads
            share = layer.state[self.group]
            n = sinks.shape[0] // share.size
            sinks = sinks[share.rank * n:(share.rank + 1) * n]
        if docs is not None:  # whole sequences: the documents' mask of the sequence against itself
            return special_attention(q, k, v, docs.whole(layer.window), sinks)
        if not layer.plain:
            return special_attention(q, k, v, layer.mask, sinks)
        return layer.local_core(q, k, v)

    def after(self, layer, o):
        return sequence_to_heads(o, layer.state[self.group])


class HierarchicalExchange(AllToAllExchange):
    """a2a+p2p: the all-to-all inside ``cp_a2a`` turns its members' chunk pairs into one pair of the ring's
    coarser split (spec.cp_comm_types), which the ring over ``cp_p2p`` attends."""

    name, phase, group = "a2a+p2p", "cp_a2a", "cp_a2a"

    def mask_positions(self, seq_length, cp, device):
        return None

    def core(self, layer, q, k, v, sinks, docs=None):
        return ring_attention(q, k, v, layer.state["cp_p2p"], None if docs is None else docs.segments)


#: CP communication type name -> its executor side; ``tests/executor/test_cp_comm_types.py`` checks these are
#: exactly spec.cp_comm_types.CP_COMM_TYPES
CP_EXCHANGES: Registry[CpExchange] = Registry("CP communication type")
for _exchange in (AllGatherExchange(), RingExchange(), AllToAllExchange(), HierarchicalExchange()):
    CP_EXCHANGES.add(_exchange.name, _exchange)


def cp_exchange(name: str) -> CpExchange:
    """The executor side of CP communication type ``name``; InvalidConfigError for one it does not build."""
    return CP_EXCHANGES.require(name, "the executor builds no CP communication type", "built")


def check_ring_layer(config, plain: bool) -> None:
    """The rule book's executor_cp_ring_attention, re-checked for a layer built without executor.buildable: the
    ring merges plain causal blocks, so a layer with a window or sinks must not take it."""
    if config.cp > 1 and config.cp_comm_type in (RingExchange.name, HierarchicalExchange.name) and not plain:
        raise InvalidConfigError(f"[executor_cp_ring_attention] cp_comm {config.cp_comm_type} is built for plain "
                                 f"causal attention; this layer has a sliding window or attention sinks")


def run_cp_attention(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recompute_core: bool,
                     offload_core: bool, timed: bool = True, docs=None) -> torch.Tensor:
    """The attention core of ``layer`` under CP (layer.cp.size > 1) with its communication type
    (``layer.cp_exchange``): this rank's queries [b, heads, 2c, d], keys and values [b, kv_heads, 2c, d or d_v]
    in, its output [b, heads, 2c, d_v] out; the core under core_attn recomputation or offload. ``timed``: the
    exchanges get the timer's phase marks (not inside a region that recomputation re-runs). ``docs``: a packed
    micro-batch's documents (:mod:`executor.documents`), passed to the core."""
    exchange = layer.cp_exchange
    timer = layer.timer if timed else NULL_TIMER
    if exchange.exchanges_inputs:
        q = timer.mark(q, "attention", exchange.phase)
        q, k, v = exchange.before(layer, q, k, v)
        k = timer.mark(k, exchange.phase, "attention")
    # through the layer's core_attention (its type's core under CP): what a slice records and times alone
    args = (q, k, v) if docs is None else (q, k, v, docs)  # MLA's core takes no documents (refused before)
    o = recompute.run(recompute_core, layer.core_attention, *args, offload=offload_core)
    if exchange.exchanges_output:
        o = timer.mark(o, "attention", exchange.phase)
        o = exchange.after(layer, o)
        o = timer.mark(o, exchange.phase, "attention")
    return o
