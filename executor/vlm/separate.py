"""The non-colocated (separate) placement: the encoder on its own ranks, after the LLM's (ranks ``llm_world``
... ``world - 1``), pipelined ahead of the LLM.

Ranks: the LLM's layout spans ranks [0, llm_world); the encoder's ``enc_tp`` x ``enc_dp`` ranks follow, each
encoder data-parallel replica (``enc_tp`` consecutive ranks, one TP group) serving ``llm_world / enc_dp``
consecutive LLM ranks. Encoder ranks read the images of the samples their LLM ranks train.

Schedule of one step of ``m`` micro-batches: each encoder replica encodes micro-batch 0, 1, ... in turn and
sends every LLM rank it serves its samples' tokens (the projector's and the deepstack ones, one message,
from the replica's TP rank 0) without waiting; each LLM rank receives micro-batch k's tokens, runs forward and
backward, and sends their gradient to every member of its replica as soon as its backward produces it; the
replica receives the gradients of micro-batch k from all its LLM ranks and back-propagates through its encoder.
Gradients are summed over micro-batches (each LLM loss already divided by ``m``) and, after the step, over the
encoder's data-parallel replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from executor.parallel.groups import Group


@dataclass(frozen=True)
class SeparatePlacement:
    """Who serves whom: ``llm_world`` LLM ranks, then ``enc_tp`` x ``enc_dp`` encoder ranks."""

    llm_world: int
    enc_tp: int
    enc_dp: int

    def __post_init__(self) -> None:
        if self.llm_world % self.enc_dp:
            raise ValueError(f"encoder dp {self.enc_dp} must divide the LLM's {self.llm_world} ranks")

    @property
    def world_size(self) -> int:
        return self.llm_world + self.enc_tp * self.enc_dp

    def is_encoder(self, rank: int) -> bool:
        return rank >= self.llm_world

    def replica_ranks(self, replica: int) -> list[int]:
        """The encoder ranks of data-parallel replica ``replica`` (its TP group)."""
        start = self.llm_world + replica * self.enc_tp
        return list(range(start, start + self.enc_tp))

    def served(self, replica: int) -> list[int]:
        """The LLM ranks replica ``replica`` encodes for."""
        per = self.llm_world // self.enc_dp
        return list(range(replica * per, (replica + 1) * per))

    def replica_of(self, rank: int) -> int:
        """The replica of an encoder rank, or the replica serving an LLM rank."""
        if self.is_encoder(rank):
            return (rank - self.llm_world) // self.enc_tp
        return rank // (self.llm_world // self.enc_dp)


def encoder_groups(placement: SeparatePlacement, rank: int) -> tuple[Group | None, Group | None]:
    """(encoder TP group, encoder DP group) of ``rank`` (None, None on an LLM rank). Every rank of the world
    calls this, in the same order: it creates every encoder process group."""
    found: dict[str, Group] = {}
    p = placement
    layouts = {"enc_tp": [p.replica_ranks(j) for j in range(p.enc_dp)],
               "enc_dp": [[p.replica_ranks(j)[t] for j in range(p.enc_dp)] for t in range(p.enc_tp)]}
    for name, groups in layouts.items():
        for ranks in groups:
            pg = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                found[name] = Group(name, tuple(ranks), ranks.index(rank), pg)
    return found.get("enc_tp"), found.get("enc_dp")


def pack_tokens(tokens: torch.Tensor, deep: list[torch.Tensor]) -> torch.Tensor:
    """A micro-batch's image tokens and deepstack tokens as one message [tokens, (1 + deepstack) · hidden]."""
    return torch.cat([tokens, *deep], dim=1) if deep else tokens


def unpack_tokens(packed: torch.Tensor, parts: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """:func:`pack_tokens`'s inverse (views: a gradient reaching them reaches ``packed``)."""
    chunks = list(packed.chunk(parts, dim=1))
    return chunks[0], chunks[1:]



def _owner_lists(placement: SeparatePlacement, replica: int, owners: list[list[int]] | None) -> list[list[int]]:
    return [[r] for r in placement.served(replica)] if owners is None else owners


def encoder_step(encoder, placement: SeparatePlacement, rank: int, microbatches: list[list[tuple]],
                 owners: list[list[int]] | None = None) -> None:
    """An encoder rank's part of one step. ``owners``: the LLM ranks this replica serves, grouped by the samples
    they train (an LLM data-parallel rank's TP and CP peers train the same ones; None: one group per served
    rank); ``microbatches[k]``: for each group, in order, (its patches, its images' grids) of micro-batch k.
    A group's images are encoded once, its tokens sent to each of its ranks and their gradients summed (each
    rank's is the part its sequence positions produce). Leaves the gradients in ``encoder``'s parameters (not
    yet summed over replicas)."""
    replica = placement.replica_of(rank)
    groups = _owner_lists(placement, replica, owners)
    sender = placement.replica_ranks(replica)[0] == rank
    merge = encoder.vision.spatial_merge_size ** 2
    pending, outputs = [], []
    for images in microbatches:  # forward of every micro-batch, its tokens sent without waiting
        packed = _encode(encoder, images)
        outputs.append((packed, [p.shape[0] // merge for p, _ in images]))
        if sender:
            pending += _send_tokens(packed, groups, [p.shape[0] // merge for p, _ in images])
    for packed, counts in outputs:  # the gradients return in micro-batch order
        grads = []
        for ranks, n in zip(groups, counts):
            total = packed.new_zeros((n, packed.shape[1]))
            for llm_rank in ranks:
                grad = packed.new_empty((n, packed.shape[1]))
                dist.recv(grad, llm_rank)
                total += grad
            grads.append(total)
        packed.backward(torch.cat(grads))
    for work in pending:
        work.wait()


def _encode(encoder, images: list[tuple]) -> torch.Tensor:
    patches = torch.cat([p for p, _ in images])
    grids = [g for _, grid in images for g in grid]
    tokens, deep = encoder(patches, grids)
    return pack_tokens(tokens, deep)


def _send_tokens(packed: torch.Tensor, groups: list[list[int]], counts: list[int]) -> list:
    pending, start = [], 0
    for ranks, n in zip(groups, counts):
        rows = packed[start:start + n].detach().contiguous()
        pending += [dist.isend(rows, llm_rank) for llm_rank in ranks]
        start += n
    return pending


@torch.no_grad()
def encoder_forward_only(encoder, placement: SeparatePlacement, rank: int, microbatches: list[list[tuple]],
                         owners: list[list[int]] | None = None) -> None:
    """An encoder rank's part of an evaluation: every micro-batch encoded and its tokens sent, no gradients
    (arguments as :func:`encoder_step`'s)."""
    replica = placement.replica_of(rank)
    groups = _owner_lists(placement, replica, owners)
    sender = placement.replica_ranks(replica)[0] == rank
    merge = encoder.vision.spatial_merge_size ** 2
    pending = []
    for images in microbatches:
        packed = _encode(encoder, images)
        if sender:
            pending += _send_tokens(packed, groups, [p.shape[0] // merge for p, _ in images])
    for work in pending:
        work.wait()


def tokens_shape(model, batch) -> tuple[int, int]:
    """The shape of a micro-batch's packed image tokens an LLM rank receives: [image tokens, (1 + deepstack) ·
    hidden]."""
    count = int((batch.ids == model.spec.image_token_id).sum())
    return count, model.spec.llm.hidden_size * model.spec.vision.num_projectors


def receive_tokens_from(model, batch, source: int) -> torch.Tensor:
    """``batch``'s packed image tokens (this rank's share of them), received from global rank ``source``."""
    packed = torch.empty(tokens_shape(model, batch), dtype=model.llm.embedding.dtype,
                         device=model.llm.embedding.device)
    dist.recv(packed, source)
    return packed


def receive_tokens(model, placement: SeparatePlacement, rank: int, batch) -> torch.Tensor:
    """An LLM rank's packed image tokens of ``batch``, from its replica's first rank."""
    return receive_tokens_from(model, batch, placement.replica_ranks(placement.replica_of(rank))[0])


def llm_microbatch(model, placement: SeparatePlacement, rank: int, batch, microbatches: int,
                   before_backward=None) -> tuple:
    """An LLM rank's forward and backward of one micro-batch whose image tokens its replica sends; the loss is
    divided by ``microbatches`` (gradient accumulation); ``before_backward()`` runs right before the backward.
    Returns (the micro-batch's :class:`~executor.model.LossOutput`, the gradient sends to wait for)."""
    members = placement.replica_ranks(placement.replica_of(rank))
    packed = receive_tokens(model, placement, rank, batch).requires_grad_(True)
    out = model(batch, unpack_tokens(packed, model.spec.vision.num_projectors))
    if before_backward is not None:
        before_backward()
    (out.loss / microbatches).backward()
    sends = [dist.isend(packed.grad.contiguous(), member) for member in members]
    return out, sends


@torch.no_grad()
def llm_eval_microbatch(model, placement: SeparatePlacement, rank: int, batch):
    """An LLM rank's forward of an evaluation micro-batch, its image tokens from its replica."""
    packed = receive_tokens(model, placement, rank, batch)
    return model(batch, unpack_tokens(packed, model.spec.vision.num_projectors))
