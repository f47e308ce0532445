"""Where the benches leave their results: JSON files under bench/results and their own section of
docs/benchmarks.md (other benches share the file), with the devices and time of the measurement."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "bench" / "results"


def machine() -> str:
    """The devices a table was measured on, in words."""
    try:
        import torch  # optional: a machine without torch is described by its CPU

        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs)"


def utc_now() -> str:
    """Now in UTC to the minute, as the results state when they were measured."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def save_json(data: dict, name: str, results_dir: Path = RESULTS) -> Path:
    """Write ``data`` as ``results_dir/name`` (indented JSON); the path."""
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / name
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def add_report_arguments(parser, out_name: str) -> None:
    """A GPU bench's report flags on ``parser`` (argparse): ``--out`` (its JSON, default ``$OUT/out_name``),
    ``--no-write`` (leave docs/benchmarks.md alone) and ``--commit`` (the code's commit the docs name)."""
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), out_name))
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--commit", default=os.environ.get("COMMIT"),
                        help="the code's commit, for the docs (default: $COMMIT; a copied tree's git may be stale)")


def replace_section(heading: str, text: str, doc: Path = DOC) -> None:
    """Replace the section that starts with the line ``heading`` (up to the next '## ') or append it."""
    doc.parent.mkdir(parents=True, exist_ok=True)
    old = doc.read_text() if doc.exists() else "# Benchmarks\n"
    start = old.find(heading + "\n")
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
    else:
        end = old.find("\n## ", start + len(heading))
        new = old[:start] + text.rstrip("\n") + "\n" + ("\n" + old[end + 1:] if end >= 0 else "")
    doc.write_text(new)
