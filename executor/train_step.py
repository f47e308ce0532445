"""One optimizer step of the folded model: micro-batches fwd+bwd, gradient reduction, Adam, expert bias."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spec.head_features import last_stage_embeds
from executor.documents import check_packed, loss_tokens
from executor.kernels.fp8 import clear_weight_cache
from executor.model import MoEGPT
from executor.optimizer import MixedPrecisionAdam, torch_state_dtypes
from executor.parallel.collectives import all_reduce_
from executor.parallel.grad_reduce import GradReducer
from executor.pipeline import run_schedule


@dataclass
class StepResult:
    """Step statistics, identical on every rank: mean loss over the global batch, its CE and router parts,
    routed tokens per expert summed over MoE layers (MTP layers included) and the whole global batch, and the
    MTP loss (mean over depths of their CE, before ``mtp_loss_scaling_factor``; 0 without MTP). ``loss`` is
    ce + router_loss + mtp_loss_scaling_factor · mtp_loss, the objective trained. ``tokens_per_expert_by_layer``
    holds the same counts before the sum over layers: one row per MoE layer of the whole model
    (``MoEGPT.moe_layer_numbers``), each row summing to global batch tokens × top-k (routed, before any
    capacity drop)."""

    loss: float
    ce: float
    router_loss: float
    tokens_per_expert: list[int]
    mtp_loss: float = 0.0
    tokens_per_expert_by_layer: list[list[int]] = field(default_factory=list)


class Trainer:
    """Owns the optimizer and gradient reducer of one rank's model slice.

    The optimizer is Megatron's mixed-precision Adam (fp32 main grads, master weights and moments), sharded
    over DP·CP / EDP when the layout's ``use_distributed_optimizer`` is set; see :mod:`executor.optimizer`.
    With ``overlap_param_gather`` as well, :meth:`step` returns with the parameter all-gathers still running
    (the next forward waits for them): call :meth:`finish_param_gather` before reading parameters otherwise.
    ``optimizer_cpu_offload_fraction`` of the layout steps that share of the optimizer state on the CPU;
    ``exp_avg_dtype``, ``exp_avg_sq_dtype`` and ``main_params_dtype`` set the dtypes it keeps its state in.
    """

    def __init__(self, model: MoEGPT, lr: float = 1e-3, weight_decay: float = 0.0, bucket_mb: float = 25.0,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8):
        self.model = model
        config = model.state.config
        sharded = bool(config.use_distributed_optimizer)
        params = list(model.parameters())
        # The reducer gives 16-bit parameters their fp32 main grads, as views of its per-bucket buffers.
        self.reducer = GradReducer(model, model.state, bucket_mb, overlap=bool(config.overlap_grad_reduce),
                                   sharded=sharded, main_grads=True)
        # overlap_param_gather: step() leaves the sharded units' all-gathers running; the model's forward
        # waits for each unit before its parameters are used (executor.optimizer)
        self.optimizer = MixedPrecisionAdam(params, self.reducer, lr=lr, betas=betas, eps=eps,
                                            weight_decay=weight_decay, sharded=sharded,
                                            overlap_param_gather=bool(config.overlap_param_gather), model=model,
                                            offload_fraction=config.optimizer_cpu_offload_fraction,
                                            state_dtypes=torch_state_dtypes(config.optimizer_dtypes))
        pp = model.state["pp"]
        self.pipelined = pp.size > 1
        self.ep_overlap_trace: list | None = None  # a list: the overlapped schedule logs its events (tests)
        # the layout's EP all-to-all overlap, switchable between steps: bench/ep_overlap_paired.py times steps
        # with and without it in one process (the EP group's NCCL stream keeps the priority it was built with)
        self.ep_overlap = bool(config.overlap_moe_expert_parallel_comm)
        if self.pipelined:  # NCCL's first grouped p2p must involve the whole group: connect it here
            all_reduce_(torch.zeros(1, device=model.rope_cos.device), pp)

    def finish_param_gather(self) -> None:
        """Wait for the parameter all-gathers the last :meth:`step` left running (overlap_param_gather)."""
        self.optimizer.finish_param_gather()

    def _arm_before_last_backward(self):
        """``reducer.arm`` where the schedule may start the gradient reduction during this rank's last backward
        (each parameter then gets its last gradient there, once), else None: the reduction follows the
        backward. With virtual chunks a parameter's last gradient comes at its chunk's last backward, not the
        rank's. Under the EP overlap a backward runs segment by segment, and a parameter used in two segments
        (the word embedding, tied or read by MTP) accumulates twice in one backward, which the reducer's
        per-bucket countdown would take for two micro-batches."""
        if self.model.vpp > 1:
            return None
        spec = self.model.spec
        if self.ep_overlap and not (spec.untie_embeddings_and_output_weights and not last_stage_embeds(spec)):
            return None
        return self.reducer.arm

    def forward_backward(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Accumulate gradients of the mean loss over this rank's micro-batches; returns the mean
        [ce, router, mtp] (:meth:`LossOutput.stats`). Packed micro-batches (ids, labels, segments) divide their
        cross-entropy by the global batch's real tokens per micro-batch (:func:`executor.documents.loss_tokens`,
        one all-reduce over DP), so that the mean is Megatron's per-token loss over the global batch; the
        router losses stay a mean over micro-batches."""
        model = self.model
        tokens = None
        if any(len(m) > 2 for m in micro):  # packed (ids, labels, segments): refused where they would be dropped
            check_packed(model.spec, model.state.config, model.options)
            tokens = loss_tokens(micro, model.state.dp)
        if self.pipelined or self.ep_overlap:
            # the pipeline's (interleaved) 1F1B, or with the EP overlap its combined 1F1B (pp = 1 included): one
            # micro-batch's forward together with another's backward, each one's EP all-to-alls under the
            # other's compute (executor/pipeline.py, executor/ep_overlap.py)
            stats, self._counts = run_schedule(model, micro, self._arm_before_last_backward(),
                                               overlap=self.ep_overlap, trace=self.ep_overlap_trace)
            return stats
        stats = torch.zeros(3, device=self.model.rope_cos.device)
        counts = None
        for i, (ids, labels, *segments) in enumerate(micro):
            out = model(ids, labels, *segments, loss_tokens=tokens) if segments else model(ids, labels)
            if i == len(micro) - 1:
                self.reducer.arm()  # the last backward's final gradients start their all-reduce at once
            (out.loss / len(micro)).backward()
            stats += out.stats() / len(micro)
            counts = model.count_routed(counts, model.moe_layers())
        self._counts = counts
        return stats

    def step(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        model, state, timer = self.model, self.model.state, self.model.timer
        self.optimizer.zero_grad()
        for moe in model.moe_layers():  # the global aux loss averages over this step's micro-batches only
            moe.router.reset_global_aux_loss()
        stats = self.forward_backward(micro)
        timer.switch("grad_reduce")
        self.reducer.reduce()
        timer.switch("other")
        # Step statistics and the expert bias (as Megatron's finalize_model_grads) come before the optimizer:
        # with overlap_param_gather its all-gathers are still queued on the DP·CP and EDP communicators when
        # step() returns, and a collective queued behind them (NCCL runs a communicator's work in launch
        # order) would hold the host (the loss read) or the next forward's stream until they all finish.
        with torch.no_grad():
            dp = state["dp_cp"]
            stats = all_reduce_(all_reduce_(stats, state["pp"]), dp) / dp.size  # stages hold disjoint layers
            # [MoE layers, experts]: TP (sequence parallel) and DP·CP ranks route disjoint tokens, pipeline
            # stages disjoint layers (zero rows elsewhere), so the sums are the whole global batch per layer
            counts = self._counts if self._counts is not None else torch.zeros(
                (len(model.moe_layer_numbers), max(model.spec.num_experts, 1)), dtype=torch.long,
                device=stats.device)
            if counts.numel():  # a model without MoE layers has no rows on any rank
                counts = all_reduce_(all_reduce_(all_reduce_(counts.clone(), state.tp), dp), state["pp"])
        for moe in model.moe_layers():
            moe.router.update_expert_bias()
        timer.switch("optimizer")
        # the fp8 weight forms (1-2 bytes per weight element) are stale once Adam writes the weights: freed
        # here, not beside Adam's temporaries at the step's peak; the next step's first forward re-makes them
        clear_weight_cache()
        self.optimizer.step()  # ends with the parameter all-gather when sharded (left running when overlapped)
        timer.switch("other")
        ce, router, mtp = stats.tolist()
        loss = ce + router + model.options.mtp_loss_scaling_factor * mtp
        by_layer = counts.tolist()
        total = counts.sum(0).tolist() if by_layer else [0] * max(model.spec.num_experts, 1)
        return StepResult(loss, ce, router, [int(c) for c in total], mtp_loss=mtp, tokens_per_expert_by_layer=by_layer)
