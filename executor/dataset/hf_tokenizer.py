"""A local Hugging Face tokenizer (``tokenizer.json``, the ``tokenizers`` library) for ``foldtune data prepare``.

Nothing is downloaded: the directory (or file) a user names is read as it is. The end-of-sequence id that
separates documents comes from, in order: the caller (``--eos-id``), ``tokenizer_config.json``'s
``eos_token``, ``config.json``'s ``eos_token_id`` (a model directory), or the one of ``</s>``,
``<|endoftext|>``, ``<|end_of_text|>``, ``<eos>`` the vocabulary holds. Token ids are stored in the
narrowest unsigned dtype the vocabulary needs (:func:`token_dtype`).

``tokenizers`` is optional (the ``foldtune[hf]`` extra); the byte tokenizer needs nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from spec.errors import FoldtuneError

try:  # optional: foldtune[hf]
    from tokenizers import Tokenizer as _Tokenizer
except ImportError:  # pragma: no cover - the dev extra installs it
    _Tokenizer = None

TOKENIZER_FILE = "tokenizer.json"
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
#: dtype name -> (torch dtype, exclusive upper bound of the ids it holds)
DTYPES = {"uint8": (torch.uint8, 1 << 8), "uint16": (torch.uint16, 1 << 16), "uint32": (torch.uint32, 1 << 32)}


class TokenizerError(FoldtuneError):
    """A tokenizer that cannot be loaded, or whose end-of-sequence id cannot be found."""


def token_dtype(vocab_size: int) -> str:
    """The narrowest dtype name of :data:`DTYPES` holding ids ``0 .. vocab_size - 1``."""
    for name, (_, bound) in DTYPES.items():
        if vocab_size <= bound:
            return name
    raise TokenizerError(f"a vocabulary of {vocab_size} ids does not fit 32 bits")


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class HFTokenizer:
    """``encode(text)`` → int64 ids; ``vocab_size``, ``eos_id``, ``name`` (what index.json records)."""

    def __init__(self, path: str | Path, eos_id: int | None = None):
        if _Tokenizer is None:
            raise TokenizerError("--tokenizer needs the tokenizers package: pip install 'foldtune[hf]'")
        p = Path(path)
        file = p / TOKENIZER_FILE if p.is_dir() else p
        try:
            self._tok = _Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises its own exception type; one line for the user
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise TokenizerError(f"cannot load tokenizer {str(file)!r}: {first}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.name = f"hf:{file.parent.resolve().name if file.name == TOKENIZER_FILE else file.name}"
        self.eos_id = self._eos(file.parent, eos_id)

    def _eos(self, directory: Path, given: int | None) -> int:
        if given is not None:
            if not 0 <= given < self.vocab_size:
                raise TokenizerError(f"--eos-id {given} is outside the vocabulary (0 .. {self.vocab_size - 1})")
            return given
        token = _json(directory / "tokenizer_config.json").get("eos_token")
        if isinstance(token, dict):  # an AddedToken written out
            token = token.get("content")
        if isinstance(token, str) and self._tok.token_to_id(token) is not None:
            return self._tok.token_to_id(token)
        model_eos = _json(directory / "config.json").get("eos_token_id")
        if isinstance(model_eos, list):
            model_eos = model_eos[0] if model_eos else None
        if isinstance(model_eos, int) and 0 <= model_eos < self.vocab_size:
            return model_eos
        for candidate in EOS_CANDIDATES:
            if self._tok.token_to_id(candidate) is not None:
                return self._tok.token_to_id(candidate)
        raise TokenizerError(f"no end-of-sequence token found for {self.name} (tokenizer_config.json eos_token, "
                             f"config.json eos_token_id, or one of {', '.join(EOS_CANDIDATES)}): pass --eos-id")

    def encode(self, text: str) -> torch.Tensor:
        """Token ids of ``text`` (no special tokens added), int64."""
        return torch.tensor(self._tok.encode(text, add_special_tokens=False).ids, dtype=torch.int64)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)
