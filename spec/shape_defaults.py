"""The training shape a run takes when the user names only its hardware: one rule for the CLI and the service.

- Precision: fp32 on CPU ranks (gloo has no fast bf16 GEMMs and the CPU demo measures fp32), bf16 on GPUs.
  ``foldtune tune``/``submit`` and ``POST /v1/jobs`` without a precision store this, and ``foldtune best`` /
  ``GET /v1/best`` look it up, so a job stored one way is found the other.
- Sequence length and global batch: :data:`CPU_SEQ` tokens and :data:`CPU_GBS` sequences per optimizer step
  on CPU ranks; on GPUs there is no default (a GPU job's shape is the user's decision).

``gpu`` is a GPU kind (``HardwareProfile.gpu.name``, e.g. ``cpu``, ``H200``) or a catalog hardware name
(``cpu``, ``h200``); both spell CPU ranks ``cpu``.
"""

from __future__ import annotations

CPU_SEQ, CPU_GBS = 64, 8


def is_cpu(gpu: str) -> bool:
    """Whether ``gpu`` names CPU ranks (gloo) rather than a GPU."""
    return gpu.strip().lower() == "cpu"


def default_precision(gpu: str) -> str:
    """The precision a run on ``gpu`` uses unless told: fp32 on CPU ranks, bf16 on GPUs."""
    return "fp32" if is_cpu(gpu) else "bf16"


def default_seq_gbs(gpu: str) -> tuple[int | None, int | None]:
    """(sequence length in tokens, global batch in sequences) a run on ``gpu`` uses unless told; None: no
    default, the user gives it."""
    return (CPU_SEQ, CPU_GBS) if is_cpu(gpu) else (None, None)
