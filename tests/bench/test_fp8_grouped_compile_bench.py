"""bench/fp8_grouped_compile.py: the flattened grouped fp8 GEMM candidates compile for sm90 on a machine without
a GPU, with their main loop software-pipelined, and the k-grouped walk is one loop (Triton's compiler, no GPU)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")
# compiles eight kernels for sm90 in a child process: the full suite's
pytestmark = pytest.mark.slow


def test_flattened_candidates_compile_for_sm90_pipelined(tmp_path, script):
    out = tmp_path / "compile.json"
    done = script("fp8_grouped_compile", "--flat-only", "--out", str(out), timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["kind"], r["scaling"]) for r in rows} == {(k, s) for k in "mk" for s in ("rowwise", "blockwise")}
    for r in rows:
        assert "error" not in r and r["async_loads"] > 0, r  # compiled, loads issued ahead of the MMAs
        assert r["shared_bytes"] <= 227 * 1024, r
        if r["kind"] == "k":
            assert r["loops"] == 1, r  # the (tile, step) walk: no nested contraction loop
    assert "| m | rowwise | 64x128x128 g8 w4 s4 tma flat |" in done.stdout
