"""Packed sequences' attention work from their documents' lengths (pure Python).

A training on packed sequences (``foldtune data prepare --pack``) attends within documents only, so a causal
kernel that skips the blocks between documents does, per sequence, ``Σ_docs len²/2`` query-key pairs instead of
``seq²/2``. Packing cuts a document longer than the sequence into pieces of ``seq`` tokens (and a remainder),
each attended alone. Over a sample of document lengths (any number of sequences' worth) the share of a full
causal sequence's work is therefore::

    share = Σ_pieces len² / (Σ_pieces len · seq)

(per token: a token of a piece of ``len`` tokens meets ``len/2`` keys on average, where one of a whole sequence
meets ``seq/2``). 1 when every piece fills a sequence; for one document of ``seq/2`` per half sequence, 1/2.

Under context parallelism the executor's ring and all-gather types cut each sequence into ``2·cp`` chunks and skip
a chunk pair (a query chunk against a key chunk no later) only when no document spans both; a pair they compute
they compute whole. :func:`chunk_pair_share` is that work as a share of the unpacked sequence's ``chunks²/2``
chunk pairs: the sample's pieces laid into sequences as packing lays them (a piece that does not fit the rest of
a sequence starts the next; the rest is padding, which no document spans). It equals :func:`attention_share`
when documents start and end on chunk boundaries, and is larger otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

#: most document lengths a TrainingSpec carries (a sample of a dataset's)
MAX_DOCUMENT_SAMPLE = 4096
#: tokens of one document in that sample (packing cuts a longer one into sequences; a billion is past any corpus's)
MAX_DOCUMENT_LENGTH = 1 << 30


def attention_share(lengths: Sequence[int], seq_length: int) -> float:
    """The causal attention work of packed sequences of ``seq_length`` tokens made of documents of ``lengths``
    tokens, as a share (0, 1] of unpacked sequences' (module docstring); 1.0 for no lengths."""
    squares = total = 0
    for n in lengths:
        whole, rest = divmod(int(n), seq_length)  # the pieces packing cuts a long document into
        squares += whole * seq_length ** 2 + rest ** 2
        total += n
    return squares / (total * seq_length) if total else 1.0


def _pieces(lengths: Sequence[int], seq_length: int):
    for n in lengths:
        whole, rest = divmod(int(n), seq_length)
        yield from [seq_length] * whole
        if rest:
            yield rest


def chunk_pair_share(lengths: Sequence[int], seq_length: int, chunks: int) -> float:
    """The causal attention work the CP split into ``chunks`` chunks a sequence computes, as a share (0, 1] of
    unpacked sequences' (module docstring): per sequence, 1/2 for each chunk a document touches (its diagonal
    pair) and 1 for each earlier chunk a document touching it also touches, over ``chunks²/2``; 1.0 for no
    lengths."""
    c = seq_length / chunks
    sequences: list[list[tuple[int, int]]] = [[]]  # each sequence's documents as (start, end) token offsets
    used = 0
    for piece in _pieces(lengths, seq_length):
        if used + piece > seq_length:
            sequences.append([])
            used = 0
        sequences[-1].append((used, used + piece))
        used += piece
    computed = 0.0
    for documents in sequences:
        pairs: set[tuple[int, int]] = set()
        for start, end in documents:
            first, last = int(start // c), int((end - 1) // c)  # the chunks the document touches
            pairs.update((i, j) for i in range(first, last + 1) for j in range(first, i + 1))
        computed += sum(0.5 if i == j else 1.0 for i, j in pairs)
    filled = [d for d in sequences if d]
    return computed / (len(filled) * chunks * chunks / 2) if filled else 1.0


def length_problems(lengths: Sequence[int]) -> list[str]:
    """What is wrong with a document length sample (empty list when fine)."""
    if not lengths:
        return ["document_lengths must hold at least one length"]
    bad = [n for n in lengths if isinstance(n, bool) or not isinstance(n, int) or n < 1]
    return [f"document_lengths must be positive integers (tokens), got {bad[:3]}"] if bad else []
