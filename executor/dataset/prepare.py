"""``foldtune data prepare``: tokenize local text files into memory-mapped shards with a held-out split.

Layout of the output directory::

    index.json          {"format", "tokenizer", "vocab_size", "dtype", "documents", "splits":
                         {"train": [{"file", "tokens"}...], "heldout": [...]}}
    train-00000.bin     raw token ids (dtype of the index), shards of at most ``shard_tokens`` tokens
    heldout-00000.bin

With ``seq_length`` (``foldtune data prepare --pack --seq N``) the documents of each split are packed into rows of
``N + 1`` tokens with their boundaries (:mod:`executor.dataset.packing`): the index is then format 2 and adds
``"packed": {"seq_length": N, "pad_id"}`` and ``"flags": {"train": [...], "heldout": [...]}``, shards of one flag
byte per token (``train-flags-00000.bin``). Unpacked datasets stay format 1, which every reader still opens.

Each document (file) contributes its last ``heldout_fraction`` of tokens to the held-out split and the rest
to the training split, so the held-out text is drawn from every document rather than from the last one.

Tokenizers: the byte-level one (the default: ids are UTF-8 bytes, documents end with a blank line, uint8), or
a local Hugging Face ``tokenizer.json`` (:mod:`executor.dataset.hf_tokenizer`): every document followed by
the tokenizer's end-of-sequence id, ids stored as uint8, uint16 or uint32, whichever the vocabulary needs;
index.json then also records ``eos_id``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from spec.errors import FoldtuneError
from executor.dataset import tokenizer
from executor.dataset.packing import PAD, pack_documents
from executor.dataset.hf_tokenizer import DTYPES, HFTokenizer, token_dtype

INDEX = "index.json"
FORMAT = 1  # an unpacked dataset
PACKED_FORMAT = 2  # format 1 plus packed rows and their boundary flags
TEXT_SUFFIXES = (".txt", ".md", ".rst")


class DatasetError(FoldtuneError):
    """A dataset that cannot be prepared or opened (missing path, no text, bad index, too small)."""


@dataclass(frozen=True)
class PreparedDataset:
    """What :func:`prepare_dataset` wrote: directory, document count and tokens per split."""

    path: str
    documents: int
    train_tokens: int
    heldout_tokens: int
    seq_length: int | None = None  # packed rows hold seq_length + 1 tokens; None: unpacked
    train_padding: int = 0  # of train_tokens, those padding packed rows


def _input_files(inputs: list[str]) -> list[Path]:
    files: list[Path] = []
    missing = [p for p in inputs if not os.path.exists(p)]
    if missing:
        raise DatasetError(f"input path(s) do not exist: {', '.join(missing)}")
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES))
        else:
            files.append(path)
    return files


def _write_split(out: Path, split: str, parts: list[torch.Tensor], shard_tokens: int) -> list[dict]:
    stream = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)  # one dtype: the index's
    return _write_stream(out, split, stream, shard_tokens)


def _write_stream(out: Path, split: str, stream: torch.Tensor, shard_tokens: int) -> list[dict]:
    shards = []
    for i, start in enumerate(range(0, stream.numel(), shard_tokens)):
        chunk = stream[start:start + shard_tokens].contiguous()
        name = f"{split}-{i:05d}.bin"
        with open(out / name, "wb") as f:
            f.write(chunk.numpy().tobytes())
        shards.append({"file": name, "tokens": int(chunk.numel())})
    return shards


def prepare_dataset(inputs: list[str], output: str, heldout_fraction: float = 0.1,
                    shard_tokens: int = 1 << 26, overwrite: bool = False,
                    hf_tokenizer: HFTokenizer | None = None, seq_length: int | None = None) -> PreparedDataset:
    """Tokenize ``inputs`` (files, or directories searched for .txt/.md/.rst) into ``output``.

    ``heldout_fraction`` of every document's tokens go to the held-out split; shards hold at most
    ``shard_tokens`` tokens; ``hf_tokenizer`` replaces the byte tokenizer; ``seq_length`` packs every split into
    rows of ``seq_length + 1`` tokens with document boundaries (module docstring). Raises :class:`DatasetError` on
    missing or empty input, a bad fraction, or an
    ``output`` that already holds a dataset (unless ``overwrite``).
    """
    if not inputs:
        raise DatasetError("no input files given")
    if not 0.0 < heldout_fraction < 1.0:
        raise DatasetError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if shard_tokens < 1:
        raise DatasetError(f"shard_tokens must be >= 1, got {shard_tokens}")
    if seq_length is not None and seq_length < 1:
        raise DatasetError(f"a packed dataset needs seq_length >= 1, got {seq_length}")
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise DatasetError(f"output {output!r} exists and is not a directory")
    if (out / INDEX).exists() and not overwrite:
        raise DatasetError(f"output {output!r} already holds a dataset (pass overwrite to replace it)")
    files = _input_files(inputs)
    dtype = "uint8" if hf_tokenizer is None else token_dtype(hf_tokenizer.vocab_size)
    train, heldout = [], []
    documents = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise DatasetError(f"cannot read {str(path)!r} as UTF-8 text: {exc}") from exc
        if hf_tokenizer is None:
            ids = tokenizer.encode(text.strip() + "\n\n")
        else:  # the document, then the end-of-sequence id that separates it from the next
            ids = torch.cat([hf_tokenizer.encode(text.strip()), torch.tensor([hf_tokenizer.eos_id])])
            ids = ids.to(DTYPES[dtype][0])
        if ids.numel() <= 2:
            continue
        cut = ids.numel() - max(1, int(ids.numel() * heldout_fraction))
        train.append(ids[:cut])
        heldout.append(ids[cut:])
        documents += 1
    if not documents:
        raise DatasetError(f"no text found in {', '.join(inputs)}")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.bin"):
        old.unlink()
    index = {"format": FORMAT, "tokenizer": tokenizer.NAME, "vocab_size": tokenizer.VOCAB_SIZE, "dtype": dtype,
             "documents": documents}
    if seq_length is None:
        splits = {"train": _write_split(out, "train", train, shard_tokens),
                  "heldout": _write_split(out, "heldout", heldout, shard_tokens)}
    else:  # the byte tokenizer pads with NUL, a Hugging Face one with its end-of-sequence id
        pad_id = 0 if hf_tokenizer is None else hf_tokenizer.eos_id
        splits, flags, padding = {}, {}, 0
        for name, docs in (("train", train), ("heldout", heldout)):
            stream, marks = pack_documents(docs, seq_length + 1, pad_id)
            splits[name] = _write_stream(out, name, stream, shard_tokens)
            flags[name] = _write_stream(out, f"{name}-flags", marks, shard_tokens)
            if name == "train":
                padding = int(((marks & PAD) != 0).sum())
        index.update(format=PACKED_FORMAT, packed={"seq_length": seq_length, "pad_id": pad_id}, flags=flags)
    index["splits"] = splits
    if hf_tokenizer is not None:
        index.update(tokenizer=hf_tokenizer.name, vocab_size=hf_tokenizer.vocab_size, eos_id=hf_tokenizer.eos_id)
    (out / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    return PreparedDataset(str(out), documents, sum(s["tokens"] for s in splits["train"]),
                           sum(s["tokens"] for s in splits["heldout"]), seq_length,
                           padding if seq_length is not None else 0)
