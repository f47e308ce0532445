"""bench/a2a_probe.py on 2 gloo ranks with tiny shapes: every case reported, B's uneven split honoured."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_probe_on_two_gloo_ranks(tmp_path, script):
    out = tmp_path / "a2a.json"
    done = script("a2a_probe", "--device", "cpu", "--world", "2", "--tiny", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["world"] == 2 and report["device"] and report["date"]
    assert list(report["cases"]) == ["A", "A2", "B", "C", "D", "E", "F", "G", "G_balanced"]
    for name, case in report["cases"].items():
        assert len(case["per_rank"]) == 2, name
        assert case["seconds_max"] > 0 and case["cross_mib_mean"] > 0, name
        assert case["recv_rows_max"] >= case["recv_rows_min"] > 0, name

    b = report["cases"]["B"]
    matrix = b["per_rank"][0]["matrix"]
    assert all(sum(row) == sum(matrix[0]) for row in matrix)  # every rank sends the same number of rows
    for rank, r in enumerate(b["per_rank"]):
        expected = [matrix[p][rank] for p in range(2)]
        assert r["recv_splits"] == expected
        # counted from the received rows' content (each row carries its source rank), not from the lists
        assert r["rows_from"] == expected and r["rows_from_anywhere"] == expected
        assert r["recv_rows"] == sum(expected) and r["verified"]
    assert b["recv_rows_max"] > b["recv_rows_min"]  # the skew reached the receivers
    assert all(r["sizes_match"] for r in report["cases"]["C"]["per_rank"])
    # the dispatcher cases saw the router's real (uneven) splits; forced balance gives equal ones
    for name in ("D", "E", "G"):
        for r in report["cases"][name]["per_rank"]:
            assert sum(r["recv_splits"]) == r["recv_rows"] and r["ep_alltoall_step_seconds"] > 0
    assert {r["recv_rows"] for r in report["cases"]["G_balanced"]["per_rank"]} == {64 * 2}
