"""``--gpu``, ``--seq``, ``--gbs`` and ``--precision``: one meaning and one default rule in every command.

- ``--gpu NAME`` is the catalog hardware (or a profile's GPU) the layout runs on or is priced for; ``cpu``
  means CPU ranks with gloo. Commands that run ranks on this machine (``tune``, ``profile``, ``calibrate``)
  default to the detected device (``cpu`` without CUDA, else the catalog GPU its name matches); commands
  that only price or look up a cluster (``plan``, ``submit``, ``best``) refuse to guess and say so.
- ``--seq`` (tokens per sequence) and ``--gbs`` (sequences per optimizer step) default to the CPU scale,
  :data:`CPU_SEQ` and :data:`CPU_GBS`, with ``--gpu cpu``; on GPUs there is no default: the command says
  which flag to give.
- ``--precision`` defaults to fp32 with ``--gpu cpu`` and bf16 on GPUs (what ``tune`` measures and so what
  ``best`` must look up).

Every flag defaults to "not given" in the parser (``None``); :func:`resolve_shape` applies the rule, so a
command can also take the values from elsewhere (``train --job``) and tell the user's choice from a default.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from spec.errors import SpecError

CPU_SEQ, CPU_GBS = 64, 8
PRECISIONS = ("bf16", "fp16", "fp8", "fp32")
GPU_HELP = "catalog hardware: h100-sxm, h200, b200, gb200, a100-80gb, or cpu (CPU ranks with gloo)"


def add_gpu_argument(parser: argparse.ArgumentParser, *, local: bool) -> None:
    """``--gpu``; ``local`` commands run ranks here and default to the detected device."""
    default = "the detected device (cpu without CUDA)" if local else "none: give it"
    parser.add_argument("--gpu", default=None, help=f"{GPU_HELP} (default: {default})")


def add_shape_arguments(parser: argparse.ArgumentParser, *, seq: bool = True, gbs: bool = True) -> None:
    """``--seq``, ``--gbs`` and ``--precision`` with the shared help (the rule is in :func:`resolve_shape`)."""
    if seq:
        parser.add_argument("--seq", type=int, default=None,
                            help=f"sequence length in tokens (default: {CPU_SEQ} with --gpu cpu; on GPUs give it)")
    if gbs:
        parser.add_argument("--gbs", type=int, default=None,
                            help=f"global batch size in sequences (default: {CPU_GBS} with --gpu cpu; on GPUs give it)")
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
                        help="default: fp32 with --gpu cpu, bf16 on GPUs")


def is_cpu(gpu: str) -> bool:
    return gpu.lower() == "cpu"


def default_precision(gpu: str) -> str:
    """The precision a run on ``gpu`` uses unless told: fp32 on CPU ranks, bf16 on GPUs."""
    return "fp32" if is_cpu(gpu) else "bf16"


@dataclass(frozen=True)
class Shape:
    seq: int
    gbs: int
    precision: str


def resolve_shape(args: argparse.Namespace, gpu: str, command: str) -> Shape:
    """``args.seq``, ``args.gbs`` and ``args.precision`` with the shared defaults for ``gpu``; on GPUs a missing
    ``--seq``/``--gbs`` is one SpecError naming the flags to give."""
    seq, gbs = getattr(args, "seq", None), getattr(args, "gbs", None)
    if is_cpu(gpu):
        seq = CPU_SEQ if seq is None else seq
        gbs = CPU_GBS if gbs is None else gbs
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
                        f"({GPU_HELP.split(': ', 1)[1]}){alternative}")
    return args.gpu


def detected_gpu() -> str:
    """This machine's catalog hardware: ``cpu`` without CUDA, else the catalog GPU the device's name matches."""
    import torch  # only the commands that run ranks here ask

    if not torch.cuda.is_available():
        return "cpu"
    return guess_gpu(torch.cuda.get_device_name(0))


def guess_gpu(device_name: str) -> str:
    lowered = device_name.lower()
    for key in ("h200", "h100", "a100", "b200"):
        if key in lowered:
            return key
    raise SpecError(f"no catalog profile matches the device {device_name!r}; name one with --gpu")
