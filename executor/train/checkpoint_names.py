"""How checkpoints are named on disk, without torch: the API lists a training's checkpoints with it and
:mod:`executor.train.checkpoint` writes them with it (one codec for the directory layout).

``<dir>/step-00000020/`` holds one checkpoint taken after 20 optimizer steps (``trainer.pt`` is written last,
so a directory without it is incomplete); ``<dir>/latest`` names the last complete one."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

LATEST = "latest"
TRAINER_FILE = "trainer.pt"
_STEP_DIR = re.compile(r"step-(\d{8})")


def step_dir_name(next_step: int) -> str:
    """The directory name of the checkpoint taken after ``next_step`` optimizer steps."""
    return f"step-{next_step:08d}"


@dataclass(frozen=True)
class CheckpointEntry:
    """One checkpoint directory: ``step`` optimizer steps done; ``complete``: its trainer state was written;
    ``latest``: the one a resume would load; ``bytes``: the files' total size."""

    step: int
    name: str
    complete: bool
    latest: bool
    bytes: int


def list_checkpoints(directory: str | Path, limit: int = 1000) -> list[CheckpointEntry]:
    """The checkpoints under ``directory`` in step order (at most the last ``limit``); [] when it does not
    exist. Reads directory entries and file sizes only, never the tensors."""
    root = Path(directory)
    if not root.is_dir():
        return []
    marker = root / LATEST
    latest = marker.read_text().strip() if marker.is_file() else None
    found = sorted((int(m.group(1)), entry) for entry in root.iterdir()
                   if entry.is_dir() and not entry.is_symlink() and (m := _STEP_DIR.fullmatch(entry.name)))
    out = []
    for step, entry in found[-limit:]:
        size = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file() and not f.is_symlink())
        out.append(CheckpointEntry(step, entry.name, (entry / TRAINER_FILE).is_file(), entry.name == latest, size))
    return out
