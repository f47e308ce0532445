"""``--gpu``, ``--seq``, ``--gbs`` and ``--precision``: one meaning and one default rule in every command.

- ``--gpu NAME`` is the catalog hardware (or a profile's GPU) the layout runs on or is priced for; ``cpu``
  means CPU ranks with gloo. Commands that run ranks on this machine (``tune``, ``profile``, ``calibrate``)
  default to the detected device (``cpu`` without CUDA, else the catalog GPU its name matches); commands
  that only price or look up a cluster (``plan``, ``submit``, ``best``) refuse to guess and say so.
- ``--seq`` (tokens per sequence) and ``--gbs`` (sequences per optimizer step) default to the CPU scale,
  :data:`CPU_SEQ` and :data:`CPU_GBS`, with ``--gpu cpu``; on GPUs there is no default: the command says
  which flag to give.
- ``--precision`` defaults to fp32 with ``--gpu cpu`` and bf16 on GPUs (what ``tune`` measures and so what
  ``best`` must look up). The rule itself is :mod:`spec.shape_defaults`, which the HTTP service applies too
  (``POST /v1/jobs`` and ``GET /v1/best`` without a precision).
- Commands that run ranks here (``profile``, ``train``) and take no ``--gpu`` use CUDA when there are GPUs
  enough for the layout, else CPU ranks (:func:`local_gpu`).

Every flag defaults to "not given" in the parser (``None``); :func:`resolve_shape` applies the rule, so a
command can also take the values from elsewhere (``train --job``) and tell the user's choice from a default.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from api.cli.arguments import GPU_NAMES, add
from spec.errors import SpecError
from spec.shape_defaults import CPU_GBS, CPU_SEQ, default_precision, default_seq_gbs, is_cpu
from spec.training_spec import PRECISIONS

__all__ = ["CPU_GBS", "CPU_SEQ", "PRECISIONS", "Shape", "add_gpu_argument", "check_profile_agrees", "add_shape_arguments", "default_precision",
           "detected_gpu", "guess_gpu", "is_cpu", "local_gpu", "local_gpus", "require_gpu", "resolve_shape"]

SHAPE_NOTE = f"default: {CPU_SEQ} with --gpu cpu; on GPUs give it"
PRECISION_NOTE = "default: fp32 with --gpu cpu, bf16 on GPUs"


def add_gpu_argument(parser, *, local: bool) -> None:
    """``--gpu``; ``local`` commands run ranks here and default to the detected device."""
    add(parser, "--gpu", "default: the detected device, cpu without CUDA" if local else "none: give it")


def add_shape_arguments(parser, *, seq: bool = True, gbs: bool = True, note: str | None = None) -> None:
    """``--seq``, ``--gbs`` and ``--precision`` (the rule is in :func:`resolve_shape`); ``note`` replaces the
    default rule's note of --seq and --gbs (``trainings submit --job`` takes the job's)."""
    if seq:
        add(parser, "--seq", note or SHAPE_NOTE)
    if gbs:
        add(parser, "--gbs", note or f"default: {CPU_GBS} with --gpu cpu; on GPUs give it")
    add(parser, "--precision", PRECISION_NOTE)


@dataclass(frozen=True)
class Shape:
    seq: int
    gbs: int
    precision: str


def resolve_shape(args: argparse.Namespace, gpu: str, command: str) -> Shape:
    """``args.seq``, ``args.gbs`` and ``args.precision`` with the shared defaults for ``gpu``; on GPUs a missing
    ``--seq``/``--gbs`` is one SpecError naming the flags to give."""
    seq, gbs = getattr(args, "seq", None), getattr(args, "gbs", None)
    default_seq, default_gbs = default_seq_gbs(gpu)
    seq = default_seq if seq is None else seq
    gbs = default_gbs if gbs is None else gbs
    missing = [flag for flag, value in (("--seq N (tokens)", seq), ("--gbs N (sequences per step)", gbs))
               if value is None]
    if missing:
        raise SpecError(f"foldtune {command} on --gpu {gpu} does not guess the training shape: give "
                        + " and ".join(missing) + f" (only --gpu cpu defaults to --seq {CPU_SEQ} --gbs {CPU_GBS})")
    return Shape(seq, gbs, getattr(args, "precision", None) or default_precision(gpu))


def require_gpu(args: argparse.Namespace, command: str, alternative: str = "") -> str:
    """``args.gpu``, or one SpecError saying to give it (commands that price a cluster never guess one)."""
    if not args.gpu:
        raise SpecError(f"foldtune {command} prices a cluster and does not guess its hardware: give --gpu NAME "
                        f"({GPU_NAMES}, or cpu){alternative}")
    return args.gpu


def check_profile_agrees(gpu: str | None, profile_gpu: str, path: str) -> None:
    """``--profile FILE`` names the hardware; a ``--gpu`` beside it must name the same GPU kind (SpecError)."""
    if gpu is None:
        return
    from spec.catalog import get_hardware

    if get_hardware(gpu).gpu.name.lower() != profile_gpu.lower():
        raise SpecError(f"--gpu {gpu} disagrees with --profile {path}, a profile of {profile_gpu}: give one of the "
                        f"two (the profile's GPU kind is the hardware)")


def local_gpus(gpu: str) -> int:
    """The ``--gpus`` of a command that runs ranks here when not given: 4 CPU ranks with ``--gpu cpu``, else
    every local GPU."""
    if is_cpu(gpu):
        return 4
    import torch  # only the commands that run ranks here ask

    return torch.cuda.device_count()


def detected_gpu() -> str:
    """This machine's catalog hardware: ``cpu`` without CUDA, else the catalog GPU the device's name matches."""
    import torch  # only the commands that run ranks here ask

    if not torch.cuda.is_available():
        return "cpu"
    return guess_gpu(torch.cuda.get_device_name(0))


def local_gpu(world_size: int) -> str:
    """The hardware a layout of ``world_size`` ranks runs on here when ``--gpu`` is not given: this machine's
    GPU when it has ``world_size`` of them, else ``cpu`` (CPU ranks)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return guess_gpu(torch.cuda.get_device_name(0))
    return "cpu"


LOCAL_GPU_NOTE = "default: this machine's GPU when it has one per rank, else cpu"


def guess_gpu(device_name: str) -> str:
    lowered = device_name.lower()
    for key in ("h200", "h100", "a100", "b200"):
        if key in lowered:
            return key
    raise SpecError(f"no catalog profile matches the device {device_name!r}; name one with --gpu")
