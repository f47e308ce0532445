"""One optimizer step of the folded model: micro-batches fwd+bwd, gradient reduction, Adam, expert bias."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.model import MoEGPT
from executor.parallel.collectives import all_reduce_
from executor.parallel.grad_reduce import GradReducer


@dataclass
class StepResult:
    """Step statistics, identical on every rank: mean loss over the global batch, its CE and router parts,
    and routed tokens per expert summed over MoE layers and the whole global batch."""

    loss: float
    ce: float
    router_loss: float
    tokens_per_expert: list[int]


def _adam_impl(model: torch.nn.Module) -> dict:
    """Fused (one kernel per step) AdamW on CUDA; the multi-tensor path on CPU."""
    on_cuda = next(model.parameters()).is_cuda
    return {"fused": True} if on_cuda else {"foreach": True}


class Trainer:
    """Owns the optimizer and gradient reducer of one rank's model slice."""

    def __init__(self, model: MoEGPT, lr: float = 1e-3, weight_decay: float = 0.0, bucket_mb: float = 25.0,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8):
        self.model = model
        self.reducer = GradReducer(model, model.state, bucket_mb,
                                   overlap=bool(model.state.config.overlap_grad_reduce))
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas,
                                           eps=eps, **_adam_impl(model))

    def forward_backward(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Accumulate gradients of the mean loss over this rank's micro-batches; returns [ce, router] sums."""
        model = self.model
        stats = torch.zeros(2, device=self.model.rope_cos.device)
        counts = None
        for i, (ids, labels) in enumerate(micro):
            out = model(ids, labels)
            if i == len(micro) - 1:
                self.reducer.arm()  # the last backward's final gradients start their all-reduce at once
            (out.loss / len(micro)).backward()
            stats += torch.stack([out.ce, out.router_loss]) / len(micro)
            for moe in model.moe_layers():
                c = moe.last_tokens_per_expert
                counts = c.clone() if counts is None else counts + c
        self._counts = counts
        return stats

    def step(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        model, state, timer = self.model, self.model.state, self.model.timer
        self.optimizer.zero_grad(set_to_none=True)
        stats = self.forward_backward(micro)
        timer.switch("grad_reduce")
        self.reducer.reduce()
        timer.switch("optimizer")
        self.optimizer.step()
        for moe in model.moe_layers():
            moe.router.update_expert_bias()
        timer.switch("other")
        with torch.no_grad():
            dp = state["dp_cp"]
            stats = all_reduce_(stats, dp) / dp.size
            counts = self._counts if self._counts is not None else torch.zeros(1, dtype=torch.long,
                                                                               device=stats.device)
            counts = all_reduce_(all_reduce_(counts.clone(), state.tp), dp)
        ce, router = stats.tolist()
        return StepResult(ce + router, ce, router, [int(c) for c in counts.tolist()])
