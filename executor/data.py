"""Synthetic token batches: the same global batch for every layout, sliced by DP rank into micro-batches."""

from __future__ import annotations

import torch

from executor.dataset.packing import pack_documents, split_rows
from spec.validity import batch_rule


def global_batch(vocab_size: int, seq_length: int, global_batch_size: int, seed: int, step: int) -> torch.Tensor:
    """Token ids [global_batch_size, seq_length + 1] (inputs are [:, :-1], labels [:, 1:]), CPU int64."""
    gen = torch.Generator().manual_seed(seed * 7919 + step)
    return torch.randint(0, vocab_size, (global_batch_size, seq_length + 1), generator=gen)


def packed_global_batch(vocab_size: int, seq_length: int, global_batch_size: int, seed: int, step: int,
                        max_document: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic packed rows [global_batch_size, seq_length + 1] and their boundary flags (int64): random
    documents of 2 .. ``max_document`` tokens (default: a third of a row) packed as ``data prepare --pack`` does."""
    gen = torch.Generator().manual_seed(seed * 7919 + step + 104729)
    longest = max_document or max(2, (seq_length + 1) // 3)
    rows = seq_length + 1
    take = global_batch_size * rows
    docs: list[torch.Tensor] = []
    while True:  # documents until their packing fills the batch (padding ends rows short)
        for _ in range(global_batch_size * rows // 2):
            n = int(torch.randint(2, longest + 1, (1,), generator=gen))
            docs.append(torch.randint(0, vocab_size, (n,), generator=gen))
        tokens, flags = pack_documents(docs, rows, pad_id=0)
        if tokens.numel() >= take:
            break
    return tokens[:take].view(global_batch_size, rows).long(), flags[:take].view(global_batch_size, rows).long()


def micro_batches(batch: torch.Tensor, dp_size: int, dp_rank: int, micro_batch_size: int,
                  device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This DP rank's contiguous share of ``batch`` as (ids [mbs, s], labels [mbs, s]) micro-batches.

    Raises ValueError when the batch does not split evenly: a rank left without micro-batches would
    train on nothing and report a loss of zero.
    """
    rejection = batch_rule(batch.shape[0], micro_batch_size, dp_size)
    if rejection is not None:
        raise ValueError(rejection.reason)
    per_rank = batch.shape[0] // dp_size
    mine = batch[dp_rank * per_rank:(dp_rank + 1) * per_rank].to(device)
    return [(mine[i:i + micro_batch_size, :-1], mine[i:i + micro_batch_size, 1:])
            for i in range(0, per_rank, micro_batch_size)]


def packed_micro_batches(rows: torch.Tensor, flags: torch.Tensor, micro_batch_size: int,
                         device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """This DP rank's packed rows [n, s + 1] and their boundary flags (``BatchSampler.packed_batch``) as
    (ids [mbs, s], labels [mbs, s] with IGNORE off-document, segment ids [mbs, s]) micro-batches."""
    ids, labels, segments = (t.to(device) for t in split_rows(rows, flags))
    return [(ids[i:i + micro_batch_size], labels[i:i + micro_batch_size], segments[i:i + micro_batch_size])
            for i in range(0, rows.shape[0], micro_batch_size)]
