"""Open a prepared dataset and cut deterministic, resumable global batches split across DP ranks.

A split's token stream is cut into ``(tokens - 1) // seq_length`` non-overlapping windows of
``seq_length + 1`` tokens (inputs ``[:-1]``, labels ``[1:]``). The k-th window a run draws is window
``perm(epoch)[k % n]`` with ``epoch = k // n`` and ``perm`` a permutation seeded by (seed, epoch). Global
batch ``p`` holds draws ``[p·G, (p+1)·G)``; DP rank ``r`` of ``d`` gets rows ``[r·G/d, (r+1)·G/d)`` of it —
the contiguous split of :func:`executor.data.micro_batches`. The only state is ``p``, so a run resumed at
``p`` under any DP size sees the same batches as one that never stopped.

A packed dataset (``data prepare --pack``, format 2) is already cut into rows of ``seq_length + 1``: its windows
are those rows (no overlap of one token), it serves only the seq_length it was packed for, and
:meth:`BatchSampler.packed_batch` returns each row's boundary flags beside its tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from executor.dataset.prepare import FORMAT, INDEX, PACKED_FORMAT, DatasetError
from spec.validity import batch_rule

_DTYPES = {"uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32, "uint16": torch.uint16,
           "uint32": torch.uint32}
SPLITS = ("train", "heldout")


class TokenStream:
    """One split's token shards, memory-mapped (pages are read on first access), as one logical stream."""

    def __init__(self, root: Path, shards: list[dict], dtype: torch.dtype):
        self.shards: list[torch.Tensor] = []
        self.starts: list[int] = []
        total = 0
        for shard in shards:
            path = root / shard["file"]
            count = int(shard["tokens"])
            if not path.is_file() or path.stat().st_size != count * dtype.itemsize:
                raise DatasetError(f"shard {str(path)!r} is missing or does not hold {count} tokens")
            self.starts.append(total)
            self.shards.append(torch.from_file(str(path), shared=False, size=count, dtype=dtype))
            total += count
        self.tokens = total
        self.flags: TokenStream | None = None  # a packed split's boundary flags (executor.dataset.packing)
        self.row_tokens: int | None = None  # a packed split's row length (its seq_length + 1)

    def read(self, start: int, length: int) -> torch.Tensor:
        """Tokens ``[start, start + length)`` as int64, crossing shard boundaries."""
        if start < 0 or start + length > self.tokens:
            raise DatasetError(f"read of tokens [{start}, {start + length}) outside a stream of {self.tokens}")
        parts, pos, end = [], start, start + length
        for shard_start, shard in zip(self.starts, self.shards):
            shard_end = shard_start + shard.numel()
            if shard_end <= pos or shard_start >= end:
                continue
            lo, hi = pos - shard_start, min(end, shard_end) - shard_start
            parts.append(shard[lo:hi])
            pos = shard_start + hi
        return torch.cat(parts).long()


class TokenDataset:
    """A directory written by ``foldtune data prepare``: ``vocab_size``, ``tokenizer`` and one stream per split."""

    def __init__(self, path: str | Path):
        root = Path(path)
        index_path = root / INDEX
        if not index_path.is_file():
            raise DatasetError(f"{str(root)!r} is not a prepared dataset (no {INDEX}); run `foldtune data prepare`")
        try:
            index = json.loads(index_path.read_text())
            if index.get("format") not in (FORMAT, PACKED_FORMAT):
                raise DatasetError(f"{index_path}: format {index.get('format')!r}, expected {FORMAT} or "
                                   f"{PACKED_FORMAT} (packed)")
            dtype = _DTYPES[index["dtype"]]
            self.vocab_size = int(index["vocab_size"])
            self.tokenizer = str(index["tokenizer"])
            self.splits = {name: TokenStream(root, index["splits"][name], dtype) for name in SPLITS}
            # packed (format 2): rows of packed_seq_length + 1 tokens and one flag byte per token
            self.packed_seq_length: int | None = None
            if index["format"] == PACKED_FORMAT:
                self.packed_seq_length = int(index["packed"]["seq_length"])
                for name in SPLITS:
                    flags = TokenStream(root, index["flags"][name], torch.uint8)
                    if flags.tokens != self.splits[name].tokens:
                        raise DatasetError(f"{index_path}: split {name!r} has {self.splits[name].tokens} tokens "
                                           f"but {flags.tokens} boundary flags")
                    self.splits[name].flags = flags
                    self.splits[name].row_tokens = self.packed_seq_length + 1
        except (KeyError, TypeError, ValueError) as exc:
            raise DatasetError(f"{index_path} is malformed: {exc!r}") from exc
        self.path = str(root)


class BatchSampler:
    """Global batches of ``global_batch_size`` windows of ``seq_length + 1`` tokens from one stream."""

    def __init__(self, stream: TokenStream, seq_length: int, global_batch_size: int, seed: int = 0,
                 shuffle: bool = True):
        if seq_length < 1 or global_batch_size < 1:
            raise DatasetError(f"seq_length ({seq_length}) and global_batch_size ({global_batch_size}) must be >= 1")
        self.stream, self.seq_length, self.global_batch_size = stream, seq_length, global_batch_size
        self.seed, self.shuffle = seed, shuffle
        self.packed = stream.flags is not None
        # packed: windows are the rows (seq_length + 1 tokens, none shared); else overlapping by one token
        self.stride = seq_length + 1 if self.packed else seq_length
        if self.packed and stream.row_tokens != self.stride:
            raise DatasetError(f"the dataset is packed for seq_length {stream.row_tokens - 1}, not {seq_length}: "
                               f"prepare it again with `foldtune data prepare --pack --seq {seq_length}`")
        self.num_windows = stream.tokens // self.stride if self.packed else (stream.tokens - 1) // self.stride
        if self.num_windows < 1:
            raise DatasetError(f"a split of {stream.tokens} tokens holds no window of seq_length {seq_length} + 1")
        self._perm: tuple[int, torch.Tensor] | None = None

    def _window(self, draw: int) -> int:
        epoch, i = divmod(draw, self.num_windows)
        if not self.shuffle:
            return i
        if self._perm is None or self._perm[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(self.num_windows, generator=gen))
        return int(self._perm[1][i])

    def _draws(self, position: int, dp_size: int, dp_rank: int) -> range:
        rejection = batch_rule(self.global_batch_size, 1, dp_size)  # whole sequences per DP rank
        if rejection is not None:
            raise DatasetError(rejection.reason)
        per_rank = self.global_batch_size // dp_size
        first = position * self.global_batch_size + dp_rank * per_rank
        return range(first, first + per_rank)

    def batch(self, position: int, dp_size: int = 1, dp_rank: int = 0) -> torch.Tensor:
        """Rows of global batch ``position`` for DP rank ``dp_rank`` of ``dp_size``: int64 [G/dp, seq_length+1]."""
        return torch.stack([self.stream.read(self._window(d) * self.stride, self.seq_length + 1)
                            for d in self._draws(position, dp_size, dp_rank)])

    def packed_batch(self, position: int, dp_size: int = 1, dp_rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`batch`'s rows of a packed split and their boundary flags (int64, both [G/dp, seq_length+1])."""
        if self.stream.flags is None:
            raise DatasetError("the dataset is not packed (prepare it with `foldtune data prepare --pack`)")
        starts = [self._window(d) * self.stride for d in self._draws(position, dp_size, dp_rank)]
        return (torch.stack([self.stream.read(s, self.seq_length + 1) for s in starts]),
                torch.stack([self.stream.flags.read(s, self.seq_length + 1) for s in starts]))

    def batches_per_epoch(self) -> int:
        """Whole global batches in one pass over the stream (at least the number evaluation may use)."""
        return self.num_windows // self.global_batch_size
