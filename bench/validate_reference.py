"""Published end-to-end measurements against the cost model: datasheet profile vs calibrated compute figures.

The rows of shared/validation/reference.json (a copy lives in tests/data/) are priced twice:

* ``datasheet``: the catalog profile (what CI's tests/costmodel assert loose bands on);
* ``calibrated``: the same catalog profile with the compute-side fractions measured by ``foldtune calibrate``
  on a GPU machine: the GEMM efficiency curve of the row's precision (an fp8 calibration for fp8 rows,
  a bf16 one for bf16 rows), the HBM copy efficiency and the overlap interference. Network figures stay
  the datasheet's (NVLink 450 GB/s, one 50 GB/s NIC per GPU per direction, 5 / 10 µs), and host-launch
  figures are left out: they describe foldtune's executor, not Megatron's.

Measured fractions are of the datasheet peak, so a curve measured on an H200 prices an H100 run (same
GH100 tensor cores and clocks; the H100's own HBM bandwidth stays in the datasheet). A100 rows have no
calibration and keep the datasheet figures.

    python3 -m bench.validate_reference --bf16 BF16_PROFILE.json --fp8 FP8_PROFILE.json [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

from bench.report import replace_section
from costmodel.reference import tables
from spec.profile_io import load_profile

REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "data" / "reference.json"
HEADING = "## Cost model against published measurements (reference.json)"


def _errors(rows):
    return [p / q - 1 for _, p, q in rows]


def render(result: list[dict], command: str, sources: dict) -> str:
    lines = [HEADING, "", f"Evaluated {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC by `{command}`. "
             "Network: datasheet figures (NVLink 450 GB/s, one 50 GB/s NIC per GPU per direction, 5 / 10 µs "
             "latency). Calibrated compute: " + "; ".join(f"{k}: {v}" for k, v in sources.items()) + ".", ""]
    for t in result:
        lines += [f"### {t['title']}", "", "| row | published | datasheet | error | calibrated | error |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        cal = t["calibrated"] or [None] * len(t["datasheet"])
        for (label, p, q), c in zip(t["datasheet"], cal):
            lines.append(f"| {label} | {q:.4g} | {p:.4g} | {p / q - 1:+.1%} | "
                         + (f"{c[1]:.4g} | {c[1] / q - 1:+.1%} |" if c else "— | — |"))
        for name in ("datasheet", "calibrated"):
            if t[name]:
                e = [abs(x) for x in _errors(t[name])]
                lines.append(f"\n{name}: mean |error| {statistics.mean(e):.1%}, max {max(e):.1%}"
                             + (f" (bar {t['band']:.0%})" if t["band"] else ""))
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bf16", help="profile from foldtune calibrate (bf16)")
    parser.add_argument("--fp8", help="profile from foldtune calibrate --precision fp8")
    parser.add_argument("--reference", default=str(REFERENCE))
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    ref = json.loads(Path(args.reference).read_text())
    bf16 = load_profile(args.bf16) if args.bf16 else None
    fp8 = load_profile(args.fp8) if args.fp8 else None
    result = tables(ref, bf16, fp8)
    sources = {k: f"`{p}` ({prof.source})" for k, p, prof in (("bf16", args.bf16, bf16), ("fp8", args.fp8, fp8))
               if prof is not None}
    text = render(result, "python3 -m bench.validate_reference " + " ".join(argv if argv is not None else sys.argv[1:]),
                  sources)
    print(text)
    if not args.no_write:
        replace_section(HEADING, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
