"""Top-k routers: softmax (pre/post), sigmoid with group-limited top-k, aux/z losses, expert bias, capacity.

The router sees this rank's tokens only (a sequence shard under SP, and under CP its two chunks of every
sequence). Statistics that Megatron defines over the whole micro-batch (tokens per expert for the aux loss,
token totals, capacity) are taken over the TP·CP group, so the losses and the dropping decisions do not depend
on the layout: each rank returns its share of a loss, and the shares sum to the single-device value.

Capacity (token dropping): the group's choices are gathered over TP, then CP, put back in the micro-batch's own
token order (CP ranks hold load-balanced chunks, :func:`executor.parallel.context_parallel.all_positions`) and
ranked there, so every layout drops the tokens a single process drops. With padding to capacity
(``moe_pad_expert_input_to_capacity``) every expert then gets exactly its capacity of rows per micro-batch: the
group's missing rows are shared out over its ranks (:attr:`Routing.pad_E`) and the dispatcher adds them as zero
rows, whose expert output has no token to return to (:func:`executor.dispatcher.pad_rows`).

The global aux loss (``global_aux_loss``, Megatron's global-batch load balancing) counts the tokens per expert
over TP and DP·CP: the micro-batch of the moment on every data-parallel replica (a "wave"), averaged over the
step's waves so far (:meth:`Router.reset_global_aux_loss` starts a step). A single process with one micro-batch
a step computes the same loss as any layout whose DP replicas hold one micro-batch each; with several waves a
step the running average is Megatron's, whose waves depend on DP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from collections import deque

from spec.errors import InvalidConfigError
from spec.model_spec import ModelSpec
from executor.kernels import triton_router as fused_router
from executor.options import ExecutorOptions
from executor.parallel.collectives import all_gather_nograd, all_reduce_
from executor.parallel.context_parallel import all_positions
from executor.parallel.groups import ParallelState
from executor.parallel.sharding import ShardInfo, make_param
from executor.recompute import recomputing


@dataclass
class RealTokens:
    """Which routed tokens are real in a packed micro-batch (padding is not): ``mask_N`` bool [n] over this
    rank's tokens, sequence-major as the router takes them; ``per_sequence_B`` fp32 [b] real tokens of each
    sequence of the micro-batch (whole sequence); ``total`` their sum (a host int: capacity is sized by it)."""

    mask_N: torch.Tensor
    per_sequence_B: torch.Tensor
    total: int


@dataclass
class Routing:
    """Routing of this rank's ``n`` tokens: ``experts_NK`` (num_experts where dropped), ``probs_NK`` (0 where dropped)."""

    experts_NK: torch.Tensor
    probs_NK: torch.Tensor
    loss: torch.Tensor  # this rank's share of aux + z loss (scalar, differentiable)
    tokens_per_expert: torch.Tensor  # this rank's routed (pre-drop) counts, [num_experts] int64
    may_drop: bool = False  # capacity mode: some experts_NK entries may be the 'dropped' id
    # padding to capacity: zero rows this rank adds to each expert's input, [num_experts] int64 (None: no padding)
    pad_E: torch.Tensor | None = None
    # packed micro-batches: the routed counts of real tokens only (what the step reports); None: every token is
    real_tokens_per_expert: torch.Tensor | None = None

    @property
    def reported_tokens_per_expert(self) -> torch.Tensor:
        """The counts a step reports: of real tokens (padding is routed, but counts nowhere)."""
        return self.tokens_per_expert if self.real_tokens_per_expert is None else self.real_tokens_per_expert


def count_per_expert(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Occurrences of each id in [0, num_experts) (larger ids ignored), int64, without a host sync
    (torch.bincount reads the maximum back to the host on CUDA)."""
    flat = ids.reshape(-1)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat.clamp(max=num_experts), torch.ones_like(flat))
    return counts[:num_experts]


def _group_limited(select_NE: torch.Tensor, num_groups: int, group_topk: int, topk: int) -> torch.Tensor:
    """Mask experts outside the ``group_topk`` best groups (a group's score: sum of its top topk/group_topk)."""
    n, e = select_NE.shape
    per_group = select_NE.view(n, num_groups, e // num_groups)
    group_score = per_group.topk(max(1, topk // group_topk), dim=-1).values.sum(-1)
    best = group_score.topk(group_topk, dim=-1).indices
    keep = torch.zeros(n, num_groups, dtype=torch.bool, device=select_NE.device).scatter_(1, best, True)
    keep = keep.unsqueeze(-1).expand_as(per_group).reshape(n, e)
    return select_NE.masked_fill(~keep, float("-inf"))


def group_token_order(n: int, micro_batch_size: int, tp: int, cp: int, device: torch.device) -> torch.Tensor:
    """For each row of the TP·CP group's tokens gathered over TP, then CP (rank order: CP rank, TP rank, then each
    rank's ``n`` tokens sequence-major), its index in the micro-batch's own order (sequence-major over the whole
    sequence, as a single process holds it). Each CP rank's tokens are its load-balanced chunks' positions, cut
    into TP slices in order, so the gathered rows run through :func:`all_positions`."""
    g = torch.arange(n * tp * cp, device=device)
    positions = all_positions(n * tp * cp // micro_batch_size, cp, device)
    return positions[g // micro_batch_size] * micro_batch_size + g % micro_batch_size


def _capacity_keep(experts_TK: torch.Tensor, probs_TK: torch.Tensor, num_experts: int, capacity: int,
                   policy: str, padding_T: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean [T, K]: which assignments fit in each expert's ``capacity`` (loop-free ranking per expert);
    ``padding_T`` (bool, packed micro-batches): tokens that take no place and are all dropped."""
    if padding_T is not None:  # an extra bucket after the experts holds padding's assignments, ranked apart
        keep = _capacity_keep(experts_TK.masked_fill(padding_T.unsqueeze(1), num_experts), probs_TK,
                              num_experts + 1, capacity, policy)
        return keep & ~padding_T.unsqueeze(1)
    flat_e = experts_TK.reshape(-1)
    if policy == "probs":
        by_prob = torch.argsort(probs_TK.reshape(-1), descending=True, stable=True)
        order = by_prob[torch.argsort(flat_e[by_prob], stable=True)]
    else:  # earliest tokens first
        order = torch.argsort(flat_e, stable=True)
    counts = count_per_expert(flat_e, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.empty_like(order)
    rank_in_expert[order] = torch.arange(order.numel(), device=order.device) - starts[flat_e[order]]
    return (rank_in_expert < capacity).view_as(experts_TK)


class Router(torch.nn.Module):
    """Linear gate [num_experts, hidden] (and bias [num_experts] with add_bias_linear; replicated, gradients
    summed over TP) and the top-k rule."""

    def __init__(self, spec: ModelSpec, options: ExecutorOptions, state: ParallelState, layer: int,
                 device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.spec, self.options, self.state = spec, options, state
        self.num_experts = spec.num_experts
        self.topk = spec.moe_router_topk
        info = ShardInfo(f"layers.{layer}.router.weight", (spec.num_experts, spec.hidden_size), tp_partial=True)
        self.weight = make_param(info, state, "normal", options.init_method_std, options.seed, device, dtype)
        self.bias = None
        if spec.add_bias_linear:  # Megatron's router takes add_bias_linear too (GPT-OSS's router has a bias)
            info = ShardInfo(f"layers.{layer}.router.bias", (spec.num_experts,), tp_partial=True)
            self.bias = make_param(info, state, "zeros", 0.0, options.seed, device, dtype)
        # the rule book's pad_to_capacity, re-checked for a model built without executor.buildable
        if options.moe_pad_expert_input_to_capacity and options.moe_expert_capacity_factor is None:
            raise InvalidConfigError("[pad_to_capacity] moe_pad_expert_input_to_capacity needs a capacity factor")
        self.global_aux = (options.moe_router_load_balancing_type == "global_aux_loss"
                           and bool(options.moe_aux_loss_coeff))
        if self.global_aux:  # the step's tokens per expert so far, over every replica (not checkpointed)
            self.register_buffer("global_tokens_per_expert", torch.zeros(spec.num_experts, device=device),
                                 persistent=False)
            self.global_waves = 0
            # the averages the step's forwards used, oldest first: a recomputed forward (backward order is forward
            # order for every schedule here) takes its own back instead of the step's later total
            self._global_averages: deque[torch.Tensor] = deque()
        problem = options.router_options().model_problem(spec)  # the expert bias needs sigmoid scores
        if problem:
            raise InvalidConfigError(problem)
        if options.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(spec.num_experts, device=device))
            self.register_buffer("step_counts", torch.zeros(spec.num_experts, device=device))
        else:
            self.expert_bias = None

    def _fusable(self, logits: torch.Tensor) -> bool:
        """Whether the fused Triton kernel covers this router (softmax scores, plain top-k or forced balance,
        on CUDA)."""
        spec = self.spec
        return (fused_router.available(logits) and spec.moe_router_score_function == "softmax"
                and not spec.moe_router_num_groups and self.expert_bias is None
                and fused_router.self_checked(self.num_experts, self.topk, spec.moe_router_pre_softmax,
                                              spec.moe_router_topk_scaling_factor or 1.0, logits.dtype, logits.device,
                                              self.options.moe_router_force_load_balancing))

    def _forced_first(self, n: int) -> int:
        """Forced balancing: the slot of this rank's first token in the micro-batch (its global index over
        TP·CP times k), so that token t takes experts (t·k + j) mod E whatever the layout."""
        tp, cp = self.state.tp, self.state["cp"]
        return (cp.rank * tp.size + tp.rank) * n * self.topk

    def _select(self, logits_NE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts [n, k], probs [n, k]) from fp32 logits with torch ops (every router variant)."""
        spec, opts = self.spec, self.options
        n = logits_NE.shape[0]
        if spec.moe_router_score_function == "sigmoid":
            scores_NE = torch.sigmoid(logits_NE)
        elif spec.moe_router_pre_softmax:
            scores_NE = torch.softmax(logits_NE, dim=-1)
        else:
            scores_NE = logits_NE
        select_NE = scores_NE.detach()
        if self.expert_bias is not None:
            select_NE = select_NE + self.expert_bias
        if spec.moe_router_num_groups:
            select_NE = _group_limited(select_NE, spec.moe_router_num_groups, spec.moe_router_group_topk, self.topk)
        if opts.moe_router_force_load_balancing:
            experts_NK = fused_router.forced_experts(self._forced_first(n), n, self.topk, self.num_experts,
                                                     logits_NE.device)
        else:
            experts_NK = select_NE.topk(self.topk, dim=-1).indices
        probs_NK = scores_NE.gather(1, experts_NK)
        if spec.moe_router_score_function == "sigmoid":
            if self.topk > 1:
                probs_NK = probs_NK / (probs_NK.sum(-1, keepdim=True) + 1e-20)
        elif not spec.moe_router_pre_softmax:
            probs_NK = torch.softmax(probs_NK, dim=-1)
        if spec.moe_router_topk_scaling_factor:
            probs_NK = probs_NK * spec.moe_router_topk_scaling_factor
        return experts_NK, probs_NK

    def _plain_topk(self) -> bool:
        """Whether the routed experts are the plain top-k of the scores (no bias, groups or forced balance)."""
        return (self.expert_bias is None and not self.spec.moe_router_num_groups
                and not self.options.moe_router_force_load_balancing)

    def _load_balancing_loss(self, logits_NE: torch.Tensor, experts_NK: torch.Tensor, micro_batch_size: int,
                             total_tokens: int, real: RealTokens | None = None) -> torch.Tensor:
        """This rank's share of Megatron's switch load-balancing loss, E·coeff/(k·T²) · Σ_e P_e · f_e.

        P_e sums the normalised scores (softmax, or sigmoid over its row sum) of this rank's tokens; f_e counts
        the tokens whose plain top-k of those scores holds e, over the TP·CP group: Megatron's
        compute_routing_scores_for_aux_loss ignores the expert bias, the group limit and dropping, so the
        loss does not follow the routing they change. 'aux_loss' takes the micro-batch as one set of T tokens;
        'seq_aux_loss' (DeepSeek-V2/V3) takes each sequence on its own (T = its length) and averages the
        sequences' losses. Tokens arrive sequence-major ([s, b] flattened), so token i is of sequence i % b.
        With ``real`` (packed micro-batches) padding adds to neither P_e nor f_e, and T counts real tokens only
        (per sequence for 'seq_aux_loss').
        """
        spec, opts, tp, cp = self.spec, self.options, self.state.tp, self.state["cp"]
        n, e, k = logits_NE.shape[0], self.num_experts, self.topk
        if spec.moe_router_score_function == "sigmoid":
            scores_NE = torch.sigmoid(logits_NE)
            scores_NE = scores_NE / (scores_NE.sum(-1, keepdim=True) + 1e-20)
        else:
            scores_NE = torch.softmax(logits_NE, dim=-1)
        sequences = micro_batch_size if opts.moe_router_load_balancing_type == "seq_aux_loss" else 1
        ids_NK = experts_NK if self._plain_topk() else scores_NE.detach().topk(k, dim=-1).indices
        if sequences > 1:  # experts of sequence j become columns j·E .. j·E + E - 1
            ids_NK = ids_NK + (torch.arange(n, device=ids_NK.device) % sequences * e).unsqueeze(1)
        if real is not None:  # padding: past every column (uncounted), no score
            ids_NK = ids_NK.masked_fill(~real.mask_N.unsqueeze(1), sequences * e)
            scores_NE = scores_NE * real.mask_N.unsqueeze(1)
        counts = count_per_expert(ids_NK, sequences * e)
        if self.global_aux:
            return self._global_aux_loss(scores_NE.sum(0), counts, total_tokens, real)
        if tp.size > 1 or cp.size > 1:
            counts = all_reduce_(all_reduce_(counts, tp), cp)
        probs = scores_NE.reshape(n // sequences, sequences * e).sum(0)
        if real is not None:  # tokens of each set: real ones, per sequence or over the micro-batch
            tokens = real.per_sequence_B if sequences > 1 else real.per_sequence_B.sum().reshape(1)
            scale_S = e * opts.moe_aux_loss_coeff / (k * tokens.clamp(min=1).square() * sequences)
            return ((probs * counts.float()).view(sequences, e).sum(1) * scale_S).sum()
        tokens = total_tokens // sequences  # of one set (the micro-batch, or one sequence), over TP·CP
        scale = e * opts.moe_aux_loss_coeff / (k * tokens * tokens * sequences)
        return (probs * counts.float()).sum() * scale

    def _global_aux_loss(self, probs_E: torch.Tensor, counts_E: torch.Tensor, total_tokens: int,
                         real: RealTokens | None = None) -> torch.Tensor:
        """This rank's share of the global aux loss: the switch loss of the wave (every DP replica's micro-batch of
        the moment: ``total_tokens`` times DP tokens; with ``real``, the replicas' real tokens) with the tokens
        per expert averaged over the step's waves so far. The share is scaled by DP: the gradients average over
        DP·CP, and the model scales by CP."""
        state, opts = self.state, self.options
        dp_cp = state["dp_cp"]
        counts = all_reduce_(all_reduce_(counts_E, state.tp), dp_cp).float()  # the wave's, over TP·DP·CP
        if recomputing():
            average = self._global_averages.popleft()
        elif self.training:
            self.global_tokens_per_expert += counts
            self.global_waves += 1
            average = self.global_tokens_per_expert / self.global_waves
            if torch.is_grad_enabled():
                self._global_averages.append(average)
        else:
            average = counts
        dp = dp_cp.size // state["cp"].size
        tokens = total_tokens * dp
        if real is not None:  # every CP rank holds the whole micro-batch's count: the sum over DP·CP is CP times DP's
            wave = all_reduce_(real.per_sequence_B.sum().reshape(1), dp_cp)[0] / state["cp"].size
            tokens = wave.clamp(min=1)
        scale = self.num_experts * opts.moe_aux_loss_coeff / (self.topk * tokens * tokens) * dp
        return (probs_E * average).sum() * scale

    @torch.no_grad()
    def reset_global_aux_loss(self) -> None:
        """Start a step's global aux loss afresh (Megatron resets its tracker once per step); a no-op otherwise."""
        if self.global_aux:
            self.global_tokens_per_expert.zero_()
            self.global_waves = 0
            self._global_averages.clear()

    def logits(self, x_NH: torch.Tensor) -> torch.Tensor:
        """The router's logits [n, experts] of ``n`` tokens: the part of routing whose shapes never change (what
        a layer's CUDA graph captures)."""
        return F.linear(x_NH, self.weight, self.bias)

    def forward(self, x_NH: torch.Tensor, micro_batch_size: int = 1, real: RealTokens | None = None,
                logits: torch.Tensor | None = None) -> Routing:
        """Route this rank's ``n`` tokens, sequence-major ([s/tp, b] flattened, ``b = micro_batch_size``).
        ``real``: a packed micro-batch's real tokens; padding is routed (its rows pass through the experts and
        come back unused) but has no part in the z and aux losses, the tokens they count, the capacity and its
        ranking (padding is dropped under a capacity), the expert bias's load or the reported counts.
        ``logits``: :meth:`logits` of ``x_NH``, already computed."""
        spec, opts, tp = self.spec, self.options, self.state.tp
        n = x_NH.shape[0]
        cp = self.state["cp"]
        total_tokens = n * tp.size * cp.size  # tokens of the micro-batch seen by this TP·CP group
        if real is not None and bool(real.total == total_tokens):
            real = None  # no padding in this micro-batch: the unmasked path, which is the same
        logits = self.logits(x_NH) if logits is None else logits
        fused = self._fusable(logits)
        # fp32 logits for the losses and the torch top-k; the fused kernel reads the raw ones itself
        logits_NE = logits.float() if not fused or opts.moe_z_loss_coeff or opts.moe_aux_loss_coeff else None
        loss = torch.zeros((), device=logits.device, dtype=torch.float32)
        if opts.moe_z_loss_coeff:
            z_N = torch.logsumexp(logits_NE, -1).square()
            if real is not None:
                z_N = z_N * real.mask_N
            loss = loss + opts.moe_z_loss_coeff * z_N.sum() / (total_tokens if real is None else max(real.total, 1))

        if fused:
            forced_first = self._forced_first(n) if opts.moe_router_force_load_balancing else None
            experts_NK, probs_NK, counts_E = fused_router.softmax_topk(
                logits, self.topk, spec.moe_router_pre_softmax, spec.moe_router_topk_scaling_factor or 1.0,
                forced_first)
        else:
            experts_NK, probs_NK = self._select(logits_NE)
            counts_E = count_per_expert(experts_NK, self.num_experts)
        real_counts_E = None
        if real is not None:  # padding's assignments under the dropped id: counted nowhere
            real_counts_E = count_per_expert(experts_NK.masked_fill(~real.mask_N.unsqueeze(1), self.num_experts),
                                             self.num_experts)
        if opts.moe_aux_loss_coeff and opts.moe_router_load_balancing_type != "none":
            loss = loss + self._load_balancing_loss(logits_NE, experts_NK, micro_batch_size, total_tokens, real)

        pad_E = None
        if opts.moe_expert_capacity_factor is not None:
            routed = total_tokens if real is None else real.total
            capacity = math.ceil(routed * self.topk / self.num_experts * opts.moe_expert_capacity_factor)
            all_experts = all_gather_nograd(all_gather_nograd(experts_NK, tp), cp)
            all_probs = all_gather_nograd(all_gather_nograd(probs_NK.detach(), tp), cp)
            padding = None if real is None else ~all_gather_nograd(all_gather_nograd(real.mask_N, tp), cp)
            if cp.size > 1:  # rank in the micro-batch's token order, as one process does
                order = group_token_order(n, micro_batch_size, tp.size, cp.size, all_experts.device)
                inverse = torch.empty_like(order)
                inverse[order] = torch.arange(order.numel(), device=order.device)
                keep = _capacity_keep(all_experts[inverse], all_probs[inverse], self.num_experts, capacity,
                                      opts.moe_token_drop_policy, None if padding is None else padding[inverse])[order]
            else:
                keep = _capacity_keep(all_experts, all_probs, self.num_experts, capacity, opts.moe_token_drop_policy,
                                      padding)
            if opts.moe_pad_expert_input_to_capacity:
                pad_E = self._padding(all_experts.masked_fill(~keep, self.num_experts), capacity)
            mine = cp.rank * tp.size + tp.rank
            keep = keep[mine * n:(mine + 1) * n]
            experts_NK = experts_NK.masked_fill(~keep, self.num_experts)
            probs_NK = probs_NK * keep
        if self.expert_bias is not None and self.training and not recomputing():
            # the load the bias balances is what the experts receive: after dropping (Megatron counts its
            # routing map after apply_router_token_dropping); dropped slots hold the id num_experts
            dropped = opts.moe_expert_capacity_factor is not None
            load = counts_E if real_counts_E is None else real_counts_E  # padding is no load
            self.step_counts += (count_per_expert(experts_NK, self.num_experts) if dropped else load).float()
        return Routing(experts_NK, probs_NK, loss, counts_E, opts.moe_expert_capacity_factor is not None, pad_E,
                       real_counts_E)

    def _padding(self, kept_TK: torch.Tensor, capacity: int) -> torch.Tensor:
        """This rank's zero rows per expert when every expert's input is padded to ``capacity``: each expert's
        missing rows over the TP·CP group (capacity minus the kept copies ``kept_TK``, dropped ones holding the id
        num_experts) shared out over the group's ranks in gathered order, the first ones taking one more."""
        tp, cp = self.state.tp, self.state["cp"]
        ranks, mine = tp.size * cp.size, cp.rank * tp.size + tp.rank
        missing = capacity - count_per_expert(kept_TK, self.num_experts)
        return missing // ranks + (mine < missing % ranks).long()

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Aux-loss-free balancing: move each bias toward under-loaded experts, by the step's global counts."""
        if self.expert_bias is None:
            return
        counts = all_reduce_(all_reduce_(self.step_counts, self.state.tp), self.state["dp_cp"])
        self.expert_bias += self.options.moe_router_bias_update_rate * torch.sign(counts.mean() - counts)
        self.step_counts.zero_()
