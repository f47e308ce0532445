"""One optimizer step of a vision-language MoE model on a multimodal layout (within executor_vl_layout's
limits): the LLM's gradients reduced and stepped by the LLM's :class:`~executor.train_step.Trainer`, the
encoder's by an Adam of its own after its gradients are summed over the encoder's data-parallel group.
Homogeneous and colocated: :class:`VLTrainer` on every rank (the LLM pipelined or not); separate:
:class:`SeparateLLMTrainer` on the LLM's ranks, :class:`SeparateEncoderTrainer` on the encoder's. With clipping
on, both parts are clipped by one global norm (:class:`VLGradClipper`).

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
from spec.parallel_config import ParallelConfig
from executor.parallel.groups import Group, build_parallel_state
from executor.train.grad_norm import GradClipper
from executor.train_step import StepResult, Trainer
from executor.vlm.boundary import is_tp_split
from executor.vlm.model import VisionLanguageMoE, VLBatch
from executor.pipeline import run_schedule
from executor.vlm.separate import (SeparatePlacement, encoder_forward_only, encoder_step, llm_microbatch,
                                   pack_tokens, receive_tokens_from as receive_tokens, unpack_tokens)
from executor.vlm.synthetic import synthetic_batch


def mrope_section_for(rotary_pairs: int) -> tuple[int, int, int]:
    """The (temporal, height, width) split of ``rotary_pairs`` rotary frequency pairs: Qwen3-VL's (24, 20, 20) of
    64 pairs, height and width each 5/16 of them, the rest temporal (8 pairs: (4, 2, 2))."""
    side = rotary_pairs * 5 // 16
    return rotary_pairs - 2 * side, side, side


def reduce_encoder_grads(encoder: torch.nn.Module, encoder_dp: Group | None, scale: float) -> None:
    """Sum the encoder's gradients over its data-parallel group, then multiply them by ``scale``."""
    with torch.no_grad():
        for p in encoder.parameters():
            if p.grad is None:
                continue
            if encoder_dp is not None and encoder_dp.size > 1:
                dist.all_reduce(p.grad, group=encoder_dp.pg)
            p.grad.mul_(scale)


class VLGradClipper:
    """One gradient norm over all parameters of the vision-language model, the LLM's and the encoder's (as
    Megatron clips a model by one global norm), and clipping of both by it.

    Each rank adds its share of the squared norm and one all-reduce over the world sums them: the LLM's part as
    :class:`executor.train.grad_norm.GradClipper` weighs it; the encoder's, once its gradients are reduced
    (equal on every replica), each element weighted by its shards (encoder tp for a TP-split parameter, else 1)
    over the ``encoder_ranks`` that hold the encoder (the LLM's world when colocated, enc_tp·enc_dp when
    separate). ``llm`` or ``encoder`` is None on a rank that holds no such part (the separate placement)."""

    def __init__(self, llm: GradClipper | None, encoder: torch.nn.Module | None, encoder_tp: int,
                 encoder_ranks: int, device):
        self.llm, self.encoder, self.device = llm, encoder, device
        self.weights = {} if encoder is None else {
            name: (encoder_tp if is_tp_split(name) else 1) / encoder_ranks for name, _ in encoder.named_parameters()}

    def _encoder_grads(self) -> list[tuple[torch.Tensor, float]]:
        if self.encoder is None:
            return []
        return [(p.grad, self.weights[n]) for n, p in self.encoder.named_parameters() if p.grad is not None]

    @torch.no_grad()
    def norm(self) -> torch.Tensor:
        """L2 norm of the whole model's gradient (fp32 scalar, equal on every rank). Collective over the world."""
        total = self.llm.square_sum() if self.llm is not None else torch.zeros((), device=self.device)
        for grad, weight in self._encoder_grads():
            total = total + grad.float().square().sum() * weight
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)
        return total.sqrt()

    @torch.no_grad()
    def clip(self, max_norm: float | None) -> float:
        """Scale every gradient so the global norm is at most ``max_norm`` (None or <= 0: only measure); the
        norm before clipping."""
        norm = self.norm()
        if max_norm is not None and max_norm > 0:
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            grads = (self.llm.gradients() if self.llm is not None else []) + [g for g, _ in self._encoder_grads()]
            if grads:
                torch._foreach_mul_(grads, scale)
        return float(norm)


class _ClipBeforeLLMStep:
    """Wraps the LLM optimizer's step (the Trainer calls it right after its gradient reduction) so the global
    norm is measured and clipped first, when :meth:`enable` was called."""

    def _wrap_optimizer(self) -> None:
        self.max_grad_norm, self.clipper, self.grad_norm = None, None, None
        inner = self.optimizer.step

        def step(*args, **kwargs):
            if self.clipper is not None:
                self.grad_norm = self.clipper.clip(self.max_grad_norm)
            return inner(*args, **kwargs)

        self.optimizer.step = step


class _PipelinedVL:
    """The LLM as :func:`executor.pipeline.run_schedule` runs it, each chunk through
    :meth:`VisionLanguageMoE.forward_chunk`: the first chunk's micro-batch with its image tokens ``encoded``
    (by micro-batch index), the others' with their multimodal positions."""

    def __init__(self, vl: VisionLanguageMoE, micro: list[VLBatch], encoded: dict[int, tuple]):
        self._vl, self._micro, self._encoded = vl, micro, encoded

    def __getattr__(self, name: str):
        return getattr(self._vl.llm, name)

    def forward_micro_chunk(self, micro: int, chunk: int, x, labels):
        first = self._vl.llm.is_first_chunk(chunk)
        return self._vl.forward_chunk(chunk, self._micro[micro], None if first else x,
                                      self._encoded.get(micro) if first else None)


class VLTrainer(_ClipBeforeLLMStep, Trainer):
    """The LLM's Trainer (its reducer and mixed-precision Adam over ``model.llm``) plus the encoder's Adam;
    ``encoder_dp``: the group over which the encoder's gradients are summed (None: this rank alone).

    With the LLM pipelined (pp > 1, colocated encoder), the encoder runs before the LLM's schedule: micro-batch
    k is encoded on pipeline rank k mod pp of the LLM's pipeline group (its ranks hold the same samples; an
    encoder TP group lies within one stage) and its tokens sent to the first stage; after the schedule the
    first stage sends each micro-batch's token gradients back to the rank that encoded it, which
    back-propagates through the encoder."""

    def __init__(self, model: VisionLanguageMoE, encoder_dp: Group | None, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8):
        super().__init__(model.llm, lr=lr, betas=betas, eps=eps)
        if self.ep_overlap or (self.pipelined and self.model.vpp > 1):
            raise InvalidConfigError("the vision-language step runs without the EP overlap schedule and without "
                                     "virtual pipeline stages")
        self.vl, self.encoder_dp = model, encoder_dp
        self.encoder_optimizer = torch.optim.Adam(model.encoder.parameters(), lr=lr, betas=betas, eps=eps)
        self._wrap_optimizer()

    @property
    def optimizers(self) -> list:
        return [self.optimizer, self.encoder_optimizer]

    @property
    def data_dp_ranks(self) -> tuple[int, ...]:
        """The LLM data-parallel ranks whose micro-batches this rank reads (:meth:`step_data`)."""
        return (self.model.state.dp.rank,)

    def enable_clipping(self, max_grad_norm: float | None) -> None:
        """Measure the global gradient norm every step (``grad_norm``) and clip by ``max_grad_norm``."""
        state = self.model.state
        group = self.vl.encoder_group
        self.max_grad_norm = max_grad_norm
        self.clipper = VLGradClipper(GradClipper(self.model, state, self.reducer), self.vl.encoder,
                                     1 if group is None else group.size, state.config.world_size,
                                     self.model.rope_cos.device)

    def forward_backward(self, micro: list[VLBatch]) -> torch.Tensor:  # type: ignore[override]
        """Accumulate the gradients of the mean loss over this rank's micro-batches, the encoder's reduced over
        its replicas; the mean [ce, router, mtp]."""
        llm = self.model
        if self.pipelined:
            stats = self._pipelined(micro)
        else:
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
        state = llm.state
        reduce_encoder_grads(self.vl.encoder, self.encoder_dp, 1.0 / (state.dp.size * state["cp"].size))
        return stats

    def _pipelined(self, micro: list[VLBatch]) -> torch.Tensor:
        """The encoder's forward, the LLM's schedule, the encoder's backward (see the class docstring); the
        schedule's [ce, router, mtp] of this rank's chunks."""
        pp, m = self.model.state["pp"], len(micro)
        mine = [k for k in range(m) if k % pp.size == pp.rank]
        parts = self.vl.spec.vision.num_projectors
        outputs = {k: pack_tokens(*self.vl.encode(micro[k])) for k in mine}
        sends = [dist.isend(outputs[k].detach().contiguous(), pp.ranks[0]) for k in mine] if pp.rank else []
        leaves: dict[int, torch.Tensor] = {}
        if pp.rank == 0:
            for k in range(m):
                if k % pp.size == 0:
                    leaf = outputs[k].detach()
                else:
                    leaf = receive_tokens(self.vl, micro[k], pp.ranks[k % pp.size])
                leaves[k] = leaf.requires_grad_(True)
        for work in sends:
            work.wait()
        encoded = {k: unpack_tokens(leaf, parts) for k, leaf in leaves.items()}
        stats, self._counts = run_schedule(_PipelinedVL(self.vl, micro, encoded),
                                           [(b.ids, b.labels) for b in micro], self._arm_before_last_backward())
        sends = [dist.isend(leaves[k].grad.contiguous(), pp.ranks[k % pp.size])
                 for k in range(m) if k % pp.size] if pp.rank == 0 else []
        for k in mine:  # in micro-batch order on every member of an encoder TP group (its collectives)
            if pp.rank == 0:
                grad = leaves[k].grad
            else:
                grad = torch.empty_like(outputs[k])
                dist.recv(grad, pp.ranks[0])
            outputs[k].backward(grad)
        for work in sends:
            work.wait()
        return stats

    def step(self, micro: list[VLBatch]) -> StepResult:  # type: ignore[override]
        self.encoder_optimizer.zero_grad(set_to_none=False)
        result = super().step(micro)
        self.encoder_optimizer.step()
        return result

    def step_data(self, micro_by_dp: list[list[VLBatch]]) -> StepResult:
        """:meth:`step` on the micro-batches of :attr:`data_dp_ranks` (one list per rank named there)."""
        return self.step(micro_by_dp[0])


class SeparateLLMTrainer(_ClipBeforeLLMStep, Trainer):
    """An LLM rank of the separate placement: the LLM's Trainer, each micro-batch's image tokens received from
    its encoder replica and their gradients sent back as its backward produces them."""

    def __init__(self, model: VisionLanguageMoE, placement: SeparatePlacement, rank: int, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8):
        super().__init__(model.llm, lr=lr, betas=betas, eps=eps)
        if self.pipelined or self.ep_overlap:
            raise InvalidConfigError("a separate encoder's LLM runs at pp = 1 without the EP overlap "
                                     "schedule")
        self.vl, self.placement, self.rank = model, placement, rank
        self._wrap_optimizer()

    @property
    def optimizers(self) -> list:
        return [self.optimizer]

    @property
    def data_dp_ranks(self) -> tuple[int, ...]:
        return (self.model.state.dp.rank,)

    def enable_clipping(self, max_grad_norm: float | None) -> None:
        self.max_grad_norm = max_grad_norm
        self.clipper = VLGradClipper(GradClipper(self.model, self.model.state, self.reducer), None, 1, 1,
                                     self.model.rope_cos.device)

    def forward_backward(self, micro: list[VLBatch]) -> torch.Tensor:  # type: ignore[override]
        llm = self.model
        stats = torch.zeros(3, device=llm.rope_cos.device)
        counts, sends = None, []
        for i, batch in enumerate(micro):
            out, work = llm_microbatch(self.vl, self.placement, self.rank, batch, len(micro),
                                       self.reducer.arm if i == len(micro) - 1 else None)
            sends += work
            stats += out.stats() / len(micro)
            counts = llm.count_routed(counts, llm.moe_layers())
        for work in sends:
            work.wait()
        self._counts = counts
        return stats

    def step_data(self, micro_by_dp: list[list[VLBatch]]) -> StepResult:
        return self.step(micro_by_dp[0])


class SeparateEncoderTrainer:
    """An encoder rank of the separate placement: its replica encodes the images of the LLM ranks it serves
    (each LLM data-parallel rank's once, :attr:`data_dp_ranks`), takes their token gradients back, sums its
    gradients over the encoder's data-parallel group, divides them by the LLM's dp·cp (as :class:`VLTrainer`
    does, for the same reason) and steps its Adam."""

    def __init__(self, model: VisionLanguageMoE, placement: SeparatePlacement, rank: int, llm: ParallelConfig,
                 encoder_tp: Group | None, encoder_dp: Group | None, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8):
        self.vl, self.encoder, self.placement, self.rank = model, model.encoder, placement, rank
        self.encoder_tp, self.encoder_dp = encoder_tp, encoder_dp
        self.scale = 1.0 / (llm.dp * llm.cp)
        served = placement.served(placement.replica_of(rank))
        dp_of = {r: build_parallel_state(llm, r, communicators=False).dp.rank for r in served}
        self.data_dp_ranks = tuple(dict.fromkeys(dp_of[r] for r in served))
        self.owners = [[r for r in served if dp_of[r] == d] for d in self.data_dp_ranks]
        self.encoder_optimizer = torch.optim.Adam(self.encoder.parameters(), lr=lr, betas=betas, eps=eps)
        self.max_grad_norm, self.clipper, self.grad_norm = None, None, None

    @property
    def optimizers(self) -> list:
        return [self.encoder_optimizer]

    def enable_clipping(self, max_grad_norm: float | None) -> None:
        self.max_grad_norm = max_grad_norm
        p = self.placement
        self.clipper = VLGradClipper(None, self.encoder, p.enc_tp, p.enc_tp * p.enc_dp,
                                     next(self.encoder.parameters()).device)

    def _images(self, micro_by_dp: list[list[VLBatch]]) -> list[list[tuple]]:
        return [[(micro[k].patches, list(micro[k].grids)) for micro in micro_by_dp]
                for k in range(len(micro_by_dp[0]))]

    def step_data(self, micro_by_dp: list[list[VLBatch]]) -> None:
        """One step: ``micro_by_dp[i]``: the micro-batches of LLM data-parallel rank ``data_dp_ranks[i]``."""
        self.encoder_optimizer.zero_grad(set_to_none=False)
        encoder_step(self.encoder, self.placement, self.rank, self._images(micro_by_dp), self.owners)
        reduce_encoder_grads(self.encoder, self.encoder_dp, self.scale)
        if self.clipper is not None:  # joins the LLM ranks' all-reduce of the global norm
            self.grad_norm = self.clipper.clip(self.max_grad_norm)
        self.encoder_optimizer.step()

    def evaluate_data(self, micro_by_dp: list[list[VLBatch]]) -> None:
        """Encode an evaluation's micro-batches for the LLM ranks (no gradients)."""
        encoder_forward_only(self.encoder, self.placement, self.rank, self._images(micro_by_dp), self.owners)


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
