"""Repack the wheelhouse's Ray wheel without the libraries foldtune never imports, so that a device call can
carry Ray with the rest of `.whl/` and the working tree under the 64 MiB limit.

`../shared/gpu/wheelhouse.sh` already drops Ray's Java jars (43 MiB left); `.whl/` with it and a 12.5 MiB
working tree come to about 66 MiB. foldtune uses Ray core only (`executor/launch_ray.py`, `executor/rank_pool.py`:
init, remote actors, placement groups, scheduling strategies), so Ray's rllib, data, serve, tune, train and llm
packages go (38.7 MiB left). Checked 2026-11-27 on this machine's Python 3.12: the slim wheel installs with
`pip --no-deps --target`, starts a local Ray and runs actors in a placement group.

    python3 bench/slim_ray_wheel.py            # rewrites .whl/ray-*.whl in place
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import zipfile

DROPPED = ("ray/rllib/", "ray/data/", "ray/serve/", "ray/tune/", "ray/train/", "ray/llm/")


def slim(wheel: pathlib.Path) -> int:
    """Rewrite ``wheel`` without DROPPED packages (their RECORD lines too); the new size in bytes."""
    with tempfile.NamedTemporaryFile(dir=wheel.parent, suffix=".whl", delete=False) as tmp:
        out = pathlib.Path(tmp.name)
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if info.filename.startswith(DROPPED):
                continue
            data = zin.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                keep = [line for line in data.decode().splitlines() if not line.startswith(DROPPED)]
                data = ("\n".join(keep) + "\n").encode()
            zout.writestr(info, data)
    out.replace(wheel)
    return wheel.stat().st_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheelhouse", nargs="?", default=".whl", help="folder holding ray-*.whl (default .whl)")
    args = parser.parse_args(argv)
    wheels = sorted(pathlib.Path(args.wheelhouse).glob("ray-*.whl"))
    if not wheels:
        print("slim_ray_wheel: no ray-*.whl in the wheelhouse (run ../shared/gpu/wheelhouse.sh first)")
        return 2
    for wheel in wheels:
        print(f"{wheel}: {slim(wheel) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
