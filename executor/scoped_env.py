"""Environment variables set for one block of code and restored after it (a trial's FOLDTUNE_FAULT in a kept
rank, a benchmark's A/B switches): variables the block set are removed again, ones it changed get their value
back, whatever the block raised."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


@contextlib.contextmanager
def scoped_env(values: Mapping[str, str]) -> Iterator[None]:
    """Inside: ``os.environ`` updated with ``values``; after: each of those names as it was before."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
