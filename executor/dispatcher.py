"""Token dispatchers: move routed tokens from the attention layout to the expert layout and back.

Every dispatcher implements :class:`TokenDispatcher` and is registered under its
``ParallelConfig.moe_token_dispatcher_type`` name with :func:`register_dispatcher`; :func:`make_dispatcher`
builds the one a layout names. The names it builds are ``spec.dispatchers.EXECUTOR_DISPATCHERS`` (the
Megatron-only ones are priced, not built: rule ``executor_dispatcher``), and
``tests/executor/test_dispatcher_registry.py`` checks that this registry holds exactly those names and the cost
model's pricings (``costmodel.dispatch.PRICING``) every name.

Notation (per MoE layer, per micro-batch, on one rank):

- ``n``: tokens of this rank in the attention layout (its TP·SP shard of its DP replica's micro-batch);
  ``k``: top-k; ``h``: hidden size; ``E``: experts; ``E_local = E / ep`` experts on this rank.
- Expert layout: rank (etp, ep) owns experts ``ep·E_local ... (ep+1)·E_local - 1`` and a 1/etp slice of
  their FFN dimension.
- ``M``: rows handed to the experts on this rank (token copies routed to its local experts, from every
  rank whose tokens it serves; dropped copies are absent).

Stages of a dispatcher (the :class:`TokenDispatcher` contract, which every registered dispatcher
implements and which the EP-overlap schedule, executor/ep_overlap.py, uses and nothing else):

- ``dispatch(x_NH, routing) -> Dispatched``: ``x_NH`` [n, h] and the router's ``Routing`` (experts_NK,
  probs_NK [n, k]). Returns ``x_MH`` [M, h] sorted by local expert, ``tokens_per_expert`` [E_local] (int64,
  on device, summing to M) and a ``ctx`` that only its own stages read. Autograd flows through
  ``x_MH`` back to ``x_NH``. It runs ``dispatch_preprocess``, the exchange (an all-to-all over
  ``exchange_group`` with ``exchange_sizes``, when ``has_exchange``) and ``dispatch_postprocess``.
- ``combine(y_MH, dispatched) -> y_NH``: ``y_MH`` [M, h] the experts' output in ``x_MH``'s row order (for
  etp > 1 a partial sum over the etp slice). Returns [n, h]: for each token, Σ over its k routed copies of
  probability · expert output, summed over etp, in the attention layout of ``x_NH``; dropped copies add 0.
  Gradients flow to ``y_MH`` and to ``routing.probs_NK``. It runs ``combine_preprocess``, the transposed
  exchange and ``combine_postprocess``; ``routing_probs`` / ``replace_routing_probs`` name the probabilities
  the combine weights by (the overlapped schedule hands them from one segment's autograd graph to the next).
- Groups: only ``state.ep``, ``state.etp`` and ``state.tp_ep`` (and their sizes/ranks) are used; a
  dispatcher marks its communication with ``timer.mark`` phases named after the collective.

- ``alltoall``: permute by expert, all-to-all over ep with uneven splits, all-gather over etp (uneven),
  sort the (source, expert) chunks by expert; combine runs the transposes in reverse.
- ``allgather``: all-gather every token of the tp_ep group, keep the ones routed to local experts,
  and reduce-scatter the weighted outputs back (sums the etp partial products on the way).

Padding to capacity (``Routing.pad_E``): after the permutation each expert's rows are followed by this rank's
zero rows for it (:func:`pad_rows`), which travel and are computed like the others; the combine drops them
again before the unpermutation (nothing maps back to them), so they change no output and no gradient.

Permutation never loops over experts: a stable argsort by expert id, an index_select, and on the way
back a gather of each token's k rows and a k-wide batched product with the probabilities (no atomics).
On CUDA with Triton (executor/kernels/triton_permute.py) the dropless sort is a counting sort and the
permute/unpermute are single kernels; same order, same rows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from executor.host_copy import HostInts
from executor.kernels import triton_permute as fused
from executor.parallel.collectives import (
    all_gather,
    all_gather_nograd,
    all_gather_v,
    all_to_all,
    reduce_scatter,
    reduce_scatter_v,
)
from executor.parallel.groups import Group, ParallelState
from executor.router import Routing, count_per_expert
from executor.timing import NULL_TIMER, PhaseTimer
from spec.errors import InvalidConfigError


def slot_rows(slots_M: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of ``slots_M``: for each of the n·k slots its row in the sorted order, M where dropped."""
    rows = torch.full((n * k,), slots_M.numel(), dtype=torch.long, device=slots_M.device)
    return rows.scatter_(0, slots_M, torch.arange(slots_M.numel(), device=slots_M.device))


def _rows_by_slot(y_MH: torch.Tensor, row_of_slot: torch.Tensor) -> torch.Tensor:
    """[n·k, h]: each slot's row of ``y_MH``, zeros for dropped slots (row index M)."""
    if row_of_slot.numel() != y_MH.shape[0]:
        y_MH = torch.cat([y_MH, y_MH.new_zeros((1, y_MH.shape[1]))])
    return y_MH.index_select(0, row_of_slot)


class _Permute(torch.autograd.Function):
    """rows[i] = x[slots[i] // k]; backward gathers each slot's row gradient and sums a token's k slots."""

    @staticmethod
    def forward(ctx, x_NH, slots_M, row_of_slot, k):
        ctx.save_for_backward(row_of_slot)
        ctx.n, ctx.k = x_NH.shape[0], k
        if fused.available(x_NH) and fused.permute_checked(k, x_NH.shape[1], x_NH.dtype, x_NH.device):
            return fused.permute(x_NH, row_of_slot, slots_M.numel(), k)
        return x_NH.index_select(0, torch.div(slots_M, k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad_MH):
        (row_of_slot,) = ctx.saved_tensors
        if fused.available(grad_MH):
            return fused.combine(grad_MH, None, row_of_slot, ctx.n, ctx.k), None, None, None
        return _rows_by_slot(grad_MH, row_of_slot).view(ctx.n, ctx.k, -1).sum(1), None, None, None


class _Unpermute(torch.autograd.Function):
    """out[t] = Σ_j probs[t, j] · y[row of slot (t, j)]: one gather and a k-wide batched product, no atomics."""

    @staticmethod
    def forward(ctx, y_MH, probs_NK, slots_M, row_of_slot):
        n, k = probs_NK.shape
        ctx.save_for_backward(y_MH, probs_NK, slots_M, row_of_slot)
        if fused.available(y_MH):
            return fused.combine(y_MH, probs_NK, row_of_slot, n, k)
        y_NKH = _rows_by_slot(y_MH, row_of_slot).view(n, k, -1)
        return torch.bmm(probs_NK.to(y_MH.dtype).unsqueeze(1), y_NKH).squeeze(1)

    @staticmethod
    def backward(ctx, grad_NH):
        y_MH, probs_NK, slots_M, row_of_slot = ctx.saved_tensors
        n, k = probs_NK.shape
        grad_NH = grad_NH.contiguous()
        if fused.available(y_MH):
            grad_y, grad_probs = fused.combine_backward(grad_NH, y_MH, probs_NK, row_of_slot)
            return grad_y, grad_probs.to(probs_NK.dtype), None, None
        y_NKH = _rows_by_slot(y_MH, row_of_slot).view(n, k, -1)
        grad_probs = torch.bmm(y_NKH, grad_NH.unsqueeze(-1)).squeeze(-1).to(probs_NK.dtype)
        grad_y_NKH = probs_NK.to(grad_NH.dtype).unsqueeze(-1) * grad_NH.unsqueeze(1)
        grad_y = grad_y_NKH.view(n * k, -1).index_select(0, slots_M)
        return grad_y, grad_probs, None, None


def permute(x_NH: torch.Tensor, slots_M: torch.Tensor, row_of_slot: torch.Tensor, k: int) -> torch.Tensor:
    """Rows of ``x_NH`` in the order of the assignment slots ``slots_M`` (slot = token·k + choice)."""
    return _Permute.apply(x_NH, slots_M, row_of_slot, k)


def unpermute(y_MH: torch.Tensor, probs_NK: torch.Tensor, slots_M: torch.Tensor,
              row_of_slot: torch.Tensor) -> torch.Tensor:
    """Σ over each token's k slots of prob · expert output; dropped slots contribute nothing."""
    return _Unpermute.apply(y_MH, probs_NK, slots_M, row_of_slot)


def sort_by_expert(experts_NK: torch.Tensor, num_buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots sorted by expert id (ids ≥ num_buckets are dropped) and the count per bucket [num_buckets]."""
    return torch.argsort(experts_NK.reshape(-1), stable=True), count_per_expert(experts_NK, num_buckets)


def pad_rows(rows_MH: torch.Tensor, counts_E: torch.Tensor, pad_E: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rows_MH`` (sorted by expert, ``counts_E`` each) with ``pad_E`` zero rows after each expert's own:
    (padded rows [M + Σ pad, h], their counts per expert, the position of each of the M rows among them, for
    :func:`unpad_rows`). Gradients flow to ``rows_MH`` only. One host sync (the padded row count)."""
    padded_counts = counts_E + pad_E
    total = int(padded_counts.sum())
    m = rows_MH.shape[0]
    expert = torch.repeat_interleave(torch.arange(counts_E.numel(), device=counts_E.device), counts_E, output_size=m)
    shift = (torch.cumsum(padded_counts, 0) - padded_counts) - (torch.cumsum(counts_E, 0) - counts_E)
    positions = torch.arange(m, device=rows_MH.device) + shift[expert]
    padded = rows_MH.new_zeros((total, rows_MH.shape[1])).index_copy(0, positions, rows_MH)
    return padded, padded_counts, positions


def unpad_rows(y_PH: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The rows :func:`pad_rows` padded, without the padding (the experts' output of the zero rows is dropped)."""
    return y_PH.index_select(0, positions)


def chunk_order(counts_SE: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Row index that turns rows grouped (source, expert) into rows grouped (expert, source); ``total``
    (the row count, when the caller knows it) saves a host sync."""
    flat = counts_SE.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view_as(counts_SE).t().reshape(-1)
    sizes = counts_SE.t().reshape(-1)
    total = int(flat.sum()) if total is None else total
    base = torch.repeat_interleave(starts, sizes, output_size=total)
    offset_in_chunk = torch.arange(total, device=flat.device) - torch.repeat_interleave(
        torch.cumsum(sizes, 0) - sizes, sizes, output_size=total)
    return base + offset_in_chunk


@dataclass
class Dispatched:
    """Expert input sorted by local expert, the rows per local expert, and what combine needs."""

    x_MH: torch.Tensor
    tokens_per_expert: torch.Tensor  # [E_local] on device
    ctx: dict


class TokenDispatcher(ABC):
    """A token dispatcher: the stages every dispatcher implements (module docstring: notation and contract).

    ``dispatch`` and ``combine`` run the stages in line; the EP-overlap schedule (executor/ep_overlap.py) runs
    them apart and calls nothing else: ``dispatch_preprocess``, then (when :meth:`has_exchange`) an
    all-to-all over :attr:`exchange_group` sending ``exchange_sizes(ctx)[0]`` rows to each peer and receiving
    ``[1]``, ``dispatch_postprocess``, the experts, ``combine_preprocess``, the transposed all-to-all,
    ``combine_postprocess``; across its segments it hands the combine's probabilities over with
    :meth:`routing_probs` / :meth:`replace_routing_probs`. A dispatcher whose communication is not one EP
    all-to-all each way does it inside its pre/post stages and has no exchange: the schedule then runs it in
    line (correct, nothing overlapped; the rule book keeps the overlap to dispatchers with an exchange).
    """

    name: str

    def __init__(self, state: ParallelState, num_experts: int, topk: int, timer: PhaseTimer = NULL_TIMER) -> None:
        self.state, self.num_experts, self.topk, self.timer = state, num_experts, topk, timer
        self.local_experts = num_experts // state.ep.size

    @abstractmethod
    def dispatch_preprocess(self, x_NH: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, dict]:
        """[n, h] tokens in the attention layout -> (the rows to exchange, or the experts' rows when there is
        no exchange; the ``ctx`` the later stages read). No host sync for the exchange's sizes."""

    def has_exchange(self, ctx: dict) -> bool:
        """Whether an all-to-all runs between the pre and post stages of this dispatch (no host sync)."""
        return False

    def exchange_sizes(self, ctx: dict) -> tuple[list[int], list[int]]:
        """(rows sent to, rows received from) each peer of :attr:`exchange_group` by the dispatch's all-to-all
        (the combine's is its transpose); may wait for the sizes on the host. Only with :meth:`has_exchange`."""
        raise NotImplementedError(f"dispatcher {self.name!r} has no exchange")

    @property
    def exchange_group(self) -> Group:
        """The group the all-to-all between the stages runs over: EP."""
        return self.state.ep

    @abstractmethod
    def dispatch_postprocess(self, rows: torch.Tensor, ctx: dict) -> Dispatched:
        """The received rows -> the experts' input sorted by local expert, with its counts."""

    @abstractmethod
    def combine_preprocess(self, y_MH: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """[M, h] expert outputs -> the rows to send back (or, without an exchange, what combine_postprocess takes)."""

    @abstractmethod
    def combine_postprocess(self, rows: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """The rows received back -> [n, h]: each token's probability-weighted sum over its k copies."""

    def routing_probs(self, ctx: dict) -> torch.Tensor:
        """The probabilities the combine weights by: besides the rows, the combine's only input with a gradient."""
        return ctx["probs"]

    def replace_routing_probs(self, ctx: dict, probs: torch.Tensor) -> None:
        """Let the combine weight by ``probs`` (the same values as :meth:`routing_probs`, another autograd node)."""
        ctx["probs"] = probs

    def dispatch(self, x_NH: torch.Tensor, routing: Routing) -> Dispatched:
        """[n, h] tokens in the attention layout -> [M, h] rows sorted by local expert, with their counts."""
        rows, ctx = self.dispatch_preprocess(x_NH, routing)
        if self.has_exchange(ctx):
            send, recv = self.exchange_sizes(ctx)  # in line: the host waits for the counts here
            rows = all_to_all(rows, recv, send, self.exchange_group)
        return self.dispatch_postprocess(rows, ctx)

    def combine(self, y_MH: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """[M, h] expert outputs -> [n, h]: each token's probability-weighted sum over its k copies."""
        rows = self.combine_preprocess(y_MH, dispatched)
        if self.has_exchange(dispatched.ctx):
            send, recv = self.exchange_sizes(dispatched.ctx)
            rows = all_to_all(rows, send, recv, self.exchange_group)
        return self.combine_postprocess(rows, dispatched)


DISPATCHER_CLASSES: dict[str, type[TokenDispatcher]] = {}


def register_dispatcher(cls: type[TokenDispatcher]) -> type[TokenDispatcher]:
    """Class decorator: add ``cls`` to :data:`DISPATCHER_CLASSES` under ``cls.name`` (one class per name)."""
    if cls.name in DISPATCHER_CLASSES:
        raise ValueError(f"dispatcher {cls.name!r} is registered twice")
    DISPATCHER_CLASSES[cls.name] = cls
    return cls


@register_dispatcher
class AllToAllDispatcher(TokenDispatcher):
    name = "alltoall"

    # The stages around the two EP all-to-alls. Between ``dispatch_preprocess`` and ``dispatch_postprocess``
    # the rows go ``ctx["send"]`` to each EP peer and ``ctx["recv"]`` come back; the combine's all-to-all is its
    # transpose. Without EP or ETP there is no exchange (no "sizes" in ctx) and the rows pass straight through.
    # ``dispatch_preprocess`` does not read the split sizes back to the host: it starts their copy
    # (``ctx["sizes"]``, a HostInts) and :meth:`exchange_sizes` waits for it, so that the overlapped schedule
    # can issue the other micro-batch's compute before the host blocks on this one's counts (a host sync waits
    # for all the GPU has queued).

    def dispatch_preprocess(self, x_NH: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, dict]:
        """Permute by expert and size the exchange: (rows to send [Σ send, h], ctx)."""
        ep, etp = self.state.ep, self.state.etp
        n, k, e_local = x_NH.shape[0], self.topk, self.local_experts
        if routing.may_drop:
            order, counts_E = sort_by_expert(routing.experts_NK, self.num_experts)
            slots = order[: int(counts_E.sum())]  # host sync: the kept row count sizes the buffers
            row_of_slot = slot_rows(slots, n, k)
        elif fused.available(x_NH) and fused.sort_checked(self.num_experts, x_NH.device):
            # counting sort: the order and its inverse in three launches, no host sync
            slots, row_of_slot = fused.sort_slots(routing.experts_NK, self.num_experts)
            counts_E = routing.tokens_per_expert
        else:  # the router already counted; dropless: no host sync
            slots, counts_E = torch.argsort(routing.experts_NK.reshape(-1), stable=True), routing.tokens_per_expert
            row_of_slot = slot_rows(slots, n, k)
        rows = permute(x_NH, slots, row_of_slot, k)
        ctx = {"slots": slots, "row_of_slot": row_of_slot, "probs": routing.probs_NK, "counts": counts_E}
        if routing.pad_E is not None:
            rows, counts_E, ctx["unpad"] = pad_rows(rows, counts_E, routing.pad_E)
            ctx["counts"] = counts_E
        if ep.size == 1 and etp.size == 1:
            return rows, ctx

        rows = self.timer.mark(rows, "dispatch", "ep_alltoall")
        counts_PE = counts_E.view(ep.size, e_local)
        recv_PE = all_to_all(counts_PE, [1] * ep.size, [1] * ep.size, ep) if ep.size > 1 else counts_PE
        # every split size in one device-to-host copy, started here and waited for in exchange_sizes (the only
        # host sync of the dispatch): rows sent to and received from each ep peer, rows of each etp member
        # after the all-gather
        counts_SE = all_gather_nograd(recv_PE.contiguous(), etp) if etp.size > 1 else recv_PE  # [etp·ep, E_local]
        sizes = torch.cat([counts_PE.sum(1), recv_PE.sum(1), counts_SE.view(etp.size, -1).sum(1)])
        ctx.update(sizes=HostInts(sizes), counts_SE=counts_SE)
        return rows, ctx

    def has_exchange(self, ctx: dict) -> bool:
        return "sizes" in ctx

    def exchange_sizes(self, ctx: dict) -> tuple[list[int], list[int]]:
        """(rows sent to, rows received from) each EP peer by the dispatch's all-to-all; waits for the
        counts ``dispatch_preprocess`` started copying (the first call only) and keeps them in ``ctx``."""
        if "send" not in ctx:
            sizes, ep = ctx["sizes"].get(), self.state.ep.size
            ctx.update(send=sizes[:ep], recv=sizes[ep:2 * ep], per_member=sizes[2 * ep:])
        return ctx["send"], ctx["recv"]

    def dispatch_postprocess(self, rows: torch.Tensor, ctx: dict) -> Dispatched:
        """The received rows [Σ recv, h] → the experts' input, sorted by local expert."""
        if "sizes" not in ctx:
            return Dispatched(rows, ctx["counts"], ctx)
        self.exchange_sizes(ctx)
        etp = self.state.etp
        per_member = ctx["per_member"]
        if etp.size > 1:
            rows = self.timer.mark(rows, "ep_alltoall", "etp_allgather")
            rows = all_gather_v(rows, per_member, etp)
            rows = self.timer.mark(rows, "etp_allgather", "dispatch")
        else:
            per_member = None
            rows = self.timer.mark(rows, "ep_alltoall", "dispatch")
        counts_SE = ctx["counts_SE"]
        index = chunk_order(counts_SE, sum(per_member or ctx["recv"]))
        rows = rows.index_select(0, index)
        ctx.update(per_member=per_member, index=index)
        return Dispatched(rows, counts_SE.sum(0), ctx)

    def combine_preprocess(self, y_MH: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """The experts' output [M, h] → the rows to send back [Σ recv, h] (ETP partial sums reduced)."""
        c = dispatched.ctx
        if "index" not in c:
            return y_MH
        etp = self.state.etp
        inverse = torch.empty_like(c["index"])
        inverse[c["index"]] = torch.arange(c["index"].numel(), device=inverse.device)
        y_MH = y_MH.index_select(0, inverse)
        if etp.size > 1:
            y_MH = self.timer.mark(y_MH, "combine", "etp_reduce_scatter")
            y_MH = reduce_scatter_v(y_MH, c["per_member"], etp)
        return self.timer.mark(y_MH, "etp_reduce_scatter" if etp.size > 1 else "combine", "ep_alltoall")

    def combine_postprocess(self, y_MH: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """The rows received back [Σ send, h] → [n, h]: each token's probability-weighted sum of its copies."""
        c = dispatched.ctx
        if "index" in c:
            y_MH = self.timer.mark(y_MH, "ep_alltoall", "combine")
        if "unpad" in c:
            y_MH = unpad_rows(y_MH, c["unpad"])
        return unpermute(y_MH, c["probs"], c["slots"], c["row_of_slot"])


@register_dispatcher
class AllGatherDispatcher(TokenDispatcher):
    """Its communication is an all-gather before the experts and a reduce-scatter after them over tp_ep, inside
    ``dispatch_preprocess`` and ``combine_postprocess``: no exchange between the stages."""

    name = "allgather"

    def dispatch_preprocess(self, x_NH: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, dict]:
        """Gather every token of the tp_ep group and keep the copies routed to local experts, sorted by expert."""
        group = self.state.tp_ep
        k, e_local = self.topk, self.local_experts
        x_NH = self.timer.mark(x_NH, "dispatch", "tp_ep_allgather")
        x_all = all_gather(x_NH, group)
        probs_all = all_gather(routing.probs_NK, group)
        experts_all = all_gather_nograd(routing.experts_NK, group)
        x_all = self.timer.mark(x_all, "tp_ep_allgather", "dispatch")
        local = experts_all - self.state.ep.rank * e_local
        local = torch.where((local >= 0) & (local < e_local), local, e_local)
        order, counts = sort_by_expert(local, e_local)
        slots = order[: int(counts.sum())]
        row_of_slot = slot_rows(slots, x_all.shape[0], k)
        rows = permute(x_all, slots, row_of_slot, k)
        ctx = {"slots": slots, "row_of_slot": row_of_slot, "probs": probs_all, "counts": counts}
        if routing.pad_E is not None:  # every gathered rank's zero rows for the local experts
            first = self.state.ep.rank * e_local
            pad = all_gather_nograd(routing.pad_E, group).view(group.size, -1)[:, first:first + e_local].sum(0)
            rows, ctx["counts"], ctx["unpad"] = pad_rows(rows, counts, pad)
        return rows, ctx

    def dispatch_postprocess(self, rows: torch.Tensor, ctx: dict) -> Dispatched:
        return Dispatched(rows, ctx["counts"], ctx)

    def combine_preprocess(self, y_MH: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        return y_MH

    def combine_postprocess(self, y_MH: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """Weight and sum each gathered token's copies, then reduce-scatter the sums back over tp_ep."""
        c = dispatched.ctx
        if "unpad" in c:
            y_MH = unpad_rows(y_MH, c["unpad"])
        y_all = unpermute(y_MH, c["probs"], c["slots"], c["row_of_slot"])
        y_all = self.timer.mark(y_all, "combine", "tp_ep_reduce_scatter")
        y = reduce_scatter(y_all, self.state.tp_ep)
        return self.timer.mark(y, "tp_ep_reduce_scatter", "combine")


def make_dispatcher(kind: str, state: ParallelState, num_experts: int, topk: int,
                    timer: PhaseTimer = NULL_TIMER) -> TokenDispatcher:
    """The dispatcher named by ParallelConfig.moe_token_dispatcher_type; InvalidConfigError for a name
    without a registered implementation."""
    cls = DISPATCHER_CLASSES.get(kind)
    if cls is None:
        raise InvalidConfigError(f"no executor implementation of dispatcher {kind!r}; "
                                 f"implemented: {', '.join(DISPATCHER_CLASSES)}")
    return cls(state, num_experts, topk, timer)
