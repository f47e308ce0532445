"""Byte-level tokenizer: token id = one UTF-8 byte, vocabulary of 256, nothing to download."""

from __future__ import annotations

import torch

VOCAB_SIZE = 256
NAME = "bytes"


def encode(text: str) -> torch.Tensor:
    """Token ids (uint8 tensor, one per UTF-8 byte) of ``text``."""
    data = text.encode("utf-8")
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def decode(ids: torch.Tensor | list[int]) -> str:
    """Text of token ids; a sequence cut inside a multi-byte character decodes it as U+FFFD."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return bytes(values).decode("utf-8", errors="replace")
