"""The closest known name to a misspelled one (model, GPU, catalog field), for error messages."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'X'?)`` for the known name closest to ``name`` (difflib ratio >= 0.6), else ''."""
    by_lower = {k.lower(): k for k in known}
    match = difflib.get_close_matches(str(name).lower(), list(by_lower), n=1)
    return f" (did you mean {by_lower[match[0]]!r}?)" if match else ""


def unknown_fields(kind: str, unknown: Iterable[str], known: Iterable[str]) -> str:
    """``unknown KIND field(s): a (did you mean 'b'?), c`` for a message listing unknown fields."""
    known = list(known)
    return f"unknown {kind} field(s): " + ", ".join(f"{u}{did_you_mean(u, known)}" for u in unknown)
