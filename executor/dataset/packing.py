"""Packed sequences: documents laid end to end in rows of ``seq_length + 1`` tokens, with their boundaries.

A packed split is a stream of rows, each ``seq_length + 1`` tokens (inputs ``[:-1]``, labels ``[1:]``), and a
parallel stream of one flag byte per token (uint8):

- :data:`START` (bit 0): the token begins a segment: a document, a piece of a document longer than a row, or
  the row's padding;
- :data:`PAD` (bit 1): the token is padding (it fills the row after its last document).

Packing is greedy and in order: a document goes into the current row if it fits, else the row is padded and the
document starts the next one; a document longer than a row is cut into pieces of a row each (every piece its
own segment) and its last piece packs like a short document. Nothing of a document is dropped.

From a row's flags the executor takes, for its inputs ``[:-1]``: the segment ids (:func:`split_rows`, a token
attends only to earlier tokens of its own segment; documents count from 1, padding is :data:`PADDING`), the
positions within the segment (RoPE restarts per
document) and the labels, set to :data:`IGNORE` where the next token starts another segment or is padding: the
loss is over real tokens of the same document only.
"""

from __future__ import annotations

import torch

START = 1
PAD = 2
#: the label of a token that has no target in its own document (padding, a document's last token)
IGNORE = -100
#: the segment id of padding (documents count from 1): routing statistics leave these tokens out
PADDING = 0


def pack_documents(documents: list[torch.Tensor], row_tokens: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, flags) streams of ``documents`` (1-D id tensors, one dtype) packed into rows of ``row_tokens``
    tokens (the training ``seq_length + 1``); both of a whole number of rows, flags uint8. ``pad_id`` fills
    the rows' ends (its value never reaches a loss)."""
    if row_tokens < 2:
        raise ValueError(f"a packed row needs at least 2 tokens, got {row_tokens}")
    dtype = documents[0].dtype if documents else torch.uint8
    tokens: list[torch.Tensor] = []
    flags: list[torch.Tensor] = []
    used = 0  # tokens in the current row

    def put(piece: torch.Tensor, flag: int) -> None:
        nonlocal used
        f = torch.zeros(piece.numel(), dtype=torch.uint8)
        f[:] = flag & PAD
        f[0] |= START
        tokens.append(piece.to(dtype))
        flags.append(f)
        used = (used + piece.numel()) % row_tokens

    def pad_row() -> None:
        if used:
            put(torch.full((row_tokens - used,), pad_id, dtype=dtype), PAD)

    for doc in documents:
        start = 0
        while doc.numel() - start > row_tokens - used:
            if used:  # the rest does not fit the row: pad it, the rest starts the next row
                pad_row()
                continue
            put(doc[start:start + row_tokens], 0)  # a whole row of this document
            start += row_tokens
        if start < doc.numel():
            put(doc[start:], 0)
    pad_row()
    if not tokens:
        return torch.empty(0, dtype=dtype), torch.empty(0, dtype=torch.uint8)
    return torch.cat(tokens), torch.cat(flags)


def split_rows(rows_BS: torch.Tensor, flags_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed rows [b, s + 1] and their flags → (input ids [b, s], labels [b, s] with :data:`IGNORE` where the
    target is not in the token's own document, segment ids [b, s] int64: tokens attend within equal ids;
    :data:`PADDING` for padding, which only ends a row, so it is one segment of its own there too)."""
    flags = flags_BS.long()
    ids, labels = rows_BS[:, :-1], rows_BS[:, 1:].clone()
    no_target = ((flags[:, 1:] & START) != 0) | ((flags[:, 1:] & PAD) != 0)
    labels[no_target] = IGNORE
    segments = torch.cumsum((flags[:, :-1] & START) != 0, dim=1)
    segments = torch.where((flags[:, :-1] & PAD) != 0, PADDING, segments)
    return ids, labels, segments


def segment_positions(segments_BS: torch.Tensor) -> torch.Tensor:
    """Each token's position within its segment [b, s] (int64), from segment ids that are non-decreasing along a
    row: RoPE's position, restarting at every document."""
    b, s = segments_BS.shape
    index = torch.arange(s, device=segments_BS.device).expand(b, s)
    starts = torch.ones_like(segments_BS, dtype=torch.bool)
    starts[:, 1:] = segments_BS[:, 1:] != segments_BS[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index))
    return index - torch.cummax(first, dim=1).values


def document_lengths(flags: torch.Tensor) -> list[int]:
    """Lengths of the real (non-padding) segments of a flags stream, in order: the attention the rows cost."""
    f = flags.long()
    starts = torch.nonzero((f & START) != 0).flatten().tolist() + [f.numel()]
    return [end - begin for begin, end in zip(starts, starts[1:]) if not int(f[begin]) & PAD]
