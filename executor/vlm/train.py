"""One optimizer step of a vision-language MoE model on a homogeneous or colocated multimodal layout (the LLM at
pp = 1): the LLM's gradients reduced and stepped by the LLM's :class:`~executor.train_step.Trainer`, the
encoder's by an Adam of its own after its gradients are summed over the encoder's data-parallel group.

Why the encoder's gradient is divided by the LLM's dp·cp: each LLM rank's loss is the mean over its micro-batch
(under CP over its share of the sequence), so the gradients reaching the encoder, summed over every rank that
holds an encoder shard's copy, are dp·cp times the gradient of the global batch's mean loss (TP ranks each
write disjoint image rows: their parts add up to one sample's).

Micro-batches are synthetic (:func:`executor.vlm.synthetic.synthetic_batch`) or real :class:`VLBatch` es; every
rank of one LLM data-parallel rank (its TP and CP peers) trains the same ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spec.errors import InvalidConfigError
from spec.multimodal import ImageInputs, VisionLanguageSpec
from executor.parallel.groups import Group
from executor.train_step import StepResult, Trainer
from executor.vlm.model import VisionLanguageMoE, VLBatch
from executor.vlm.synthetic import synthetic_batch


def mrope_section_for(rotary_pairs: int) -> tuple[int, int, int]:
    """The (temporal, height, width) split of ``rotary_pairs`` rotary frequency pairs: Qwen3-VL's (24, 20, 20) of
    64 pairs, height and width each 5/16 of them, the rest temporal (8 pairs: (4, 2, 2))."""
    side = rotary_pairs * 5 // 16
    return rotary_pairs - 2 * side, side, side


class VLTrainer(Trainer):
    """The LLM's Trainer (its reducer and mixed-precision Adam over ``model.llm``) plus the encoder's Adam;
    ``encoder_dp``: the group over which the encoder's gradients are summed (None: this rank alone)."""

    def __init__(self, model: VisionLanguageMoE, encoder_dp: Group | None, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8):
        super().__init__(model.llm, lr=lr, betas=betas, eps=eps)
        if self.pipelined or self.ep_overlap:
            raise InvalidConfigError("the vision-language step runs the LLM at pp = 1 without the EP overlap "
                                     "schedule")
        self.vl, self.encoder_dp = model, encoder_dp
        self.encoder_optimizer = torch.optim.Adam(model.encoder.parameters(), lr=lr, betas=betas, eps=eps)

    def forward_backward(self, micro: list[VLBatch]) -> torch.Tensor:  # type: ignore[override]
        """Accumulate the gradients of the mean loss over this rank's micro-batches; the mean [ce, router, mtp]."""
        llm = self.model
        stats = torch.zeros(3, device=llm.rope_cos.device)
        counts = None
        for i, batch in enumerate(micro):
            out = self.vl(batch)
            if i == len(micro) - 1:
                self.reducer.arm()
            (out.loss / len(micro)).backward()
            stats += out.stats() / len(micro)
            counts = llm.count_routed(counts, llm.moe_layers())
        self._counts = counts
        return stats

    def step(self, micro: list[VLBatch]) -> StepResult:  # type: ignore[override]
        self.encoder_optimizer.zero_grad(set_to_none=False)
        result = super().step(micro)
        state = self.model.state
        scale = 1.0 / (state.dp.size * state["cp"].size)
        with torch.no_grad():
            for p in self.vl.encoder.parameters():
                if p.grad is None:
                    continue
                if self.encoder_dp is not None and self.encoder_dp.size > 1:
                    dist.all_reduce(p.grad, group=self.encoder_dp.pg)
                p.grad.mul_(scale)
        self.encoder_optimizer.step()
        return result


def synthetic_micro_batches(spec: VisionLanguageSpec, images: ImageInputs, seq_length: int, global_batch_size: int,
                            micro_batch_size: int, dp_size: int, dp_rank: int, seed: int, step: int,
                            device="cpu") -> list[VLBatch]:
    """This data-parallel rank's micro-batches of step ``step``: ``global_batch_size / (dp · mbs)`` synthetic
    batches, each drawn from a generator seeded by (seed, step, dp rank, index), so TP and CP peers agree."""
    per_rank = global_batch_size // dp_size
    if per_rank * dp_size != global_batch_size or per_rank % micro_batch_size:
        raise InvalidConfigError(f"global batch {global_batch_size} does not split into micro-batches of "
                                 f"{micro_batch_size} over {dp_size} data-parallel ranks")
    out = []
    for index in range(per_rank // micro_batch_size):
        gen = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 4099 + dp_rank) * 257 + index)
        out.append(synthetic_batch(spec, images, seq_length, micro_batch_size, gen, device))
    return out
