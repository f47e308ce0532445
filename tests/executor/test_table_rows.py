"""executor/microbench/table_rows.py: which rows of a stored layout table run, and what a failed run leaves."""

import pytest

from executor.microbench.table_rows import launch_rows, matching_rows
from spec.parallel_config import ParallelConfig

TABLE = {"rows": [
    {"layout": "tp1 cp1 pp1 vpp1 ep1 etp1 dp1 edp1 mbs1", "ok": True,
     "config": ParallelConfig(world_size=1).to_dict()},
    {"layout": "tp1 cp1 pp1 vpp1 ep1 etp1 dp1 edp1 mbs2", "ok": False,
     "config": ParallelConfig(world_size=1, micro_batch_size=2).to_dict()},
]}


def test_rows_by_substring_and_by_outcome():
    assert [r["layout"][-4:] for r in matching_rows(TABLE, "")] == ["mbs1", "mbs2"]
    assert [r["layout"][-4:] for r in matching_rows(TABLE, " mbs2, nothing")] == ["mbs2"]
    assert matching_rows(TABLE, "mbs2", ok_only=True) == []


def _double_mbs(rank, world_size, factor):
    return 2 * factor


def _fail(rank, world_size, message):
    raise RuntimeError(message)


@pytest.mark.slow  # spawns ranks (13 s); tests/executor/test_launch.py keeps launching in the fast tier
def test_successes_are_yielded_and_failures_recorded(capsys):
    results = []
    done = list(launch_rows(TABLE["rows"], _double_mbs, lambda c: (c.micro_batch_size,), results))
    assert [(r["layout"][-4:], c.micro_batch_size, run.results) for r, c, run in done] == [
        ("mbs1", 1, [2]), ("mbs2", 2, [4])]
    assert results == []
    assert list(launch_rows(TABLE["rows"][:1], _fail, lambda c: ("no such kernel",), results)) == []
    assert results[0]["layout"].endswith("mbs1") and "no such kernel" in results[0]["failure"]
    assert "failed" in capsys.readouterr().out
