"""Will a training's checkpoints fit? The free-space preflight every front end runs before step 1.

The need is the predicted size of one checkpoint (:func:`costmodel.checkpoint_size.checkpoint_bytes`) times
the most checkpoints on disk at once: every one the run saves, or with ``keep_last`` N at most N + 1 (older
ones are deleted only once a new one is complete). It is compared with the free bytes of the filesystem that
will hold the checkpoint directory (its nearest existing ancestor, as the directory may not exist yet), plus
the bytes of the checkpoints already in that directory: a resumed run counts its saves from step 0, and the
ones it already saved are among them (kept, or deleted by ``keep_last`` as new ones complete).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from costmodel.checkpoint_size import checkpoint_bytes
from executor.train.checkpoint_names import list_checkpoints
from spec.model_spec import ModelSpec
from spec.multimodal import VisionLanguageSpec


def free_bytes(path: str | Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of ``path`` (or of its nearest existing
    ancestor when ``path`` does not exist yet)."""
    existing = Path(path).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return shutil.disk_usage(existing).free


def checkpoints_saved(steps: int, checkpoint_every: int) -> int:
    """Checkpoints a run of ``steps`` optimizer steps saves: every ``checkpoint_every`` steps and at the end
    (``checkpoint_every`` 0: at the end only)."""
    if checkpoint_every <= 0:
        return 1
    return steps // checkpoint_every + (1 if steps % checkpoint_every else 0)


def checkpoints_at_once(steps: int, checkpoint_every: int, keep_last: int) -> int:
    """The most checkpoints on disk at once: all saved, or with ``keep_last`` N (> 0) the N kept and the one
    being written."""
    saved = checkpoints_saved(steps, checkpoint_every)
    return saved if keep_last <= 0 else min(saved, keep_last + 1)


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


@dataclass(frozen=True)
class CheckpointSpace:
    """Bytes per checkpoint (predicted), checkpoints on disk at once, free bytes where they go and the bytes
    of the checkpoints already there."""

    per_checkpoint: int
    at_once: int
    free: int
    existing: int
    directory: str
    keep_last: int

    @property
    def needed(self) -> int:
        return self.per_checkpoint * self.at_once

    def problem(self) -> str | None:
        """Why the checkpoints cannot fit, with the numbers; None when they fit."""
        if self.needed <= self.free + self.existing:
            return None
        held = (f"{self.at_once} on disk at once (keep_last {self.keep_last} and the one being written)"
                if self.keep_last > 0 and self.at_once == self.keep_last + 1 else f"{self.at_once} saved")
        hint = ("; keep fewer (keep_last), checkpoint less often, or free space" if self.at_once > 1
                else "; free space or choose a checkpoint directory on a larger filesystem")
        return (f"the checkpoints do not fit: {self.per_checkpoint:,} bytes ({_gb(self.per_checkpoint)}, 12 bytes "
                f"per parameter) per checkpoint x {held} = {self.needed:,} bytes ({_gb(self.needed)}), but the "
                f"filesystem of {self.directory} has {self.free:,} bytes ({_gb(self.free)}) free"
                + (f" and its checkpoints {self.existing:,} bytes" if self.existing else "") + hint)


def checkpoint_space(model: ModelSpec | VisionLanguageSpec, steps: int, checkpoint_every: int, keep_last: int,
                     checkpoint_dir: str | Path) -> CheckpointSpace:
    """The preflight's numbers for a training of ``model`` writing into ``checkpoint_dir``."""
    existing = sum(e.bytes for e in list_checkpoints(checkpoint_dir, limit=1 << 62))
    return CheckpointSpace(checkpoint_bytes(model), checkpoints_at_once(steps, checkpoint_every, keep_last),
                           free_bytes(checkpoint_dir), existing, str(checkpoint_dir), keep_last)


def checkpoint_space_problem(model: ModelSpec | VisionLanguageSpec, steps: int, checkpoint_every: int | None,
                             keep_last: int | None, checkpoint_dir: str | Path | None) -> str | None:
    """Why the training's checkpoints cannot fit in ``checkpoint_dir`` (with the sizes), or None when they fit
    or nothing is saved (no checkpoint directory)."""
    if not checkpoint_dir:
        return None
    return checkpoint_space(model, steps, checkpoint_every or 0, keep_last or 0, checkpoint_dir).problem()
