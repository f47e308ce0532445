"""Re-derive a calibrated profile's measured curves from stored raw timings, with this checkout's builder.

``foldtune calibrate`` saves its raw microbenchmark timings beside the profile (``{"profile", "raw"}``).
When the profile builder learns to read more from the same timings (e.g. one collective curve per measured
group size), ``foldtune calibrate rebuild`` writes the profile those timings give now, without a GPU:

    foldtune calibrate rebuild --profile P.json [--raw-from R.json] --out NEW.json

``--raw-from`` takes the raw record of another file: a profile written with ``calibrate --model`` holds the
raw timings of its one-device component run, while the machine curves came from the multi-rank run before
it. Everything the raw record does not measure (component factors, the datasheet figures) is kept from
``--profile``; the command prints which fields changed.
"""

from __future__ import annotations

from dataclasses import fields

from costmodel.calibrate.profile_builder import build_profile
from spec.hardware import HardwareProfile


def rebuild(profile: HardwareProfile, raw: dict) -> HardwareProfile:
    """``profile`` with every curve ``raw`` measures derived again (same name, component factors kept)."""
    return build_profile(profile, raw, name=profile.name)


def changed_fields(old: HardwareProfile, new: HardwareProfile) -> list[str]:
    """Names of the profile fields that differ, with the collective curve keys added or changed."""
    out = []
    for f in fields(HardwareProfile):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if a == b:
            continue
        if f.name == "collective_efficiency":
            da, db = dict(a), dict(b)
            keys = sorted(k for k in db if da.get(k) != db[k]) + sorted(f"-{k}" for k in da if k not in db)
            out.append(f"collective_efficiency ({', '.join(keys)})")
        else:
            out.append(f.name)
    return out
