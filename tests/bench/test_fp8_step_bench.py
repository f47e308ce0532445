"""bench/fp8_step.py's CPU smoke mode: both precisions run from the same init and data, and it reports
tokens/s, the ratio, the loss difference and a top-10 table."""

from __future__ import annotations

import json

from bench import fp8_step


def test_tiny_mode_compares_bf16_and_fp8_steps(tmp_path, capsys):
    out = tmp_path / "fp8_step.json"
    assert fp8_step.main(["--tiny", "--steps", "3", "--warmup", "1", "--runs", "bf16,fp8", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    bf16, fp8 = res["bf16"], res["fp8"]
    assert len(bf16["losses"]) == len(fp8["losses"]) == 3
    assert fp8["kernel_backend"] == "torch-fp8" and bf16["kernel_backend"] == "torch"
    assert fp8["fp8"]["gemm_calls"]["emulated"] > 0  # the fp8 run did quantise
    assert bf16["losses"] != fp8["losses"]
    # same init and data: e4m3 rounding moves the tiny model's losses by well under the 1 % bar
    cmp = res["compare"]["fp8"]
    assert cmp["max_rel_loss_diff"] < 0.01 and cmp["loss_ok"]
    assert cmp["speedup"] == fp8["tokens_per_s"] / bf16["tokens_per_s"]
    assert "fp8_fast_accum" not in res
    assert 0 < len(fp8["top_kernels_per_step"]) <= fp8_step.TOP_KERNELS
    assert "fp8 / bf16 tokens/s" in capsys.readouterr().out
