"""bench/fp8_quant_speed.py end to end on CPU, in Triton's interpreter."""

import json

import pytest

from executor.microbench.quant_tiles import variants

# a whole script run in a child process: the full suite's; the code it drives has fast tests in its package
pytestmark = pytest.mark.slow


def test_tiny_rows_sweep_runs_in_the_interpreter_and_every_variant_equals_torch(tmp_path, script):
    """The bench end to end on CPU (Triton's interpreter, every dim / 64): each rowwise variant timed, checked
    byte for byte against the torch path, and a best picked among the equal ones."""
    pytest.importorskip("triton")
    out = tmp_path / "quant.json"
    done = script("fp8_quant_speed", "--tiny", "--families", "rows", "--out", str(out),
                  env={"TRITON_INTERPRET": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    res = json.loads(out.read_text())
    rows = res["families"]["rows"]
    assert len(rows["variants"]) == len(variants("rows"))
    assert all(r["all_equal"] and r["step_s"] > 0 for r in rows["variants"])
    assert rows["best"] is not None and res["hw_cast"] is False  # no GPU: the integer rounding
    assert "rows: ms a step" in done.stdout
