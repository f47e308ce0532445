"""Checkpoint retention: keep the newest N complete checkpoints of a run's directory.

Older ones are deleted only after the new checkpoint is complete and ``latest`` names it, so a crash while
saving always leaves a checkpoint to resume from; the peak on disk is therefore N + 1 checkpoints (the N
kept and the one being written)."""

from __future__ import annotations

import shutil
from pathlib import Path

from executor.train.checkpoint_names import list_checkpoints


def prune_checkpoints(directory: str | Path, keep_last: int) -> list[str]:
    """Keep the newest ``keep_last`` complete checkpoints at or before the one ``latest`` names and delete the
    other step directories up to it (incomplete leftovers of a crashed save too); any after it are left alone. ``keep_last`` 0 keeps all.
    Returns the names deleted."""
    if keep_last < 1:
        return []
    entries = list_checkpoints(directory, limit=1 << 62)
    latest = next((e for e in entries if e.latest), None)
    if latest is None:  # nothing complete to fall back on: delete nothing
        return []
    older = [e for e in entries if e.step <= latest.step]
    kept = {e.name for e in [e for e in older if e.complete][-keep_last:]}
    doomed = [e.name for e in older if e.name not in kept]
    for name in doomed:
        shutil.rmtree(Path(directory) / name)
    return doomed
