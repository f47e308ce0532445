"""bench/fp8_quant_speed.py off the GPU: the variants it tries, the bytes it counts, the equality that keeps a
tile changing a byte from being picked, and its table."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import fp8_quant_speed as bench
from executor.kernels.fp8 import quantize


def test_variants_start_with_the_current_tiles_then_integer_rounding_then_one_key_at_a_time():
    for family in bench.SWEEP:
        tried = bench.variants(family)
        assert tried[:2] == [{}, bench.INTEGER_ROUNDING]
        assert all(len(v) == 1 and next(iter(v.values())) != quantize.TILES[next(iter(v))] for v in tried[2:])
        assert len(tried) == 2 + sum(len([x for x in vals if x != quantize.TILES[k]])
                                     for k, vals in bench.SWEEP[family].items())


def test_bytes_moved_are_one_read_and_the_e4m3_writes():
    t = torch.zeros(32, 64, dtype=torch.bfloat16)
    rows = bench.Case("rows", "t", (32, 64), 1)
    assert bench._bytes_moved(rows, t, None) == 32 * 64 * 3 + 32 * 4  # bf16 read, e4m3 written, a scale a row
    both = bench.Case("both", "t", (32, 64), 1)
    assert bench._bytes_moved(both, t, None) == 32 * 64 * 4 + (32 + 64) * 4  # two e4m3 forms, row + column scales
    groups = quantize.padded_groups(torch.tensor([5, 5, 32], dtype=torch.int32), 32)
    case = bench.Case("groups", "t", (32, 64), 1)
    assert bench._bytes_moved(case, t, groups) == 32 * 64 * 2 + groups.rows * 64 + bench.G * 64 * 4


def test_a_changed_byte_or_scale_is_not_equal():
    x = torch.randn(4, 32).to(torch.bfloat16)
    want = [quantize._quantize_rowwise_torch(x)]
    q, s = quantize._quantize_rowwise_torch(x)
    assert bench._equal((q, s), want)
    q.view(torch.uint8)[1, 3] ^= 1
    assert not bench._equal((q, s), want)
    both = quantize._quantize_both_torch(x)
    assert bench._equal(both, list(quantize._quantize_both_torch(x)))
    (q2, s2), pair = both
    s2[0] *= 2
    assert not bench._equal(((q2, s2), pair), list(quantize._quantize_both_torch(x)))


def test_tiny_rows_sweep_runs_in_the_interpreter_and_every_variant_equals_torch(tmp_path):
    """The bench end to end on CPU (Triton's interpreter, every dim / 64): each rowwise variant timed, checked
    byte for byte against the torch path, and a best picked among the equal ones."""
    pytest.importorskip("triton")
    out = tmp_path / "quant.json"
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "bench.fp8_quant_speed", "--tiny", "--families", "rows", "--out",
                           str(out)], cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    res = json.loads(out.read_text())
    rows = res["families"]["rows"]
    assert len(rows["variants"]) == len(bench.variants("rows"))
    assert all(r["all_equal"] and r["step_s"] > 0 for r in rows["variants"])
    assert rows["best"] is not None and res["hw_cast"] is False  # no GPU: the integer rounding
    assert "rows: ms a step" in done.stdout


def test_table_names_the_best_and_flags_a_differing_variant():
    res = {"copy_GBps": 3000.0, "families": {"rows": {"best": {"rows_whole": (16384, 64)}, "variants": [
        {"tiles": "current", "step_s": 0.004, "per_case": {"x [M, h]": {"GBps": 2500.0, "equal": True}}},
        {"tiles": {"rows_whole": (8192, 32)}, "step_s": 0.003,
         "per_case": {"x [M, h]": {"GBps": 2900.0, "equal": False}}},
        {"tiles": {"rows_whole": (1, 1)}, "error": "CompilationError: too many registers"}]}}}
    text = bench.table(res)
    assert "best {'rows_whole': (16384, 64)}" in text
    assert "4.00  x 2500" in text and "x 2900 DIFFERS" in text and "ERROR CompilationError" in text
