"""The seconds each pytest-xdist work unit of the suite took, for the order the workers get them in.

``--dist loadgroup`` hands each worker a whole unit (a test file, or one of the groups named in
tests/conftest.py ``_xdist_groups``) at a time. pytest-xdist orders the units by their number of tests, so the
few-but-long units (the simulated Ray clusters, the CLI jobs, the fault tests) came last and one worker ran
them alone while the other had finished: the suite's tail. tests/conftest.py orders them longest first
instead, by the seconds recorded in ``group_durations.json`` beside this file; a unit without a record counts
``UNRECORDED_TEST_SECONDS`` per test. The order only decides which worker runs what when: no test depends on it.

Refresh the record from a run of the whole suite with ``--durations=0`` (its report names each test's unit
after an ``@``)::

    python3 -m pytest -q -n 2 --dist loadgroup --durations=0 > /tmp/suite.log
    python3 -m tests.group_durations /tmp/suite.log
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

RECORD = Path(__file__).with_name("group_durations.json")
#: seconds a test of a unit without a record is counted as: pytest's report leaves out tests under 5 ms, so a
#: unit missing from a full run's record is one of those (a file added since counts the same, and runs late)
UNRECORDED_TEST_SECONDS = 0.005

# a test's id may hold spaces (layout labels); its unit is what follows the last '@'
_LINE = re.compile(r"^([\d.]+)s (?:setup|call|teardown)\s+.+@(\S+)$")


def recorded() -> dict[str, float]:
    """The recorded seconds per work unit (empty when there is no record or it cannot be read)."""
    try:
        data = json.loads(RECORD.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}


def from_report(lines) -> dict[str, float]:
    """Seconds per work unit summed over the setup, call and teardown lines of pytest's ``--durations`` report."""
    seconds: Counter[str] = Counter()
    for line in lines:
        match = _LINE.match(line.strip())
        if match:
            seconds[match.group(2)] += float(match.group(1))
    return {name: round(total, 2) for name, total in seconds.items()}


def weights(units: dict[str, int], record: dict[str, float]) -> dict[str, float]:
    """Each unit's expected seconds: its record, else its test count times ``UNRECORDED_TEST_SECONDS``.
    ``units`` maps a unit's name to its number of tests."""
    return {name: record.get(name, count * UNRECORDED_TEST_SECONDS) for name, count in units.items()}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python3 -m tests.group_durations PYTEST_LOG (a run with -n 2 --durations=0)", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8", errors="replace") as log:
        lines = log.readlines()
    if not any("= slowest durations =" in line for line in lines):
        print(f"{argv[0]}: not a report of every test's duration (run with --durations=0, not --durations=N)",
              file=sys.stderr)
        return 1
    seconds = from_report(lines)
    if not seconds:
        print(f"{argv[0]}: no '--durations=0' lines naming a work unit (run under -n 2 --dist loadgroup)",
              file=sys.stderr)
        return 1
    RECORD.write_text(json.dumps({k: round(v, 1) for k, v in sorted(seconds.items())}, indent=0) + "\n")
    print(f"{len(seconds)} work units, {sum(seconds.values()):.0f} s in all, written to {RECORD}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
