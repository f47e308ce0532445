"""bench/interval_coverage.py over the stored layout tables (stored data only): every call's rows re-priced and
judged, and the bar of the intervals: they hold the measured step for at least their stated rate of the rows."""

from __future__ import annotations

import re

from costmodel.uncertainty import RATE


def test_interval_coverage_bench_meets_the_stated_rate(script):
    done = script("interval_coverage", "--no-write", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for label in ("tiny-moe, 4 CPU ranks", "three proxies, 2 × H200 (O)", "every GPU row"):
        assert label in out, label
    covered = re.search(r"every row\s+(\d+)/(\d+) = ([0-9.]+)%", out)
    assert covered, out
    n, rows = int(covered[1]), int(covered[2])
    assert rows > 500 and n / rows >= RATE, out
