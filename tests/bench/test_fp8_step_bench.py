"""bench/fp8_step.py's CPU smoke mode: both precisions run from the same init and data, and it reports
tokens/s, the ratio, the loss difference and a top-10 table."""

from __future__ import annotations

import json
import re

import pytest

from executor.microbench.fp8_step_bar import max_rise

# a whole script run in a child process: the full suite's; the code it drives has fast tests in its package
pytestmark = pytest.mark.slow

TOP_KERNELS = 10  # kernels the bench prints a run
# each run's process forked from the script's, not spawned: the CPU runs skip re-importing torch, and each still
# runs in a process of its own with its run's environment (the controls' variables)
FORK = ("--start-method", "fork")


@pytest.fixture(scope="module")
def four_runs(tmp_path_factory, script):
    """(the report, what it printed) of one tiny bench of bf16, fp8 and both controls: each run is a fresh
    process of several seconds, so the tests of this module read the same report."""
    out = tmp_path_factory.mktemp("fp8_step") / "fp8_step.json"
    done = script("fp8_step", "--tiny", *FORK, "--steps", "3", "--warmup", "1", "--runs",
                  "bf16,fp8,fp8_emulated,bf16_torch_ce", "--top", "25", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


def test_tiny_mode_compares_bf16_and_fp8_steps(four_runs):
    res, printed = four_runs
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
    # --top 25 keeps 25 ops in the JSON (the CPU profile has more); the table prints the first 10 a run
    assert len(fp8["top_kernels_per_step"]) == 25
    kernel_rows = re.findall(r"^ +[0-9.]+ +[0-9.]+% +x[0-9]+ ", printed, flags=re.MULTILINE)
    assert len(kernel_rows) == 4 * TOP_KERNELS  # four runs
    assert "fp8 / bf16 tokens/s" in printed


def test_tiny_mode_controls_equal_their_references_on_cpu(four_runs, tmp_path, script):
    """On the CPU the fp8 run already is the emulation and the fused cross-entropy does not run, so the
    controls reproduce their references exactly: fp8 against fp8_emulated, bf16_torch_ce and bf16_again
    against bf16 differ by 0; ``--lr`` reaches the trainer (a larger rate moves the losses)."""
    res, printed = four_runs
    assert res["against_emulated"] == {"fp8": 0.0}
    assert res["compare"]["bf16_torch_ce"]["max_rel_loss_diff"] == 0.0
    assert res["fp8_emulated"]["fp8"]["emulated_because"] == "no fp8 GEMM kernels on cpu"
    assert res["compare"]["fp8"]["bf16_max_rise"] == max_rise(res["bf16"]["losses"])
    assert "fp8 against fp8_emulated: max relative loss difference 0.00e+00" in printed
    fast = tmp_path / "lr.json"
    assert script("fp8_step", "--tiny", *FORK, "--steps", "3", "--warmup", "1", "--runs", "bf16,bf16_again", "--lr",
                  "3e-2", "--out", str(fast)).returncode == 0
    moved = json.loads(fast.read_text())
    assert moved["lr"] == 3e-2 and moved["bf16"]["losses"][0] == res["bf16"]["losses"][0]
    assert moved["bf16"]["losses"][1:] != res["bf16"]["losses"][1:]
    # bf16 once more in its own process: the CPU's kernels are deterministic, so no spread at all
    assert moved["compare"]["bf16_again"]["max_rel_loss_diff"] == 0.0


def test_recompute_full_reaches_the_layout_and_leaves_the_losses(four_runs, tmp_path, script):
    """--recompute full re-runs every layer's forward in backward: on the CPU the same losses as without it."""
    res, _ = four_runs
    out = tmp_path / "recompute.json"
    assert script("fp8_step", "--tiny", *FORK, "--steps", "3", "--warmup", "1", "--runs", "bf16", "--recompute", "full",
                  "--out", str(out)).returncode == 0
    again = json.loads(out.read_text())
    assert again["recompute"] == "full" and res["recompute"] == "none"
    assert "recompute=full" in again["bf16"]["layout"] and "recompute" not in res["bf16"]["layout"]
    close = [abs(a - b) <= 1e-6 * abs(b) for a, b in zip(again["bf16"]["losses"], res["bf16"]["losses"])]
    assert len(close) == 3 and all(close)
