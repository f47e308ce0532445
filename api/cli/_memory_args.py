"""The value of ``--min-headroom`` (``foldtune plan`` and ``tune``): memory per GPU kept free when pruning layouts."""

from __future__ import annotations

import argparse
import re

from spec.hardware import MAX_HEADROOM_FRACTION

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}
_VALUE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
# the most a user may ask to keep free: far above any GPU's memory, small enough to stay exact in a float
_MAX_BYTES = 2**50


def parse_headroom(text: str) -> float:
    """A fraction (``0.1``: 10 % of each GPU's memory) or bytes with an optional unit (``4GiB``, ``6e9``,
    ``512MiB``); argparse.ArgumentTypeError for anything else."""
    match = _VALUE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a fraction below 1 or bytes such as 4GiB, got {text!r}")
    value = float(match.group(1)) * _UNITS[unit]
    if unit and value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is less than one byte")
    if value > _MAX_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r} is more than {_MAX_BYTES} bytes")
    if value < 1 and value > MAX_HEADROOM_FRACTION:
        raise argparse.ArgumentTypeError(f"a fraction must be <= {MAX_HEADROOM_FRACTION}, got {text!r}")
    return value

