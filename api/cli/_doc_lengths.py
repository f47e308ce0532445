"""``--doc-lengths``: the document lengths a plan prices packed sequences' attention by
(``TrainingSpec.document_lengths``, :mod:`spec.documents`), from a file of lengths or a packed dataset.

A file holds token counts as a JSON list or separated by whitespace or commas. A directory is a dataset written
by ``foldtune data prepare --pack``: its training split's boundary flags (one byte per token; a segment starts
at a byte with bit 0 set, padding has bit 1) give every document piece's length, read without torch; at most
``spec.documents.MAX_DOCUMENT_SAMPLE`` of them are kept, evenly spaced over the split.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from spec.documents import MAX_DOCUMENT_SAMPLE, length_problems
from spec.errors import SpecError

_SEGMENT_START = re.compile(rb"[\x01\x03]")  # START, or START | PAD (executor.dataset.packing)
_PAD = 2


def _from_dataset(root: Path) -> list[int]:
    try:
        index = json.loads((root / "index.json").read_text())
        shards = index["flags"]["train"] if index.get("format") == 2 else None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SpecError(f"--doc-lengths {str(root)!r}: not a readable prepared dataset ({exc})") from None
    if shards is None:
        raise SpecError(f"--doc-lengths {str(root)!r}: the dataset is not packed (prepare it with "
                        f"`foldtune data prepare --pack --seq N`, or give a file of document lengths)")
    flags = b"".join((root / shard["file"]).read_bytes() for shard in shards)
    starts = [m.start() for m in _SEGMENT_START.finditer(flags)] + [len(flags)]
    return [end - begin for begin, end in zip(starts, starts[1:]) if not flags[begin] & _PAD]


def _from_file(path: Path) -> list[int]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"--doc-lengths {str(path)!r}: cannot read it ({exc})") from None
    try:
        values = json.loads(text) if text.lstrip().startswith("[") else [int(v) for v in re.split(r"[\s,]+", text)
                                                                          if v]
    except ValueError:
        raise SpecError(f"--doc-lengths {str(path)!r}: expected document lengths in tokens (a JSON list, or "
                        f"integers separated by spaces, commas or lines)") from None
    if not isinstance(values, list):
        raise SpecError(f"--doc-lengths {str(path)!r}: expected a JSON list of lengths")
    return values


def load_document_lengths(source: str) -> tuple[int, ...]:
    """The document lengths of ``source`` (a file or a packed dataset directory), at most
    MAX_DOCUMENT_SAMPLE evenly spaced; SpecError naming what is wrong."""
    path = Path(source)
    if not path.exists():
        raise SpecError(f"--doc-lengths {source!r}: no such file or directory")
    lengths = _from_dataset(path) if path.is_dir() else _from_file(path)
    problems = length_problems(lengths)
    if problems:
        raise SpecError(f"--doc-lengths {source!r}: {'; '.join(problems)}")
    if len(lengths) > MAX_DOCUMENT_SAMPLE:
        step = len(lengths) / MAX_DOCUMENT_SAMPLE
        lengths = [lengths[int(i * step)] for i in range(MAX_DOCUMENT_SAMPLE)]
    return tuple(lengths)
