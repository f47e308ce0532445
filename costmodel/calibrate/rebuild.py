"""Re-derive a calibrated profile's measured curves from stored raw timings, with this checkout's builder.

``foldtune calibrate`` saves its raw microbenchmark timings beside the profile (``{"profile", "raw"}``).
When the profile builder learns to read more from the same timings (e.g. one collective curve per measured
group size), this writes the profile those timings give now, without a GPU:

    python bench/rebuild_profile.py --profile P.json [--raw-from R.json] --out NEW.json

``--raw-from`` takes the raw record of another file: a profile written with ``calibrate --model`` holds the
raw timings of its one-device component run, while the machine curves came from the multi-rank run before
it. Everything the raw record does not measure (component factors, the datasheet figures) is kept from
``--profile``; the script prints which fields changed.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spec.errors import FoldtuneError
from spec.hardware import HardwareProfile
from spec.profile_io import load_profile, load_raw, save_profile
from executor.microbench.profile_builder import build_profile


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True, help="the calibrated profile JSON to re-derive")
    parser.add_argument("--raw-from", help="take the raw timings from this file (default: --profile's own)")
    parser.add_argument("--out", required=True, help="where to write the re-derived profile")
    args = parser.parse_args(argv)
    try:
        old = load_profile(args.profile)
        raw = load_raw(args.raw_from or args.profile)
        new = rebuild(old, raw)
    except FoldtuneError as exc:
        print(f"rebuild_profile: {exc}", file=sys.stderr)
        return 2
    save_profile(new, args.out, raw)
    changes = changed_fields(old, new)
    print(f"{args.out}: re-derived from the raw timings of {args.raw_from or args.profile} "
          f"(measured {raw.get('measured_at', '?')}); changed: {'; '.join(changes) or 'nothing'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
